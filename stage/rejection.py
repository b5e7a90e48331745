"""Rejection-sampling acceptance at the final stage (Leviathan et al.; Chen et al., 2023).

A drafted token x, drawn by the draft from q, is kept with probability min(1, p(x)/q(x));
on a rejection the token is drawn from the residual max(p - q, 0), normalised, and the rows
after it are void. Whatever q is, each committed token then follows the target's p exactly,
and a draft is kept with probability sum(min(p, q)), the most any rule gets from that draft
(DESIGN.md §6). p is the distribution plain decoding draws from (stage/distribution.py).

The draws at position p come from a generator of (seed, p) apart from the exact-match draw's
and the draft's: an unseeded request's seed is fresh, so they are fresh; a seeded one is
repeatable, though no longer the same on every topology (that is the exact rule's promise).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

import numpy as np

from common.sampling import Proposed, Sampled, SamplingParams
from stage.distribution import probabilities, truncated
from stage.sampling import processed_rows, with_logprobs

if TYPE_CHECKING:
    from stage.frames import FrameSampling

STREAM = 1  # the generators' last key: the exact-match draw has none, the draft's is DRAFT_STREAM
DRAFT_STREAM = 2


class Chooser(Protocol):
    """The randomness of one position: a coin with `chance` of heads, and a token from `probs`."""

    def accept(self, chance: float) -> bool: ...

    def pick(self, probs: np.ndarray) -> int: ...


class Draws:
    """The real chooser: numpy's generator keyed by (seed, position, stream)."""

    def __init__(self, seed: int, position: int, stream: int = STREAM) -> None:
        self.rng = np.random.default_rng([seed & 0xFFFFFFFF, seed >> 32, position, stream])

    def accept(self, chance: float) -> bool:
        return bool(self.rng.random() < chance)

    def pick(self, probs: np.ndarray) -> int:
        return int(self.rng.choice(len(probs), p=probs))


def drawn(row: np.ndarray, params: SamplingParams, position: int) -> Proposed:
    """A draft for `position` drawn from its proposer's processed logits `row` (processed as the
    target's row is), cut to its TOP tokens: that cut distribution is the q it travels with."""
    ids, probs = truncated(probabilities(row, params))
    q = Proposed(-1, tuple(ids.tolist()), tuple(probs.astype(np.float32).tolist()))
    pick = Draws(params.seed, position, DRAFT_STREAM).pick(np.asarray(q.probs()))
    return replace(q, token=q.ids[pick])


def chance(p: np.ndarray, d: Proposed) -> float:
    """The probability of keeping `d`: min(1, p(x)/q(x))."""
    q = d.q()
    return min(1.0, float(p[d.token]) / q) if q > 0 else 0.0


def residual(p: np.ndarray, d: Proposed) -> np.ndarray:
    """max(p - q, 0), normalised: where a rejection draws. Zero at the rejected token, since a
    rejection happens only where p(x) < q(x). Where it sums to nothing (p <= q everywhere, so
    no rejection can happen but by rounding) it is p itself."""
    r = p.copy()
    if d.ids:
        r[np.asarray(d.ids)] -= np.asarray(d.probs())
    else:
        r[d.token] -= 1.0
    np.maximum(r, 0.0, out=r)
    total = r.sum()
    return r / total if total > 0 else p


def verify(dists: Sequence[np.ndarray], proposed: Sequence[Proposed], first: int,
           draws: Callable[[int], Chooser]) -> list[int]:
    """One token per row of `dists` (p at positions first, first + 1, ...), checking
    `proposed[i]` against `dists[i]`: the drafts kept, then a residual draw at the first
    rejection, or a draw from the row after the last draft. Rows past a rejection are void
    and repeat its token (stage 0 reads no further than the first token unlike its draft)."""
    assert len(dists) == len(proposed) + 1, "a row to check each draft, and one after"
    out: list[int] = []
    for i, d in enumerate(proposed):
        c = draws(first + i)
        if c.accept(chance(dists[i], d)):
            out.append(d.token)
            continue
        out.append(c.pick(residual(dists[i], d)))
        return out + [out[-1]] * (len(dists) - len(out))
    out.append(draws(first + len(proposed)).pick(dists[-1]))
    return out


@dataclass(frozen=True)
class Tail:
    """A session's newest sampled row at the final stage: p at `position`, and the processed
    logits it came from (for logprobs). A frame whose first fed token is itself a draft (sent
    while the frame before it was out) has that draft checked here, against the row that
    predicted it: the frame before had not seen it."""

    position: int
    dist: np.ndarray
    row: np.ndarray


def verify_frame(logits: np.ndarray, frame: FrameSampling, start: int, rows: int,
                 tail: Tail | None) -> tuple[list[Sampled], Tail]:
    """The reply's tokens for a frame of `rows` input rows fed at `start` whose last
    len(logits) rows are sampled, under REJECTION, and the session's new tail. A frame that
    `checks_first` answers one token more, first: the verdict on its first fed token."""
    params = frame.params
    processed = processed_rows(logits, params, frame.history, frame.drafts, frame.masks)
    dists = [probabilities(row, params) for row in processed]
    first = start + rows - len(logits) + 1
    if frame.checks_first:
        if tail is None or tail.position != start:
            raise ValueError(f"no row at position {start} to check the frame's first draft against")
        dists, processed, first = [tail.dist, *dists], np.vstack([tail.row, processed]), start
    tokens = verify(dists, frame.proposed, first, lambda at: Draws(params.seed, at))
    return with_logprobs(tokens, processed, params), Tail(start + rows, dists[-1], processed[-1])
