"""What a speculative setting earns: tokens per second of a window of k drafts with d frames
in flight, from measured costs (DESIGN.md §6 derives it).

A frame of k drafts feeds k + 1 rows. Stage 0 drafts them on its one engine thread and
computes its layers: `own(k)` = k·c + S0(k + 1). Alone, the frame's round trip is
A(k) = own(k) + ΣS_i(k + 1) + W, the later stages' service times plus the links (W).
With P_j the chance the first j drafts are accepted and q = 1 - P_k the chance a frame meets
a rejection:

- one frame at a time (d = 1), each frame feeds the last committed token and its drafts and
  yields 1 + ΣP_j tokens: the accepted drafts and the target's token after them, so
  rate(k, 1) = (1 + ΣP_j) / A(k);
- with frames ahead (d > 1), a frame's last row checks the next frame's first draft, so the
  target's token after its drafts is not a token more: a frame yields its accepted drafts,
  and a rejection the correction, ΣP_j + q tokens. A rejection voids the frames behind it,
  and the session starts over: a cycle. Its first frame is sent alone and answers after
  A(k); the next ones answer s apart, s being stage 0's pace or the slowest later stage's
  service time, whichever binds (`Costs.spacing`), and the (d + 1)-th only once the first
  reply is back. So frame n = r·d + j + 1 of a cycle answers at A + r·D + j·s, with
  D = max(d·s, A) the time d frames take. A cycle ends at its first rejection, after a
  geometric number of frames (mean 1/q); summing over that law,

    E[cycle] = A + D·P^d / (1 - P^d) + s·q·H / (1 - P^d),   H = Σ_{j<d} j·P^j,  P = P_k

  and rate(k, d) = (ΣP_j + q) / q / (E[cycle] + void), tokens per cycle over its time
  (Wald), void being half a frame at the slowest stage, which may still be running a void
  one when the cycle starts.

A plain decode (k = 0) runs at 1 / A(0). Two earlier forms of this model were wrong on the
20 ms split-2 mesh (BENCHMARKS.md, "Figures behind the code's choices" has the figures):
- counting 1 + ΣP_j for d > 1 too priced window 1 with three frames out too high;
- pricing every accepted frame at the steady period max(s, A/d) priced it too low: a
  rejection every third frame keeps the pipeline from its steady period, and the frames sent
  right behind a lone one answer s apart, not A/d (DESIGN.md §6 has the reply gaps).
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
    # stage 0's pace with frames ahead, by rows, as the loop timed it: None until a setting with
    # frames ahead ran; its parts timed one frame at a time can be far slower (DESIGN.md §6)
    pace: Seconds | None = None

    def own(self, k: int) -> float:
        """own(k): stage 0 drafting k tokens and computing the frame's k + 1 rows."""
        return k * self.draft_step + self.stage0(k + 1)

    def spacing(self, k: int) -> float:
        """s: how far apart frames of k drafts sent ahead answer, stage 0's pace or the
        slowest later stage's, whichever binds. Until the pace is timed, stage 0's parts and
        what a lone frame showed beyond its parts: an unseen cost may be one every frame pays."""
        own = self.pace(k + 1) if self.pace is not None else self.own(k) + self.frame
        return max(own, self.slowest(k + 1))

    def alone(self, k: int) -> float:
        """A(k): a frame of k drafts sent with nothing else in flight, drafting included."""
        return self.own(k) + self.later(k + 1) + self.links


def rates(costs: Costs, chances: list[float], limit: int) -> list[float]:
    """Tokens per second of windows of len(chances) drafts with 1..limit frames in flight,
    `chances` being P_1..P_k; a window of 0 is a plain decode, never sent ahead."""
    k = len(chances)
    if k == 0:
        return [1.0 / costs.alone(0)]
    return [(1 + sum(chances)) / gap(costs, k, 1)] + [ahead(costs, chances, d) for d in range(2, limit + 1)]


def ahead(costs: Costs, chances: list[float], d: int) -> float:
    """rate(k, d) for d > 1: a cycle's tokens over its time (the module docstring derives it)."""
    k, full = len(chances), chances[-1]
    q = 1.0 - full
    alone = costs.alone(k)
    spacing = costs.spacing(k)
    rounds = max(d * spacing, alone)  # D: d frames, bound by stage 0's pace or the round trip
    if q < 1e-9:  # never a rejection: the steady period
        return sum(chances) * d / rounds
    head = full**d
    later = sum(j * full**j for j in range(d))
    cycle = alone + rounds * head / (1 - head) + spacing * q * later / (1 - head)
    cycle += gap(costs, k, d) - alone  # the lone frame that starts a cycle: a void frame's half, its unseen cost
    return (sum(chances) + q) / q / cycle


def gap(costs: Costs, k: int, d: int) -> float:
    """Seconds from the reply before to a lone frame's of k drafts with d in flight (one at a
    time, or the first of a cycle): its round trip A(k), with frames ahead a void frame's
    half, and a verify frame's unseen cost (`Costs.frame`). The loop holds lone frames to it
    (estimates.Overhead)."""
    alone = costs.alone(k)
    if k == 0:
        return alone
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
