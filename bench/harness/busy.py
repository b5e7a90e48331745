"""Stage busy fractions over a workload: engine seconds each stage spent, per second of wall time.

Every stage counts the engine time of its decodes (`busy_s` in /health, from each stage's
Status reply; stage 0 counts its layers, and the draft on the same engine thread apart). A
fraction near 1 is the stage that sets the pace; well below 1 everywhere means the stages
wait on each other or on the wire.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import httpx

from bench.harness.harness import Row
from mesh.cli.bearer import auth_headers
from mesh.reports.health import Health
from mesh.routing.keeper import STATUS_TTL

T = TypeVar("T")


@dataclass(frozen=True)
class Busy:
    stages: tuple[float, ...]  # stage 0 first
    draft: float | None  # the draft's share of stage 0's engine thread, when there is one

    def describe(self) -> str:
        parts = [f"stage {i} {f:.2f}" for i, f in enumerate(self.stages)]
        return ", ".join(parts + ([f"draft {self.draft:.2f}"] if self.draft is not None else []))


def busy_during(url: str, run: Callable[[], T]) -> tuple[T, Busy]:
    """`run()`'s result, and how busy each stage was while it ran."""
    before = _fresh(url)
    start = time.perf_counter()
    result = run()
    wall = time.perf_counter() - start
    after = _fresh(url)  # idle meanwhile: the wait adds wall time here, never busy time
    stages = tuple(_grew(b.busy_s, a.busy_s) / wall for b, a in zip(before.stages, after.stages, strict=True))
    draft = None if after.draft_busy_s is None else _grew(before.draft_busy_s, after.draft_busy_s) / wall
    return result, Busy(stages, draft)


def _fresh(url: str) -> Health:
    time.sleep(STATUS_TTL)  # the coordinator asks its stages at most this often
    return Health.model_validate_json(httpx.get(f"{url}/health", timeout=10,
                                                          headers=auth_headers()).content)


def _grew(before: float | None, after: float | None) -> float:
    return max((after or 0.0) - (before or 0.0), 0.0)


def busy_rows(scenario: str, what: str, busy: Busy) -> list[Row]:
    rows = [Row(scenario, f"busy fraction stage {i}, {what}", f) for i, f in enumerate(busy.stages)]
    return rows + ([Row(scenario, f"busy fraction of the draft, {what}", busy.draft)] if busy.draft is not None
                   else [])
