"""How long stage 0 waits for a frame's reply before it calls the route broken.

A fixed 60 s made a frozen stage a minute of silence. The deadline follows what replies
have taken: a frame of r rows is expected to take `frame_s + row_s * r` (fitted from the
replies so far, small frames teaching the first term and prefill chunks the second), and
is given `factor` times that, never less than `floor_s`. Until the first reply, while the
engines warm up, it is `first_s`. Frozen stages are caught sooner by the coordinator's
liveness pings; this catches a data plane that stalls while the control plane answers.

`ReplyWatch` waits for one reply by that deadline, and past it by progress: slow is not
dead. A deadline passed fails only if nothing moved while the frame waited, no reply came
and no stage's engine time grew (the healer's pings tell `progressed`); while something
moves, the frame waits one more deadline at a time.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TypeVar

from mesh.reports.hop_timing import HopTotals

T = TypeVar("T")


class StalledError(Exception):
    """A reply missed its deadline and nothing on the route moved meanwhile."""

SMALL_FRAME_ROWS = 16  # up to this many rows, a frame's time is mostly per frame, not per row


@dataclass
class ReplyDeadline:
    floor_s: float = 5.0
    first_s: float = 60.0
    factor: float = 10.0
    weight: float = 0.2  # of the newest reply in the running means
    frame_s: float | None = None
    row_s: float = 0.0

    def observe(self, rows: int, seconds: float) -> None:
        """A reply to a frame of `rows` rows came `seconds` after the frame left."""
        if rows <= SMALL_FRAME_ROWS or self.frame_s is None:
            self.frame_s = self._mean(self.frame_s, seconds)
        else:
            self.row_s = self._mean(self.row_s, max(seconds - self.frame_s, 0.0) / rows)

    def for_rows(self, rows: int) -> float:
        if self.frame_s is None:
            return self.first_s
        return max(self.floor_s, self.factor * (self.frame_s + self.row_s * rows))

    def _mean(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.weight) * old + self.weight * new


@dataclass
class ReplyWatch:
    """One pipeline's reply waits: the deadline learned from its replies, and the last sign
    that the later stages work (a reply, or a stage's engine time grown at a ping)."""

    totals: HopTotals  # counts the late replies, across routes
    deadline: ReplyDeadline = field(default_factory=ReplyDeadline)
    progress_at: float = field(default_factory=time.perf_counter)

    def progressed(self) -> None:
        self.progress_at = time.perf_counter()

    def observe(self, rows: int, seconds: float) -> None:
        """A reply to a frame of `rows` rows came `seconds` after the frame left."""
        self.deadline.observe(rows, seconds)
        self.progressed()

    async def reply(self, future: asyncio.Future[T], rows: int, left_at: float) -> T:
        """`future`'s result, for a frame of `rows` rows (those queued ahead of it included)
        that left at `left_at`; StalledError past a deadline in which nothing moved."""
        since, waited = left_at, 0.0
        while True:
            deadline = self.deadline.for_rows(rows)
            try:
                # not asyncio.wait_for: on Python 3.11 it returns the reply, and swallows the
                # task's cancellation, when the two come in the same loop turn, so a request whose
                # client had gone ran on to its last token (a 200 nobody read, its lane held).
                # Shielded: a deadline passed cancels the wait, not the reply still to come.
                async with asyncio.timeout(max(deadline - (time.perf_counter() - since), 0.0)):
                    return await asyncio.shield(future)
            except asyncio.CancelledError:
                future.cancel()  # the caller is gone: as unshielded, the reply is not awaited
                raise
            except TimeoutError:
                waited += deadline
                if self.progress_at <= since:
                    raise StalledError(f"no reply from the pipeline within {waited:.1f}s and no progress on any "
                                       f"stage (the deadline for a frame and what was queued ahead of it, {rows} "
                                       "rows, from the replies so far)") from None
                if since == left_at:
                    self.totals.late_replies += 1
                since = time.perf_counter()
