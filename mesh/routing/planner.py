"""Split a model's layers into contiguous half-open ranges, one per stage.

Each stage gets a share of the decode work in proportion to its weight (its free memory),
snapped to the architecture's allowed cuts. Work is counted in parameters, which a CPU
decode costs about in proportion to, and the final stage's output head counts too: on
SmolLM2 it is worth 8 layers, measured at 8 (DESIGN.md §5). A mixture-of-experts layer's
work is its active parameters; memory is checked on all its weights (mesh/routing/stage_fit.py).
A plan is computed once and frozen for the topology's lifetime.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from config.errors import MeshpipeError


class PlanError(MeshpipeError):
    """No valid split exists for these stages."""


@dataclass(frozen=True)
class StageRange:
    start: int
    end: int

    @property
    def layers(self) -> int:
        return self.end - self.start


def plan_ranges(layer_count: int, allowed_cuts: Sequence[int], weights: list[float],
                costs: Sequence[float] | None = None, head: float = 0.0) -> list[StageRange]:
    """One range per weight; every layer lands in exactly one range, in order. `costs` is
    each layer's work (default: 1 each) and `head` the final stage's extra work."""
    n = len(weights)
    if n == 0:
        raise PlanError("no stages to plan for")
    cuts = sorted(c for c in set(allowed_cuts) if 0 < c < layer_count)
    if n - 1 > len(cuts):
        raise PlanError(
            f"cannot split {layer_count} layers into {n} stages: only {len(cuts)} allowed cuts"
        )
    if any(w <= 0 for w in weights):
        raise PlanError("stage weights must be positive")
    done = list(itertools.accumulate(costs or [1.0] * layer_count, initial=0.0))  # work before layer c
    if len(done) != layer_count + 1:
        raise PlanError(f"{len(done) - 1} layer costs for {layer_count} layers")
    total, work = sum(weights), done[-1] + head
    chosen: list[int] = []
    for i in range(1, n):
        ideal = sum(weights[:i]) / total  # the share of all work before this cut
        # Leave enough cuts after this one for the stages still to come.
        lo = cuts.index(chosen[-1]) + 1 if chosen else 0
        hi = len(cuts) - (n - 1 - i)
        window = cuts[lo:hi]
        # distances as shares, rounded: a tie is a tie whatever the costs' scale (the earlier cut wins)
        chosen.append(min(window, key=lambda c: (round(abs(done[c] / work - ideal), 9), c)))
    bounds = [0, *chosen, layer_count]
    return [StageRange(a, b) for a, b in itertools.pairwise(bounds)]


@dataclass(frozen=True)
class StageCost:
    """What one decode measurably costs a stage (DESIGN.md §3, where to cut): `fixed_s`
    whatever its range, plus `per_layer_s` for each layer of work it holds."""

    fixed_s: float
    per_layer_s: float

    def time(self, work_layers: float) -> float:
        return self.fixed_s + self.per_layer_s * work_layers


@dataclass(frozen=True)
class LayerWork:
    """Each layer's work and the output head's, in active parameters (packages/parameters.py);
    `total`: each layer's parameters, experts a decode skips too (empty: the same as `costs`)."""

    costs: tuple[float, ...]
    head: float = 0.0
    total: tuple[float, ...] = ()

    def parameters(self, r: StageRange) -> tuple[float, float]:
        """(all parameters, active ones) of the range, the head counted at the final stage."""
        head = self.head if r.end == len(self.costs) else 0.0
        active = sum(self.costs[r.start : r.end]) + head
        return sum((self.total or self.costs)[r.start : r.end]) + head, active

    def of(self, r: StageRange) -> float:
        """The range's work in layers of average size, the head counted at the final stage."""
        mean = sum(self.costs) / len(self.costs)
        head = self.head if r.end == len(self.costs) else 0.0
        return (sum(self.costs[r.start : r.end]) + head) / mean


def predicted_times(ranges: Sequence[StageRange], work: LayerWork, stages: Sequence[StageCost]) -> list[float]:
    """Each stage's predicted time per decode on `ranges`."""
    return [cost.time(work.of(r)) for r, cost in zip(ranges, stages, strict=True)]


def plan_measured(allowed_cuts: Sequence[int], work: LayerWork, stages: Sequence[StageCost]) -> list[StageRange]:
    """The ranges, one per stage in order, whose slowest stage is the fastest: a pipeline
    runs at its bottleneck's pace. Exhaustive over the allowed cuts, by dynamic programming."""
    layer_count, n = len(work.costs), len(stages)
    points = [0, *sorted(c for c in set(allowed_cuts) if 0 < c < layer_count), layer_count]
    if n == 0 or n > len(points) - 1:
        raise PlanError(f"cannot split {layer_count} layers into {n} stages at cuts {points[1:-1]}")
    # best[i][j]: (bottleneck, previous point) for stages 0..i covering layers [0, points[j])
    inf = (float("inf"), -1)
    best = [[inf] * len(points) for _ in range(n)]
    for j in range(1, len(points)):
        best[0][j] = (stages[0].time(work.of(StageRange(0, points[j]))), 0)
    for i in range(1, n):
        for j in range(i + 1, len(points)):
            options = [(max(best[i - 1][k][0], stages[i].time(work.of(StageRange(points[k], points[j])))), k)
                       for k in range(i, j)]
            best[i][j] = min(options)
    bounds, j = [layer_count], len(points) - 1
    for i in range(n - 1, 0, -1):
        j = best[i][j][1]
        bounds.append(points[j])
    bounds.append(0)
    return [StageRange(a, b) for a, b in itertools.pairwise(reversed(bounds))]


def worth_recut(current: Sequence[float], measured: Sequence[float], margin: float = 0.20) -> bool:
    """Re-cut a loaded route only when the measured plan's bottleneck is clearly lower: a
    re-cut reloads every stage, and a calibration is noisy. On a quiet 2-core VM, one range
    on one pinned core timed 20.3-28.0 ms a 4-row decode on eight fresh engines; with a 10%
    margin three of four starts alike re-cut, two ways, on predicted gains of 10-11%, and
    two of those three recalibrated slower than the cut they left (DESIGN.md §3)."""
    return max(measured) < (1.0 - margin) * max(current)
