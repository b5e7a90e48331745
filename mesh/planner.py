"""Split a model's layers into contiguous half-open ranges, one per stage.

Each stage gets a share of the decode work in proportion to its weight (its free memory),
snapped to the architecture's allowed cuts. Work is counted in parameters, which a CPU
decode costs about in proportion to, and the final stage's output head counts too: on
SmolLM2 it is worth 8 layers, measured at 8 (DESIGN.md §5). A plan is computed once and
frozen for the topology's lifetime.
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
    total = sum(weights)
    chosen: list[int] = []
    for i in range(1, n):
        ideal = (done[-1] + head) * sum(weights[:i]) / total
        # Leave enough cuts after this one for the stages still to come.
        lo = cuts.index(chosen[-1]) + 1 if chosen else 0
        hi = len(cuts) - (n - 1 - i)
        window = cuts[lo:hi]
        chosen.append(min(window, key=lambda c: (abs(done[c] - ideal), c)))
    bounds = [0, *chosen, layer_count]
    return [StageRange(a, b) for a, b in itertools.pairwise(bounds)]
