"""A gated delta-net layer's lane state, and its rollback by checkpoint (DESIGN.md §3 step 5).

A recurrent layer's state (the short convolution's last inputs and the delta rule's matrix
per head) is overwritten by every row, so it cannot be trimmed as KV is. As the llama.cpp
engine does (stage/checkpoints.py), a lane keeps checkpoints and the rows fed since the
oldest: here a checkpoint at the start of each of its last `DEPTH` steps, and each row's
inputs to the recurrence (the convolution's input, the decay and beta), not the hidden
states: a rollback to p restores the newest checkpoint at or before p, and the layer's next
call replays the rows from there to p ahead of its own (`pending`), without a matmul. The
replay runs the same per-row arithmetic as the first pass, so a rolled-back lane equals a
fresh one bit for bit. A rollback past the oldest checkpoint, other than to 0, is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from stage.checkpoints import DEPTH, CannotRollBackError


@dataclass(frozen=True)
class Rows:
    """One step's inputs to the recurrence, from position `start`: conv [n, channels],
    decay and beta [n, heads]."""

    start: int
    conv: mx.array
    decay: mx.array
    beta: mx.array

    def upto(self, position: int) -> Rows:
        n = position - self.start
        return Rows(self.start, self.conv[:n], self.decay[:n], self.beta[:n])


@dataclass(frozen=True)
class Checkpoint:
    position: int
    conv: mx.array | None  # the convolution's last kernel-1 inputs [kernel-1, channels]
    ssm: mx.array | None  # the delta rule's state [heads, value dim, key dim]


class RecurrentCache:
    """One lane's state for one gated delta-net layer. `offset` is where the lane is;
    the state held is at `checkpoint.position`, the rows between to be replayed (`pending`)."""

    def __init__(self) -> None:
        self.offset = 0
        self.held = Checkpoint(0, None, None)
        self.checkpoints: list[Checkpoint] = []
        self.rows: list[Rows] = []

    def _reset(self) -> None:
        self.offset, self.held, self.checkpoints, self.rows = 0, Checkpoint(0, None, None), [], []

    def pending(self) -> list[Rows]:
        """The rows from the state held to `offset`, which the next call replays first."""
        return [r for r in self.rows if r.start >= self.held.position]

    def commit(self, start: Checkpoint, rows: Rows, end: Checkpoint) -> None:
        """A step ran `rows` from `start` (the state at the step's first row) to `end`."""
        # a step after a rollback starts at the restored checkpoint's position or past it
        self.checkpoints = [*(c for c in self.checkpoints if c.position < start.position), start][-DEPTH:]
        oldest = self.checkpoints[0].position
        self.rows = [r for r in self.rows if r.start >= oldest and r.start < start.position] + [rows]
        self.held, self.offset = end, end.position

    def trim(self, position: int) -> None:
        """Drop the positions from `position` on: restore the newest checkpoint at or before it."""
        if position >= self.offset:
            return
        if position <= 0:
            self._reset()
            return
        kept = [c for c in self.checkpoints if c.position <= position]
        if not kept:
            raise CannotRollBackError(f"no recurrent checkpoint at or before position {position} "
                                      f"(the oldest is at {self.checkpoints[0].position})")
        self.checkpoints, self.held, self.offset = kept, kept[-1], position
        self.rows = [r.upto(position) if r.start + len(r.conv) > position else r
                     for r in self.rows if r.start < position]

    @property
    def state(self) -> list[mx.array]:
        arrays = [a for c in (*self.checkpoints, self.held) for a in (c.conv, c.ssm) if a is not None]
        return arrays + [a for r in self.rows for a in (r.conv, r.decay, r.beta)]
