"""How long stage 0 waits for a frame's reply before it calls the route broken.

A fixed 60 s made a frozen stage a minute of silence. The deadline follows what replies
have taken: a frame of r rows is expected to take `frame_s + row_s * r` (fitted from the
replies so far, small frames teaching the first term and prefill chunks the second), and
is given `factor` times that, never less than `floor_s`. Until the first reply, while the
engines warm up, it is `first_s`. Frozen stages are caught sooner by the coordinator's
liveness pings; this catches a data plane that stalls while the control plane answers.
"""

from __future__ import annotations

from dataclasses import dataclass

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
