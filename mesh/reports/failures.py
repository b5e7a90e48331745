"""Generations that failed inside the mesh: counted by cause, and whether /health should say so.

An internal error is a bug or a broken state, never the client's doing: a refusal, a busy
queue, a timeout, a route being rebuilt or a client that hangs up are not one. Each is
logged with its traceback where it happens (mesh/serving/requests.py, or the HTTP layer for
its own); here it is counted, and the last one kept, for /health and /metrics alike.

/health is a load balancer's signal, so it turns on the recent run of outcomes, not the
count since start: FAILING_STREAK generations in a row that ended in an internal error,
the last within FAILING_FOR_S, make the server unhealthy (503). One good generation clears
it; so does FAILING_FOR_S without traffic, which lets a balancer that took the server out
send it a request again, as a circuit breaker's half-open state does.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from config.errors import MeshpipeError

FAILING_STREAK = 3
FAILING_FOR_S = 60.0


class InternalError(MeshpipeError):
    """A generation failed inside the mesh; the message names the request id the log carries."""

    def __init__(self, message: str, cause: str) -> None:
        super().__init__(message)
        self.cause = cause  # the exception's class name: /metrics counts by it


@dataclass(frozen=True)
class LastFailure:
    request_id: str
    cause: str
    message: str
    at: float  # monotonic


@dataclass
class Failures:
    by_cause: Counter[str] = field(default_factory=Counter)
    streak: int = 0  # generations in a row, the latest last, that ended in an internal error
    last: LastFailure | None = None

    @property
    def count(self) -> int:
        return sum(self.by_cause.values())

    @property
    def last_line(self) -> str | None:
        """The latest internal error, for /health: its request id, cause and message."""
        last = self.last
        return None if last is None else f"request {last.request_id}: {last.cause}: {last.message}"

    def failed(self, request_id: str, exc: BaseException) -> None:
        cause = type(exc).__name__
        self.by_cause[cause] += 1
        self.streak += 1
        self.last = LastFailure(request_id, cause, str(exc), time.monotonic())

    def succeeded(self) -> None:
        self.streak = 0

    def failing(self) -> str | None:
        """Why the server is unhealthy now, or None: a run of internal errors, recent."""
        last = self.last
        if last is None or self.streak < FAILING_STREAK or time.monotonic() - last.at > FAILING_FOR_S:
            return None
        ago = time.monotonic() - last.at
        return (f"the last {self.streak} generations failed with internal errors; the latest, {ago:.0f}s ago "
                f"(request {last.request_id}): {last.cause}: {last.message}")
