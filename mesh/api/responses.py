"""OpenAI response bodies as pydantic models, shared by the server (`responder.py`, `shape.py`) and the bench client.

Field order is the JSON key order. A null the API documents stays in the JSON (`finish_reason`,
`logprobs`, `refusal`); a field OpenAI leaves out when it has nothing to say (`usage` on a
stream chunk, `usage.speculative` without a draft, a delta's `role`) is left out, not null.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from mesh.backend import Acceptance, Account, WindowChoice


def _absent(value: Any) -> bool:
    return value is None


class _Body(BaseModel):
    model_config = ConfigDict(frozen=True)  # extra fields are ignored: a client may read a newer server


class ProposerUsage(_Body):
    """One proposer's share of `usage.speculative`."""

    windows: int
    proposed: int
    accepted: int
    accept_rate: float

    @classmethod
    def of(cls, a: Acceptance) -> ProposerUsage:
        return cls(windows=a.windows, proposed=a.proposed, accepted=a.accepted, accept_rate=round(a.accept_rate, 4))


class ControllerUsage(_Body):
    """What a cost-aware window controller chose for a proposer, and why."""

    window: int  # 0: off
    frames_in_flight: int
    predicted_tok_s: float
    plain_tok_s: float  # its prediction without speculation
    why: str

    @classmethod
    def of(cls, c: WindowChoice) -> ControllerUsage:
        return cls(window=c.window, frames_in_flight=c.depth, predicted_tok_s=c.predicted_tok_s,
                   plain_tok_s=c.plain_tok_s, why=c.why)


class SpeculativeUsage(_Body):
    """meshpipe's own usage field: how the draft did, in all and by proposer ("draft", "ngram")."""

    windows: int
    proposed: int
    accepted: int
    accept_rate: float
    mean_window: float
    by_proposer: dict[str, ProposerUsage] | None = Field(default=None, exclude_if=_absent)  # absent: none proposed
    controller: dict[str, ControllerUsage] | None = Field(default=None, exclude_if=_absent)  # cost-aware only
    acceptance: str | None = Field(default=None, exclude_if=_absent)  # the rule: "exact" or "rejection"

    @classmethod
    def of(cls, acceptance: Acceptance, choices: tuple[tuple[str, WindowChoice], ...] = (),
           rule: str = "") -> SpeculativeUsage:
        a = acceptance
        by = {name: ProposerUsage.of(record) for name, record in a.by} or None
        chose = {name: ControllerUsage.of(choice) for name, choice in choices} or None
        return cls(windows=a.windows, proposed=a.proposed, accepted=a.accepted, accept_rate=round(a.accept_rate, 4),
                   mean_window=round(a.mean_window, 3), by_proposer=by, controller=chose, acceptance=rule or None)


class PromptTokensDetails(_Body):
    cached_tokens: int  # found in the KV (the prefix cache), as OpenAI reports prompt caching


class Usage(_Body):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # a default, so a client parsing an older server's usage still reads it
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=lambda: PromptTokensDetails(cached_tokens=0))
    speculative: SpeculativeUsage | None = Field(default=None, exclude_if=_absent)
    resumed: int | None = Field(default=None, exclude_if=_absent)  # route rebuilds the request lived through

    @classmethod
    def of(cls, done: Account) -> Usage:
        spec = SpeculativeUsage.of(done.speculative, done.choices, done.rule) if done.speculative is not None else None
        return cls(prompt_tokens=done.prompt_tokens, completion_tokens=done.completion_tokens,
                   total_tokens=done.prompt_tokens + done.completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=done.cached_tokens), speculative=spec,
                   resumed=done.resumed or None)


class TopLogprob(_Body):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Body):
    content: list[TokenLogprob]
    refusal: str | None = None


class CompletionLogprobs(_Body):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token, which nothing predicts
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]

    def then(self, later: CompletionLogprobs) -> CompletionLogprobs:
        """These entries, then `later`'s: an echoed prompt's, then the completion's."""
        return CompletionLogprobs(tokens=self.tokens + later.tokens,
                                  token_logprobs=self.token_logprobs + later.token_logprobs,
                                  top_logprobs=self.top_logprobs + later.top_logprobs,
                                  text_offset=self.text_offset + later.text_offset)


class ChatMessage(_Body):
    role: Literal["assistant"] = "assistant"
    content: str | None  # None beside tool calls with no text before them
    refusal: str | None = None
    tool_calls: list[dict[str, Any]] | None = Field(default=None, exclude_if=_absent)


class ChatChoice(_Body):
    index: int = 0
    finish_reason: str | None
    logprobs: ChatLogprobs | None
    message: ChatMessage


class ChatCompletion(_Body):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(_Body):
    role: Literal["assistant"] | None = Field(default=None, exclude_if=_absent)  # the first chunk's only
    content: str | None = Field(default=None, exclude_if=_absent)  # absent from the last chunk
    tool_calls: list[dict[str, Any]] | None = Field(default=None, exclude_if=_absent)


class ChatChunkChoice(_Body):
    index: int = 0
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None  # always sent; a default so the bench reads llama-server's chunks too
    delta: ChatDelta


class ChatCompletionChunk(_Body):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = Field(default=None, exclude_if=_absent)  # only on the usage chunk, which has no choices


class CompletionChoice(_Body):
    index: int = 0
    finish_reason: str | None
    logprobs: CompletionLogprobs | None
    text: str


class Completion(_Body):
    """A /v1/completions body, and each of its stream chunks: OpenAI streams the same object."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = Field(default=None, exclude_if=_absent)  # always in a body; in a stream, its last chunk
