"""What route recoveries the coordinator has been through: counts and times, for /health and /metrics.

A recovery starts when the route is found broken (a link closed, a liveness ping went
unanswered, a reply missed its deadline) and ends when a new route serves. `detect_s` is
how long the break went unnoticed: from the last sign of life (a ping answered or a reply
received) to the break. `resume_s` is from the break to the new route.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from mesh.health import RecoveryHealth


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

    def alive(self) -> None:
        self.alive_at = time.monotonic()

    def broke(self, cause: str) -> None:
        """The route is broken; only the first call of a recovery counts."""
        if self.broken_at is None:
            self.broken_at, self.cause = time.monotonic(), cause

    def healed(self) -> None:
        """A new route serves."""
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
        self.broken_at, self.alive_at = None, now

