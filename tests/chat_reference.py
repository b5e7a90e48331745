"""Chat prompts, what the unsplit model answers to them, and a chat call through the openai client."""

from __future__ import annotations

from pathlib import Path

import openai
from chain import reference_greedy
from openai.types.chat import ChatCompletionMessageParam

from mesh.model.source import EMBEDDED_ID
from mesh.model.tokenizer import Tokenizer

PROMPTS = ["Write a haiku about the sea.", "List three kinds of fruit.",
           "Explain what a CPU does in one sentence.", "Tell me a joke about cats."]
MAX_TOKENS = 48


def unsplit_texts(gguf: Path) -> dict[str, str]:
    """Greedy answers of llama-cpp-python's unsplit model, cut at EOS, for every prompt."""
    tok = Tokenizer(gguf, EMBEDDED_ID)
    texts = {}
    for p in PROMPTS:
        prompt = tok.tokenize(tok.render_chat([{"role": "user", "content": p}]))
        out = []
        for t in reference_greedy(gguf, prompt, MAX_TOKENS):
            if t in tok.eos_tokens():
                break
            out.append(t)
        texts[p] = tok.detokenize(out).decode(errors="replace")
    return texts


def chat(client: openai.OpenAI, prompt: str, stream: bool = False) -> str:
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": prompt}]
    if not stream:
        r = client.chat.completions.create(model=EMBEDDED_ID, messages=messages,
                                           temperature=0, max_tokens=MAX_TOKENS)
        assert r.usage is not None
        assert r.usage.completion_tokens > 0
        return r.choices[0].message.content or ""
    chunks = client.chat.completions.create(model=EMBEDDED_ID, messages=messages, temperature=0,
                                            max_tokens=MAX_TOKENS, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
