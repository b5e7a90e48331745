"""Stage 0's own work: what the coordinator's process spends besides its engines, per decode
frame (the HTTP API, the generate loops, the pipeline's frames). It shares stage 0's cores
and shows in no hop timing, so the planner counts it as stage 0's fixed cost per decode on
the routes it builds after serving a while (DESIGN.md §3, cutting on measured time).
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkMark:
    """The process's CPU seconds, its engines' busy seconds and the decode frames sent, at one moment."""

    cpu_s: float
    engine_s: float
    frames: int


def work_mark(engine_s: float, frames: int) -> WorkMark:
    return WorkMark(time.process_time(), engine_s, frames)


def other_per_frame(before: WorkMark, after: WorkMark) -> float | None:
    """CPU seconds per decode frame spent outside the engines between the two marks; None
    without frames. Engine seconds are wall time, so a decode waiting on a CPU lock counts
    more than it ran: the difference then is an underestimate, never below 0."""
    frames = after.frames - before.frames
    if frames <= 0:
        return None
    other = (after.cpu_s - before.cpu_s) - (after.engine_s - before.engine_s)
    return max(other, 0.0) / frames
