"""What route recoveries the coordinator has been through: counts and times, for /health and /metrics.

A recovery starts when the route is found broken (a link closed, a liveness ping went
unanswered, a reply missed its deadline) and ends when a new route serves. `detect_s` is
how long the break went unnoticed: from the last sign of life (a ping answered or a reply
received) to the break. `resume_s` is from the break to the new route. The last few
recoveries stay in an append-only ring, the web page's timeline (mesh/reports/snapshot.py).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from mesh.reports.health import RecoveryHealth
from mesh.reports.snapshot import Recovery

TIMELINE = 32  # recoveries the timeline keeps, the latest last


@dataclass
class Recoveries:
    count: int = 0
    sessions: int = 0  # in-flight generations resumed on a new route
    detect_s: float = 0.0  # sums, for /metrics
    resume_s: float = 0.0
    last: RecoveryHealth | None = None
    alive_at: float = 0.0  # monotonic: the last sign that every stage was alive
    broken_at: float | None = None  # monotonic: the break being recovered from, if any
    cause: str = ""
    timeline: deque[Recovery] = field(default_factory=lambda: deque(maxlen=TIMELINE))

    def alive(self) -> None:
        self.alive_at = time.monotonic()

    def broke(self, cause: str) -> None:
        """The route is broken; only the first call of a recovery counts."""
        if self.broken_at is None:
            self.broken_at, self.cause = time.monotonic(), cause

    def healed(self, replaced: Sequence[tuple[str, str]] = ()) -> None:
        """A new route serves; `replaced` pairs each endpoint gone with the one in its place."""
        if self.broken_at is None:
            return
        now = time.monotonic()
        detect = max(self.broken_at - self.alive_at, 0.0) if self.alive_at else 0.0
        resume = now - self.broken_at
        self.count += 1
        self.detect_s += detect
        self.resume_s += resume
        self.last = RecoveryHealth(cause=self.cause, detect_s=round(detect, 3), resume_s=round(resume, 3),
                                   at=time.time())
        self.timeline.append(Recovery(cause=self.cause, at=self.last.at, detect_s=self.last.detect_s,
                                      resume_s=self.last.resume_s, replaced=tuple(replaced)))
        self.broken_at, self.alive_at = None, now

