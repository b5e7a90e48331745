"""What the HTTP frontend needs from the mesh: tokens in, typed events out, and health.

The coordinator implements `Backend`; the OpenAI-compatible API depends on nothing else.
A generation is a stream of frozen events, in the style of mlx-lm's `stream_generate`:
`Sampled` per token and `Resumed` after a rebuilt route; its `Account` (usage, the
acceptance record, how it finished) is read off the request's one record at stage 0
(mesh/serving/request_state.py). Nothing is written into the caller's objects.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal, Protocol, TypeAlias

from common.sampling import Sampled, SamplingParams
from config.errors import MeshpipeError
from mesh.model.tokenizer import Tokenizer
from mesh.reports.health import Health

if TYPE_CHECKING:
    from mesh.constraints.compile import Constraint

__all__ = ["Acceptance", "Account", "Backend", "Generation", "GenerationEvent", "GenerationRequest",
           "MeshBusyError", "MeshUnavailableError", "PromptLogprobs", "RequestRejectedError", "RequestTimeoutError",
           "Resumed"]


class MeshUnavailableError(MeshpipeError):
    """The pipeline route is broken (a stage died or refused); maps to HTTP 503 with
    Retry-After: a rebuilt route usually serves within seconds."""

    retry_after_s = 5


class RequestRejectedError(MeshpipeError):
    """The request cannot be served as asked (e.g. prompt longer than the context); HTTP 400."""


class MeshBusyError(MeshpipeError):
    """Every lane is busy and the queue is full (`--max-queue`); HTTP 429 with Retry-After."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RequestTimeoutError(MeshpipeError):
    """The request ran past `--request-timeout`, waiting included; HTTP 504."""


@dataclass(frozen=True)
class GenerationRequest:
    prompt: Sequence[int]  # kept as a tuple: nothing can change a request under the loop
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_tokens: frozenset[int] = frozenset()
    ignore_eos: bool = False
    constraint: Constraint | None = None  # a grammar every token must follow (mesh/constraints/)
    keep: bool = True  # its tokens stay in its lane for a later request (the prefix cache)
    # the start-up warm-up: it speculates as its window controllers ask, unbounded by what a
    # request may lose (mesh/speculative/ledger.py), since it is there to time what they try
    explore: bool = False
    request_id: str = ""  # the API's id for it (cmpl-..., chatcmpl-...): the log and an error name it
    # the prompt's own logprobs come first (/v1/completions' echo), with sampling.logprobs top ones
    prompt_logprobs: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt", tuple(self.prompt))


@dataclass(frozen=True, slots=True)
class WindowChoice:
    """What a cost-aware window controller chose for a proposer, and why: the window (0:
    off) and frames in flight, with its predicted tokens per second against a plain decode's
    (mesh/speculative/cost_model.py)."""

    window: int
    depth: int
    predicted_tok_s: float
    plain_tok_s: float
    why: str


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
class Account:
    """A generation's account so far, read off its record at stage 0: what usage and
    /metrics report. `finish_reason` is set once it ended by itself (a stop token or
    max_tokens); `completion_tokens` counts the tokens handed to the caller."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens found in the lane's KV (the prefix cache), not prefilled
    resumed: int = 0  # times the route broke under this generation and it went on
    speculative: Acceptance | None = None  # None when no proposer ran
    finish_reason: Literal["stop", "length"] | None = None
    choices: tuple[tuple[str, WindowChoice], ...] = ()  # the cost-aware controllers' choices, by proposer
    rule: str = ""  # how drafts were accepted, with `speculative`: "exact" or "rejection" (DESIGN.md §6)


@dataclass(frozen=True, slots=True)
class Resumed:
    """The route broke under this generation; it was rebuilt and the generation goes on from
    the last token yielded, after `pause_s` of silence."""

    cause: str
    pause_s: float


@dataclass(frozen=True, slots=True)
class PromptLogprobs:
    """The prompt's own log-probabilities, before any token, when the request asked: entry i
    is prompt token i + 1, its logprob given the tokens before it, and the top ones there.
    The first prompt token has none: nothing comes before it."""

    scores: tuple[Sampled, ...]


GenerationEvent: TypeAlias = Sampled | Resumed | PromptLogprobs


class Generation:
    """One generation: its events (`Sampled` per token in order, `Resumed` after a rebuilt
    route), and its `account`, read off the request's record whenever asked, so a consumer
    that stops early (a stop string, a client gone) adds nothing up itself. Closing it
    early frees the session on every stage."""

    def __init__(self, events: AsyncGenerator[GenerationEvent, None], account: Callable[[], Account]) -> None:
        self._events, self._account = events, account

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> GenerationEvent:
        return await anext(self._events)

    async def aclose(self) -> None:
        await self._events.aclose()

    @property
    def account(self) -> Account:
        return self._account()


class Backend(Protocol):
    model_id: str
    ctx_per_session: int

    @property
    def speculative_acceptance(self) -> str:
        """The rule for requests that name none: auto, exact or rejection."""
        ...

    def tok(self) -> Tokenizer:
        """The target's tokenizer and chat template."""
        ...

    async def health(self) -> Health: ...

    def generate(self, req: GenerationRequest) -> Generation:
        """Generate for `req`.

        One `Sampled` per completion token, in order (a stop token ends the generation and
        is not yielded); first, when `req.prompt_logprobs`, one `PromptLogprobs`. `Resumed`
        says the route broke and was rebuilt, and the tokens go on. The account says how it
        ended, once it did by itself. Errors raise from the iterator:
        `RequestRejectedError` before any event, `MeshUnavailableError` at any point.
        Closing the iterator early (a stop string, a client gone) frees the session on
        every stage.
        """
        ...
