"""What the HTTP frontend needs from the mesh: tokens in, typed events out, and health.

The coordinator implements `Backend`; the OpenAI-compatible API depends on nothing else.
A generation is a stream of frozen events, in the style of mlx-lm's `stream_generate`:
`Sampled` per token, `Acceptance` after each verify window when a draft is on, and
`Finished` at a normal end. Nothing is written into the caller's objects.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, Protocol, TypeAlias

from common.sampling import Sampled, SamplingParams
from config.errors import MeshpipeError
from mesh.health import Health
from mesh.tokenizer import Tokenizer

__all__ = ["Acceptance", "Backend", "Cached", "Finished", "GenerationEvent", "GenerationRequest",
           "MeshUnavailableError", "RequestRejectedError", "Resumed"]


class MeshUnavailableError(MeshpipeError):
    """The pipeline route is broken (a stage died or refused); maps to HTTP 503."""


class RequestRejectedError(MeshpipeError):
    """The request cannot be served as asked (e.g. prompt longer than the context); HTTP 400."""


@dataclass(frozen=True)
class GenerationRequest:
    prompt: Sequence[int]  # kept as a tuple: nothing can change a request under the loop
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_tokens: frozenset[int] = frozenset()
    ignore_eos: bool = False
    # completion tokens generated before the route broke: a resumed run prefills them after
    # the prompt and goes on from there (DESIGN.md §2, replay-resume)
    done: Sequence[int] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt", tuple(self.prompt))
        object.__setattr__(self, "done", tuple(self.done))

    @property
    def prefill(self) -> tuple[int, ...]:
        """What a run feeds before its first token: the prompt, or when resumed the prompt
        and the completion so far but its last token, which the next frame feeds."""
        return (*self.prompt, *self.done[:-1])


@dataclass(frozen=True, slots=True)
class Acceptance:
    """The draft's record in one generation so far: verify windows, drafts proposed and
    accepted, in all and per proposer ("draft", "ngram"; mesh/speculative/proposer.py)."""

    windows: int = 0
    proposed: int = 0
    accepted: int = 0
    by: tuple[tuple[str, Acceptance], ...] = ()  # per proposer, sorted by name; theirs are empty

    def add(self, proposed: int, accepted: int, by: str) -> Acceptance:
        """The record with one more window, proposed by `by`; a round that proposed nothing
        was a plain decode."""
        if not proposed:
            return self
        window = Acceptance(1, proposed, accepted)
        return self.plus(replace(window, by=((by, window),)))

    def plus(self, other: Acceptance) -> Acceptance:
        """Both records as one: a resumed generation's, before the break and after."""
        by = dict(self.by)
        for name, record in other.by:
            by[name] = by[name].plus(record) if name in by else record
        return Acceptance(self.windows + other.windows, self.proposed + other.proposed,
                          self.accepted + other.accepted, tuple(sorted(by.items())))

    @property
    def accept_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_window(self) -> float:
        return self.proposed / self.windows if self.windows else 0.0


@dataclass(frozen=True, slots=True)
class Finished:
    """The last event of a generation that ended by itself: a stop token or max_tokens."""

    finish_reason: Literal["stop", "length"]
    prompt_tokens: int
    completion_tokens: int
    speculative: Acceptance | None = None  # None when no draft ran
    resumed: int = 0  # times the route broke under this generation and it went on
    cached_tokens: int = 0  # prompt tokens found in the lane's KV (the prefix cache), not prefilled


@dataclass(frozen=True, slots=True)
class Cached:
    """The first event of a generation: the first `tokens` of its prompt were in its KV lane
    already, left there by an earlier request (the prefix cache), and were not prefilled."""

    tokens: int


@dataclass(frozen=True, slots=True)
class Resumed:
    """The route broke under this generation; it was rebuilt and the generation goes on from
    the last token yielded, after `pause_s` of silence."""

    cause: str
    pause_s: float


GenerationEvent: TypeAlias = Sampled | Acceptance | Finished | Resumed | Cached


class Backend(Protocol):
    model_id: str
    ctx_per_session: int

    def tok(self) -> Tokenizer:
        """The target's tokenizer and chat template."""
        ...

    async def health(self) -> Health: ...

    def generate(self, req: GenerationRequest) -> AsyncGenerator[GenerationEvent, None]:
        """Generate for `req`, as events.

        `Cached` comes first. One `Sampled` per completion token, in order (a stop token ends the generation and
        is not yielded). With a draft, the running `Acceptance` comes first and again after
        every verify window, before the tokens that window produced, so a consumer that
        stops early still knows the record of every token it saw. `Resumed` says the route
        broke and was rebuilt, and the tokens go on. `Finished` comes last, and only when
        the generation ends by itself. Errors raise from the iterator:
        `RequestRejectedError` before any event, `MeshUnavailableError` at any point.
        Closing the iterator early (a stop string, a client gone) frees the session on
        every stage.
        """
        ...
