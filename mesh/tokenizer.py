"""Tokenizer and chat template, read from the model's own GGUF metadata."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from stage.llama_model import open_llama

# End-of-turn markers that instruct models emit besides their EOS token.
_TURN_ENDS = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|end|>")


class Tokenizer:
    def __init__(self, gguf: Path, model_id: str) -> None:
        self.model_id = model_id
        self.llm = open_llama(gguf, vocab_only=True)
        meta = self.llm.metadata
        self.add_bos = meta.get("tokenizer.ggml.add_bos_token", "true") == "true"
        eos, bos = self.llm.token_eos(), self.llm.token_bos()
        text = self.llm._model.token_get_text
        template = meta.get("tokenizer.chat_template")
        self.formatter = (
            Jinja2ChatFormatter(template, text(eos) if eos >= 0 else "", text(bos) if bos >= 0 else "")
            if template else None
        )
        self._eos = frozenset(self._turn_end_ids() | ({eos} if eos >= 0 else set()))

    def _turn_end_ids(self) -> set[int]:
        ids = set()
        for marker in _TURN_ENDS:
            toks = self.llm.tokenize(marker.encode(), add_bos=False, special=True)
            if len(toks) == 1:
                ids.add(toks[0])
        return ids

    def tokenize(self, text: str, special: bool = True) -> list[int]:
        return list(self.llm.tokenize(text.encode(), add_bos=self.add_bos, special=special))

    def detokenize(self, tokens: list[int]) -> bytes:
        return bytes(self.llm.detokenize(tokens))

    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        if self.formatter is None:
            # No template in the GGUF: a plain transcript is the least surprising fallback.
            lines = [f"{m['role']}: {m.get('content') or ''}" for m in messages]
            return "\n".join([*lines, "assistant:"])
        return self.formatter(messages=messages).prompt  # type: ignore[arg-type]

    def eos_tokens(self) -> frozenset[int]:
        return self._eos


class TextStream:
    """Turns a token stream into text deltas without ever splitting a UTF-8 character."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.pending = b""

    def push(self, token: int) -> str:
        self.pending += self.tokenizer.detokenize([token])
        try:
            text = self.pending.decode()
        except UnicodeDecodeError as exc:
            if exc.end < len(self.pending) or len(self.pending) - exc.start > 3:
                text = self.pending.decode(errors="replace")  # genuinely invalid bytes
            else:
                return ""  # an incomplete character: wait for the next token
        self.pending = b""
        return text

    def flush(self) -> str:
        text, self.pending = self.pending.decode(errors="replace"), b""
        return text
