"""Admission to the lanes: at most `lanes` requests generate at once, at most `queue` more
wait for one, and any beyond that are told at once to come back later (HTTP 429).

A bounded queue is what lets a loaded server say so: without it every request beyond the
lanes waits as long as the ones before it take, and a client cannot tell a slow server from
a dead one. The wait each admitted request had, and how many wait now, are exported in
/metrics (mesh/observe/metrics.py).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from mesh.backend import MeshBusyError, RequestTimeoutError

# Queue wait histogram buckets (seconds): most waits are a fraction of one generation
WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, float("inf"))
RETRY_AFTER_S = 1  # what a refused client is told to wait: a lane frees within a generation or so


@dataclass
class Waits:
    """How long admitted requests waited for a lane: a histogram's counts, per bucket, and sum."""

    counts: list[int] = field(default_factory=lambda: [0] * len(WAIT_BUCKETS))
    total_s: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(WAIT_BUCKETS, seconds)] += 1
        self.total_s += seconds

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, requests that waited at most that long), as Prometheus buckets are."""
        running, out = 0, []
        for bound, count in zip(WAIT_BUCKETS, self.counts, strict=True):
            running += count
            out.append((bound, running))
        return out


class Admission:
    """The lanes and the queue in front of them. `queue` None waits without bound."""

    def __init__(self, lanes: int, queue: int | None) -> None:
        self.lanes, self.queue = lanes, queue
        self._free = asyncio.Semaphore(lanes)
        self.inside = 0  # admitted or waiting: what the limit counts
        self.waiting = 0  # the queue's depth
        self.waits = Waits()

    @contextlib.asynccontextmanager
    async def lane(self, deadline: float | None = None) -> AsyncIterator[None]:
        """Hold a lane for the block; MeshBusyError at once when the queue is full, and
        RequestTimeoutError when none frees before `deadline` (the event loop's clock)."""
        if self.queue is not None and self.inside >= self.lanes + self.queue:
            raise MeshBusyError(f"the server is busy: {self.lanes} lanes generating and {self.waiting} requests "
                                f"waiting (mesh serve --lanes, --max-queue); retry later", RETRY_AFTER_S)
        self.inside += 1
        try:
            await self._wait(deadline)
            try:
                yield
            finally:
                self._free.release()
        finally:
            self.inside -= 1

    async def _wait(self, deadline: float | None) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        self.waiting += 1
        try:
            async with asyncio.timeout_at(deadline):
                await self._free.acquire()
        except TimeoutError:
            raise RequestTimeoutError(f"no lane freed within {loop.time() - started:.1f}s "
                                      "(mesh serve --request-timeout)") from None
        finally:
            self.waiting -= 1
        self.waits.observe(loop.time() - started)
