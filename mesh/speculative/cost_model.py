"""What a speculative setting earns: tokens per second of a window of k drafts with d frames
in flight, from measured costs (DESIGN.md §6 derives it).

A frame of k drafts feeds k + 1 rows. Stage 0 drafts them on its one engine thread and
computes its layers: `own(k)` = k·c + S0(k + 1). Alone, the frame's round trip is
A(k) = own(k) + ΣS_i(k + 1) + W, the later stages' service times plus the links (W).
With d frames in flight and every draft accepted, replies come one period apart:
T(k, d) = max(own(k), max_i S_i(k + 1), A(k) / d): stage 0, the slowest later stage, or
the round trip shared by d frames, whichever binds. A frame whose drafts are all accepted
(chance P_k) costs T; one that rejects voids the frames behind it, so the next one starts
alone and costs A, plus, with frames ahead, half a frame at the slowest stage, which may
still be running a void one. With P_j the chance the first j drafts are accepted:

- one frame at a time (d = 1), each frame feeds the last committed token and its drafts and
  yields 1 + ΣP_j tokens: the accepted drafts and the target's token after them, so
  rate(k, 1) = (1 + ΣP_j) / A(k);
- with frames ahead (d > 1), a frame's last row checks the next frame's first draft, so the
  target's token after its drafts is not a token more: in step, a frame yields its accepted
  drafts, and a rejection the correction, ΣP_j + (1 - P_k) tokens, and

    rate(k, d) = (Σ_{j≤k} P_j + 1 - P_k) / (P_k·T(k, d) + (1 - P_k)·(A(k) + void(d)))

A plain decode (k = 0) runs at 1 / A(0). Counting 1 + ΣP_j for d > 1 too, as this model first
did, priced window 1 with three frames out at 40 tok/s on a 20 ms mesh where it ran at 25-33.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

Seconds = Callable[[int], float]  # seconds as a function of rows


@dataclass(frozen=True)
class Costs:
    draft_step: float  # c: one draft token
    stage0: Seconds  # S0(rows): stage 0's own time for a frame
    slowest: Seconds  # max_i S_i(rows) over the later stages (0 with none)
    later: Seconds  # Σ S_i(rows) over the later stages
    links: float  # W: the round trip less every stage's time
    frame: float = 0.0  # what a verify frame costs beyond these parts, as the wall clock showed (estimates.Overhead)

    def own(self, k: int) -> float:
        """own(k): stage 0 drafting k tokens and computing the frame's k + 1 rows."""
        return k * self.draft_step + self.stage0(k + 1)

    def alone(self, k: int) -> float:
        """A(k): a frame of k drafts sent with nothing else in flight, drafting included."""
        return self.own(k) + self.later(k + 1) + self.links


def rates(costs: Costs, chances: list[float], limit: int) -> list[float]:
    """Tokens per second of windows of len(chances) drafts with 1..limit frames in flight,
    `chances` being P_1..P_k; a window of 0 is a plain decode, never sent ahead."""
    k = len(chances)
    if k == 0:
        return [1.0 / costs.alone(0)]
    full, accepted = chances[-1], sum(chances)
    ahead = accepted + 1 - full  # a frame's tokens in step with others out (the docstring says why)
    return [(1 + accepted) / gap(costs, k, 1, False)] + [
        ahead / (full * gap(costs, k, d, True) + (1 - full) * gap(costs, k, d, False)) for d in range(2, limit + 1)]


def gap(costs: Costs, k: int, d: int, full: bool) -> float:
    """Seconds from the reply before to a frame's of k drafts with d in flight: the period
    T(k, d) when every draft was accepted, else the lone round trip and a void frame's half;
    a verify frame's unseen cost (`Costs.frame`) on top."""
    alone = costs.alone(k)
    if k == 0:
        return alone
    if full:
        period = max(costs.own(k), costs.slowest(k + 1), alone / d)
        return min(period, alone) + costs.frame  # never worse than waiting
    return alone + (costs.slowest(k + 1) / 2 if d > 1 else 0.0) + costs.frame


@dataclass(frozen=True)
class Option:
    """One setting priced: a window of `window` drafts with `depth` frames in flight."""

    window: int
    depth: int
    tok_s: float


def options(costs: Costs, chances: list[float], windows: range, limit: int) -> list[Option]:
    """Every (window, depth) within the bounds priced, a plain decode first; `chances` are
    P_1.. up to the largest window."""
    out = [Option(0, 1, rates(costs, [], 1)[0])]
    for k in windows:
        out += [Option(k, d + 1, r) for d, r in enumerate(rates(costs, chances[:k], limit))]
    return out
