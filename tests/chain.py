"""Drive a chain of in-process range engines: the reference pipeline for engine tests."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from packages.manifest import load_manifest
from packages.materialize import materialize_stage
from stage.engine import RangeEngine, Step
from stage.llama_engine import EngineConfig, LlamaRangeEngine
from stage.llama_model import open_llama
from stage.sampling import log_softmax, top_logprobs


def build_chain(package: Path, cuts: list[int], cache: Path, lanes: int = 4,
                ctx: int = 512) -> list[LlamaRangeEngine]:
    manifest, sha = load_manifest(package)
    bounds = [0, *cuts, manifest.layer_count]
    engines = []
    for a, b in itertools.pairwise(bounds):
        gguf = materialize_stage(package, manifest, sha, a, b, cache)
        cfg = EngineConfig(first=a == 0, final=b == manifest.layer_count, lanes=lanes,
                           ctx_per_lane=ctx)
        engines.append(LlamaRangeEngine(gguf, cfg))
    return engines


def forward(engines: Sequence[RangeEngine], batch: list[tuple[int, int, list[int]]]) -> list[np.ndarray]:
    """One pass of several sessions (lane, start, tokens) through every stage (of any engine); final logits."""
    data: list[np.ndarray] = [np.asarray(t, dtype=np.int32) for _, _, t in batch]
    for e in engines:
        steps = [
            Step(lane=lane, start=start, tokens=x) if e.first else Step(lane=lane, start=start, hidden=x)
            for (lane, start, _), x in zip(batch, data, strict=True)
        ]
        data = e.step(steps)
    return data


def greedy(engines: Sequence[RangeEngine], prompt: list[int], n: int, lane: int = 0) -> list[int]:
    tokens, out = list(prompt), []
    start = 0
    for _ in range(n):
        logits = forward(engines, [(lane, start, tokens[start:])])[0]
        start = len(tokens)
        tokens.append(int(np.argmax(logits[-1])))
        out.append(tokens[-1])
    return out


def greedy_scored(engines: Sequence[RangeEngine], prompt: list[int], n: int,
                  top: int = 3) -> list[tuple[tuple[int, float], ...]]:
    """Greedy decoding that keeps each step's `top` best (token, logprob), best first: the
    chosen token and its logprob lead, and the runners-up show a near tie moving."""
    tokens, out = list(prompt), []
    start = 0
    for _ in range(n):
        logits = forward(engines, [(0, start, tokens[start:])])[0]
        start = len(tokens)
        out.append(top_logprobs(log_softmax(logits[-1:])[0], top))
        tokens.append(out[-1][0][0])
    return out


def close(engines: Sequence[RangeEngine]) -> None:
    for e in engines:
        e.close()


def reference_greedy(gguf: Path, prompt: list[int], n: int) -> list[int]:
    """The unsplit model, run the ordinary way through llama-cpp-python."""
    llm = open_llama(gguf, n_ctx=512, n_threads=2)
    out: list[int] = []
    for tok in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
        out.append(tok)
        if len(out) == n:
            break
    return out


def chat_prompt(gguf: Path, text: str) -> list[int]:
    llm = open_llama(gguf, n_ctx=64, vocab_only=True)
    arch_turns = {
        "gemma3": "<start_of_turn>user\n{t}<end_of_turn>\n<start_of_turn>model\n",
        "llama": "<|im_start|>user\n{t}<|im_end|>\n<|im_start|>assistant\n",
    }
    template = arch_turns["gemma3" if "gemma" in gguf.name else "llama"]
    return llm.tokenize(template.format(t=text).encode(), add_bos="gemma" in gguf.name, special=True)


# A function to copy back with one change: most of the answer is in the prompt, so prompt
# lookup's windows are accepted (SmolLM2 copies most of it, then drifts).
FUNCTION = '''def summarize_orders(orders, tax_rate, discounts):
    total = 0.0
    count = 0
    largest = None
    for order in orders:
        if order.get("cancelled"):
            continue
        amount = order["price"] * order["quantity"]
        code = order.get("discount_code")
        if code in discounts:
            amount = amount * (1 - discounts[code])
        amount = amount * (1 + tax_rate)
        total += amount
        count += 1
        if largest is None or amount > largest:
            largest = amount
    average = total / count if count else 0.0
    return {"total": round(total, 2), "count": count, "average": round(average, 2), "largest": largest}
'''
COPY_HEAVY = f"Add a docstring to this function and return the whole function.\n\n```python\n{FUNCTION}```"
