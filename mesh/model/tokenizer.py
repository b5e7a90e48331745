"""Tokenizer and chat template, read from the model's own GGUF metadata."""

from __future__ import annotations

import codecs
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import jinja2
import llama_cpp
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from config.errors import MeshpipeError
from stage.llama_model import open_llama

# End-of-turn markers that instruct models emit besides their EOS token.
_TURN_ENDS = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|end|>")
# llama.cpp parses these token kinds out of text when asked to parse special tokens.
_SPECIAL = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED


class PromptRefusedError(MeshpipeError, ValueError):
    """The prompt cannot be built as asked (template refusal, too long); HTTP 400."""


class PromptTooLongError(PromptRefusedError):
    """The prompt cannot fit the context, known before it is tokenized."""


@dataclass(frozen=True)
class SpecialToken:
    text: str
    id: int
    control: bool  # a role/turn marker; otherwise user-defined, which plain text also yields
    lstrip: bool  # llama.cpp eats the whitespace before it
    rstrip: bool  # ... and after it


class Tokenizer:
    def __init__(self, gguf: Path, model_id: str) -> None:
        self.model_id = model_id
        self.llm = open_llama(gguf, vocab_only=True)
        self.vocab = llama_cpp.llama_model_get_vocab(self.llm._model.model)
        meta = self.llm.metadata
        self.add_bos = meta.get("tokenizer.ggml.add_bos_token", "true") == "true"
        eos, bos = self.llm.token_eos(), self.llm.token_bos()
        self.bos = bos
        text = self.llm._model.token_get_text
        self.template = meta.get("tokenizer.chat_template")
        self.formatter = (
            Jinja2ChatFormatter(self.template, text(eos) if eos >= 0 else "",
                                text(bos) if bos >= 0 else "")
            if self.template else None
        )
        self._eos = frozenset(self._turn_end_ids() | ({eos} if eos >= 0 else set()))
        self.n_vocab, self.specials = self._read_vocab()
        self.special_by_text = {s.text: s for s in self.specials}
        # Longest first, as llama.cpp matches: "<|im_start|>" before a shorter prefix of it.
        alternatives = sorted(self.special_by_text, key=len, reverse=True)
        self.special_split = re.compile("(" + "|".join(map(re.escape, alternatives)) + ")") \
            if alternatives else None
        # A token never covers more bytes than this: a prompt of B bytes is >= B/max tokens.
        pieces = (len(self.llm.detokenize([i])) for i in range(self.n_vocab))
        self.max_token_bytes = max([*pieces, *(len(s.text.encode()) for s in self.specials), 1])

    def _read_vocab(self) -> tuple[int, tuple[SpecialToken, ...]]:
        n = int(llama_cpp.llama_vocab_n_tokens(self.vocab))
        found = []
        for i in range(n):
            attr = int(llama_cpp.llama_vocab_get_attr(self.vocab, i))
            if attr & _SPECIAL:
                found.append(SpecialToken(self.llm._model.token_get_text(i), i,
                                          bool(attr & llama_cpp.LLAMA_TOKEN_ATTR_CONTROL),
                                          bool(attr & llama_cpp.LLAMA_TOKEN_ATTR_LSTRIP),
                                          bool(attr & llama_cpp.LLAMA_TOKEN_ATTR_RSTRIP)))
        return n, tuple(s for s in found if s.text)

    def token_text(self, token: int) -> bytes:
        """The vocabulary's text of one token, as stored in the GGUF."""
        return bytes(llama_cpp.llama_vocab_get_text(self.vocab, token))

    def _turn_end_ids(self) -> set[int]:
        ids = set()
        for marker in _TURN_ENDS:
            toks = self.llm.tokenize(marker.encode(), add_bos=False, special=True)
            if len(toks) == 1:
                ids.add(toks[0])
        return ids

    def tokenize(self, text: str, special: bool = True, add_bos: bool | None = None,
                 limit: int | None = None) -> list[int]:
        """Token ids of `text`; with `limit`, refuse before tokenizing what cannot fit."""
        data = text.encode()
        if limit is not None:
            self.check_fits(len(data), limit)
        bos = self.add_bos if add_bos is None else add_bos
        return list(self.llm.tokenize(data, add_bos=bos, special=special))

    def check_fits(self, size: int, limit: int) -> None:
        """Refuse a prompt of `size` bytes that must be more than `limit` tokens, untokenized."""
        least = size // self.max_token_bytes
        if least > limit:
            raise PromptTooLongError(f"the prompt is at least {least} tokens, and the context holds {limit}")

    def detokenize(self, tokens: list[int]) -> bytes:
        return bytes(self.llm.detokenize(tokens))

    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        if self.formatter is None:
            # No template in the GGUF: a plain transcript is the least surprising fallback.
            lines = [f"{m['role']}: {m.get('content') or ''}" for m in messages]
            return "\n".join([*lines, "assistant:"])
        try:
            return self.formatter(messages=messages).prompt  # type: ignore[arg-type]
        except jinja2.TemplateError as exc:
            raise PromptRefusedError(f"the model's chat template refused these messages: {exc}") from None

    def eos_tokens(self) -> frozenset[int]:
        return self._eos


class Detokenizer(Protocol):
    """All TextStream needs of a tokenizer, so its tests can feed it bytes without a model."""

    def detokenize(self, tokens: list[int]) -> bytes: ...


class TextStream:
    """Turns a token stream into text deltas without ever splitting a UTF-8 character."""

    def __init__(self, tokenizer: Detokenizer) -> None:
        self.tokenizer = tokenizer
        self.pending = b""

    def push(self, token: int) -> str:
        self.pending += self.tokenizer.detokenize([token])
        try:
            text = self.pending.decode()
        except UnicodeDecodeError as exc:
            if exc.end < len(self.pending) or len(self.pending) - exc.start > 3:
                # genuinely invalid bytes, replaced; a character begun after them still waits
                # (b"\x80\xd5" then b"\x8a" is "\ufffd" then "\u054a", as decoding all at once)
                decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
                text = decoder.decode(self.pending)
                self.pending = decoder.getstate()[0]
                return str(text)
            return ""  # an incomplete character: wait for the next token
        self.pending = b""
        return text

    def flush(self) -> str:
        text, self.pending = self.pending.decode(errors="replace"), b""
        return text
