"""One response's OpenAI objects: its JSON body, its stream chunks and their logprobs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from common.sampling import Sampled
from mesh.api.responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    ChatMessage,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from mesh.api.tool_calls import ToolCall
from mesh.backend import Backend


class ResponseShape:
    """The objects one response leaves as, chat or completion; it knows nothing of the
    generation, only what it is handed."""

    def __init__(self, backend: Backend, response_id: str, created: int, chat: bool, logprobs: bool) -> None:
        self.id, self.created, self.model, self.chat = response_id, created, backend.model_id, chat
        self.logprobs = _Logprobs(backend) if logprobs else None

    def chat_body(self, content: str | None, calls: list[ToolCall], made: list[Sampled], reason: str,
                  usage: Usage) -> ChatCompletion:
        message = ChatMessage(content=content, tool_calls=[c.as_dict() for c in calls] or None)
        chat = ChatChoice(finish_reason=reason, logprobs=self._chat_logprobs(made), message=message)
        return ChatCompletion(id=self.id, created=self.created, model=self.model, choices=[chat], usage=usage)

    def completion_body(self, text: str, made: list[Sampled], reason: str, usage: Usage,
                        echo: Echo | None = None) -> Completion:
        """The body; with `echo`, its text and logprobs begin with the prompt's."""
        before = self._echoed(echo)
        logprobs = self._completion_logprobs(made)
        if before is not None and logprobs is not None:
            logprobs = before.then(logprobs)
        text = text if echo is None else echo.text + text
        choice = CompletionChoice(finish_reason=reason, logprobs=logprobs, text=text)
        return Completion(id=self.id, created=self.created, model=self.model, choices=[choice], usage=usage)

    def echo_chunk(self, echo: Echo) -> Completion:
        """A stream's first chunk, when the prompt is echoed: its text, and its logprobs when asked (as vLLM)."""
        choice = CompletionChoice(finish_reason=None, logprobs=self._echoed(echo), text=echo.text)
        return Completion(id=self.id, created=self.created, model=self.model, choices=[choice])

    def _echoed(self, echo: Echo | None) -> CompletionLogprobs | None:
        return self.logprobs.prompt(echo) if self.logprobs is not None and echo is not None else None

    def chunk(self, text: str | None, finish: str | None = None, made: list[Sampled] | None = None,
              role: Literal["assistant"] | None = None) -> ChatCompletionChunk | Completion:
        """One stream chunk. The last has no text, only why it finished; a chunk without
        tokens has no logprobs."""
        made = made or None
        if self.chat:
            delta = ChatDelta(role=role, content=text)
            chat = ChatChunkChoice(finish_reason=finish, logprobs=self._chat_logprobs(made), delta=delta)
            return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[chat])
        choice = CompletionChoice(finish_reason=finish, logprobs=self._completion_logprobs(made), text=text or "")
        return Completion(id=self.id, created=self.created, model=self.model, choices=[choice])

    def delta(self, delta: ChatDelta) -> ChatCompletionChunk:
        choice = ChatChunkChoice(finish_reason=None, logprobs=None, delta=delta)
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[choice])

    def usage_chunk(self, usage: Usage) -> ChatCompletionChunk | Completion:
        body = ChatCompletionChunk if self.chat else Completion
        return body(id=self.id, created=self.created, model=self.model, choices=[], usage=usage)

    def _chat_logprobs(self, made: list[Sampled] | None) -> ChatLogprobs | None:
        return self.logprobs.chat(made) if self.logprobs is not None and made is not None else None

    def _completion_logprobs(self, made: list[Sampled] | None) -> CompletionLogprobs | None:
        return self.logprobs.completion(made) if self.logprobs is not None and made is not None else None


@dataclass(frozen=True)
class Echo:
    """An echoed prompt: its text, its tokens, and (when logprobs were asked) each token's
    after the first, as the backend scored them."""

    text: str
    tokens: Sequence[int]
    scores: Sequence[Sampled] = ()


class _Logprobs:
    """The target's log-probabilities in the shape each endpoint documents."""

    def __init__(self, backend: Backend) -> None:
        self.backend, self.offset = backend, 0

    def _bytes(self, token: int) -> bytes:
        return self.backend.tok().detokenize([token])

    def _entry(self, token: int, logprob: float) -> dict[str, Any]:
        raw = self._bytes(token)
        return {"token": raw.decode(errors="replace"), "logprob": logprob, "bytes": list(raw)}

    def chat(self, made: list[Sampled]) -> ChatLogprobs:
        content = [TokenLogprob(**self._entry(s.token, _lp(s.logprob)),
                                top_logprobs=[TopLogprob(**self._entry(t, lp)) for t, lp in s.top]) for s in made]
        return ChatLogprobs(content=content)

    def completion(self, made: list[Sampled]) -> CompletionLogprobs:
        texts = [self._text(s.token) for s in made]
        return CompletionLogprobs(tokens=texts, token_logprobs=[_lp(s.logprob) for s in made],
                                  top_logprobs=[self._completion_top(s) for s in made],
                                  text_offset=self._offsets(texts))

    def prompt(self, echo: Echo) -> CompletionLogprobs:
        """The prompt's entries: its first token has no logprob and no alternatives (null)."""
        if len(echo.scores) != max(len(echo.tokens) - 1, 0):
            raise ValueError(f"{len(echo.scores)} prompt logprobs for a prompt of {len(echo.tokens)} tokens")
        texts = [self._text(t) for t in echo.tokens]
        return CompletionLogprobs(tokens=texts, token_logprobs=[None, *(_lp(s.logprob) for s in echo.scores)],
                                  top_logprobs=[None, *(self._completion_top(s) for s in echo.scores)],
                                  text_offset=self._offsets(texts))

    def _offsets(self, texts: list[str]) -> list[int]:
        """Where each text begins in the response's text so far, which they then extend."""
        offsets = []
        for text in texts:
            offsets.append(self.offset)
            self.offset += len(text)
        return offsets

    def _text(self, token: int) -> str:
        return self._bytes(token).decode(errors="replace")

    def _completion_top(self, s: Sampled) -> dict[str, float]:
        """The N most likely tokens and, as OpenAI has it, the sampled one: up to N + 1. Where
        two tokens read as the same text, the sampled one's logprob is the one kept."""
        top = {self._text(t): lp for t, lp in s.top}
        top[self._text(s.token)] = _lp(s.logprob)
        return top


def _lp(logprob: float | None) -> float:
    assert logprob is not None, "the backend did not report logprobs that were asked for"
    return logprob
