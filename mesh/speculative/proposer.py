"""What the generate loop drafts with: a `Proposer` (DESIGN.md §6).

Three exist: the draft model (draft.py), prompt lookup (ngram.py), and `Combined`, prompt
lookup first and the draft model where it finds no match. Each proposal says which
proposer made it, so that usage.speculative can say which one produced what was accepted,
and what it cost, for the window controller.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from common.sampling import Proposed, SamplingParams

if TYPE_CHECKING:
    from mesh.constraints.guide import Guide

class Budget(Protocol):
    """How many tokens a proposer may propose this round, by its name: each proposer's window
    controller decides for it (the loop bounds it by context and by what the request may
    lose), and is asked only when that proposer is about to propose. `catch_up`: the rows a
    proposer must feed before its first proposal step (a draft model that sat out part of the
    sequence), which the request pays for too."""

    def __call__(self, name: str, catch_up: int = 0) -> int: ...


@dataclass(frozen=True, slots=True)
class Proposal:
    tokens: list[int]
    by: str  # the proposer that made them: a key of usage.speculative.by_proposer
    seconds: float  # what making them cost, catch-ups left out: the controller's draft time
    q: tuple[Proposed, ...] = ()  # asked with `DraftSampling`: each token's q; none: point masses

    def proposed(self) -> tuple[Proposed, ...]:
        """Each token with the q it was drawn from (a point mass where none was given)."""
        return self.q or tuple(Proposed(t) for t in self.tokens)

    def first(self, n: int) -> Proposal:
        """The first `n` tokens alone."""
        return Proposal(self.tokens[:n], self.by, self.seconds, self.q[:n])


@dataclass(frozen=True, slots=True)
class DraftSampling:
    """A request whose drafts are accepted by rejection sampling (stage/rejection.py): a
    model proposer draws each token from its own distribution, processed as the target's
    (`params`; the penalties count the sequence from `prompt` on), and gives its q."""

    params: SamplingParams
    prompt: int


class Proposer(Protocol):
    """`names` are every name its proposals may carry; `forget` drops a lane's state when
    its session ends. With a `guide` (a constrained request's grammar, standing at the end
    of `sequence`), every token proposed is one the grammar allows, and the guide is left
    where it stood. With `sampling`, a proposer that has a distribution draws from it and
    says what q each token came from; one without (prompt lookup) proposes point masses.

    A proposer that drafts at the final stage (mtp.py) has two members more, found by name:
    `asks(lane, budget, depth)` (the drafts a frame asks the final stage for) and
    `offered(lane, offer)` (what a reply brought)."""

    names: tuple[str, ...]

    async def proposal(self, lane: int, sequence: list[int], budget: Budget,
                       guide: Guide | None = None, sampling: DraftSampling | None = None) -> Proposal: ...

    def forget(self, lane: int) -> None: ...


class Combined:
    """Prompt lookup when it has a match, else the draft model. A lookup costs microseconds
    and, where the text copies, is accepted whole; the draft covers the rest."""

    def __init__(self, first: Proposer, fallback: Proposer) -> None:
        self.first, self.fallback = first, fallback
        self.names = (*first.names, *fallback.names)
        self.remote = next((p for p in (first, fallback) if getattr(p, "asks", None)), None)

    def asks(self, lane: int, budget: Budget, depth: int) -> int:
        return self.remote.asks(lane, budget, depth) if self.remote is not None else 0  # type: ignore[attr-defined]

    def offered(self, lane: int, offer: object) -> None:
        if self.remote is not None:
            self.remote.offered(lane, offer)  # type: ignore[attr-defined]

    async def proposal(self, lane: int, sequence: list[int], budget: Budget,
                       guide: Guide | None = None, sampling: DraftSampling | None = None) -> Proposal:
        found = await ask(self.first, lane, sequence, budget, guide, sampling)
        if found.tokens:
            return found
        return await ask(self.fallback, lane, sequence, budget, guide, sampling)

    def forget(self, lane: int) -> None:
        self.first.forget(lane)
        self.fallback.forget(lane)


async def ask(proposer: Proposer, lane: int, sequence: list[int], budget: Budget, guide: Guide | None,
              sampling: DraftSampling | None) -> Proposal:
    """`proposer.proposal`, naming `sampling` only where a request accepts by rejection."""
    if sampling is None:
        return await proposer.proposal(lane, sequence, budget, guide)
    return await proposer.proposal(lane, sequence, budget, guide, sampling=sampling)
