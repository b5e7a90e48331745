"""Running estimates the cost-aware controller prices windows with (mesh/speculative/window.py).

Both are built to give the same answer run after run, not the latest sample's: times are
medians of the last few frames per row count (one slow frame, a GC pause or a neighbour's
burst, moves nothing), and acceptance is counted per draft position with a prior, so a
single probe's coin flip cannot swing a decision.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

KEEP = 16  # samples kept per row count
# Until two row counts are timed, a row past the first costs this share of a one-row decode:
# llama-bench on one core, flash attention on, gave 8 rows in 52 ms against 12.2 ms for one.
ROW_SHARE = 0.5


@dataclass
class Line:
    """Seconds as a function of rows, t(r) = base + per_row·(r - 1), from the medians of the
    row counts timed; the fit weighs each count by how often it was timed."""

    samples: dict[int, deque[float]] = field(default_factory=dict)
    _fitted: tuple[float, float] | None = None  # the fit of the samples as they are

    def add(self, rows: int, seconds: float) -> None:
        self.samples.setdefault(rows, deque(maxlen=KEEP)).append(max(seconds, 0.0))
        self._fitted = None

    @property
    def known(self) -> bool:
        return bool(self.samples)

    def at(self, rows: int) -> float:
        if self._fitted is None:
            self._fitted = self.fit()
        base, per_row = self._fitted
        return base + per_row * (rows - 1)

    def fit(self) -> tuple[float, float]:
        """(base, per row): weighted least squares over the row counts timed; with one count
        timed, the prior shape (ROW_SHARE) through it."""
        points = [(r, statistics.median(s), len(s)) for r, s in sorted(self.samples.items())]
        if not points:
            return 0.0, 0.0
        if len(points) == 1:
            r, t, _ = points[0]
            base = t / (1 + ROW_SHARE * (r - 1))
            return base, ROW_SHARE * base
        weight = sum(n for _, _, n in points)
        mean_r = sum(r * n for r, _, n in points) / weight
        mean_t = sum(t * n for _, t, n in points) / weight
        spread = sum(n * (r - mean_r) ** 2 for r, _, n in points)
        per_row = max(sum(n * (r - mean_r) * (t - mean_t) for r, t, n in points) / spread, 0.0)
        return max(mean_t - per_row * (mean_r - 1), 0.0), per_row


@dataclass
class Median:
    """The median of the last KEEP samples: a draft step's cost, the links' share of a round trip."""

    samples: deque[float] = field(default_factory=lambda: deque(maxlen=KEEP))
    value: float = 0.0

    def add(self, seconds: float) -> None:
        self.samples.append(max(seconds, 0.0))
        self.value = statistics.median(self.samples)

    @property
    def known(self) -> bool:
        return bool(self.samples)


@dataclass
class Hazards:
    """Acceptance by draft position: a_i, the chance the i-th draft is accepted given the
    ones before it were. A window of k that accepted m counts a success at positions 1..m
    and, if m < k, a failure at m + 1; later positions were not tried.

    Counts decay (`keep` per window), so the estimate follows the text without chasing
    each window; those of positions a window did not reach decay faster (`stale`), so a
    position the choice stopped trying drifts back to the pooled rate instead of keeping
    what a few early windows said of it (a streak of rejections at position 2 held window 1
    where window 2 paid 9% more). Each position is pooled toward the overall rate with `pool` windows'
    weight, and the overall rate toward `prior` with `prior_weight`: a few rejections at
    the start must not turn speculation off, since off it learns only from rare probes.
    The optimistic reading, what a probe tests, is two standard deviations up."""

    prior: float = 0.6
    prior_weight: float = 8.0
    pool: float = 4.0
    keep: float = 0.995
    stale: float = 0.98
    tried: list[float] = field(default_factory=list)  # per position, 0-based
    accepted: list[float] = field(default_factory=list)

    def add(self, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        reached = min(accepted + 1, proposed)  # positions tried: every accepted one, and the one rejected
        self.tried = [n * (self.keep if i < reached else self.stale) for i, n in enumerate(self.tried)]
        self.accepted = [n * (self.keep if i < reached else self.stale) for i, n in enumerate(self.accepted)]
        while len(self.tried) < reached:
            self.tried.append(0.0)
            self.accepted.append(0.0)
        for i in range(reached):
            self.tried[i] += 1
            self.accepted[i] += i < accepted

    def overall(self, optimistic: bool = False) -> float:
        n = sum(self.tried) + self.prior_weight
        return _bounded((sum(self.accepted) + self.prior * self.prior_weight) / n, n, optimistic)

    def chances(self, k: int, optimistic: bool = False) -> list[float]:
        """P_j for j = 1..k: the chance the first j drafts are all accepted."""
        pooled, spread = self.overall(), self.overall(optimistic)
        out, p = [], 1.0
        for i in range(k):
            if i < len(self.tried):  # a_i, pooled toward the overall rate
                n = self.tried[i] + self.pool
                p *= _bounded((self.accepted[i] + self.pool * pooled) / n, n, optimistic)
            else:
                p *= spread
            out.append(p)
        return out


def _bounded(rate: float, n: float, optimistic: bool) -> float:
    if optimistic:
        rate += 2 * (rate * (1 - rate) / n) ** 0.5
    return min(rate, 0.99)


@dataclass
class Overhead:
    """What a verify frame takes beyond what the cost model gives for it: for a frame sent
    alone, the wall-clock time between its reply and the one before, less the model's lone
    round trip for it (cost_model.gap).

    The model prices the parts it times (drafting, each stage, the links); what it does not
    see (the event loop between replies, the one engine thread switching between the draft
    and stage 0, a busy neighbour) shows here, and is added to every speculative frame
    (`Costs.frame`): a cost per frame, not a share, weighs a few big frames against many
    small ones as the wall clock does.

    Decays per frame (`keep`), with a `prior` of one frame at nothing, so the first frames
    do not decide alone; while nothing speculative is measured it fades (`fade` per plain
    decode), so a verdict reached under a busy neighbour is tried again some thousands of
    rounds later. Never below zero: it is there to catch costs the model misses."""

    keep: float = 0.97
    fade: float = 0.9995
    prior: float = 1.0
    excess: float = 0.0  # decayed sum of realized less predicted seconds
    frames: float = 0.0

    def add(self, predicted: float, realized: float) -> None:
        self.excess = self.excess * self.keep + (realized - predicted)
        self.frames = self.frames * self.keep + 1

    def faded(self) -> None:
        self.excess *= self.fade
        self.frames *= self.fade

    @property
    def value(self) -> float:
        return max(self.excess / (self.frames + self.prior), 0.0)
