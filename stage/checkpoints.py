"""Roll a lane's recurrent state back to a position (DESIGN.md §3 step 5, issue 43).

An attention layer's KV is trimmed back to a position; a recurrent layer's state (Mamba-2,
gated delta-net, short convolutions) has been overwritten by every row since, and cannot be.
So an engine whose range holds recurrent layers keeps, per lane, a `LaneRing`: a checkpoint
of the recurrent state before each step of several rows (a single row never needs its own: a
rollback lands past a frame's first row), and the input rows fed since the oldest one.

Rolling back to p restores the newest checkpoint at or before p; the rows from there to p
are then replayed when the lane's next step runs, in a decode of their own just before it
(batched with other lanes' replays): never a round trip, and since every stage keeps its own
input rows, each stage replays locally. Riding in the step's own decode would leave the step's
start without a checkpoint, so under repeated rejections each replay would reach back to the
same old one and grow by a frame's accepted rows every frame. "Roll back to position p" stays
one message (a frame's start, or a trim): a trim on attention layers, a restore and a
replay on recurrent ones.

The ring is bounded: `depth` checkpoints per lane. Stage 0 keeps at most its frames in
flight unanswered, so a rejection reaches back at most that many steps; a rollback past the
oldest checkpoint, other than to 0, is refused (`CannotRollBackError`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from common.errors import EngineError

# Checkpoints per lane: the most frames a session may keep in flight on a model with recurrent
# state is one fewer (mesh/serving/pipeline.py), within PRICED_FRAMES_IN_FLIGHT's default of 5.
DEPTH = 6
# A draft's: it proposes a row a step and is rolled back into its own proposals, so each step
# takes one; a rollback past them starts its lane over (mesh/speculative/draft.py).
DRAFT_DEPTH = 16


State = bytes | memoryview  # a lane's recurrent state as llama.cpp serialises it (empty: none)


class CannotRollBackError(EngineError):
    """The lane's recurrent state holds no checkpoint at or before the position asked for."""


@dataclass(frozen=True)
class Restore:
    """What the engine does to its state before the lane's next decode: load `state` (empty:
    clear the lane), then drop attention KV from `position` on."""

    position: int
    state: State


@dataclass
class LaneRing:
    """One lane's checkpoints and input rows. Positions: `held` is where the engine's state
    is; `position` (≥ held) where the lane logically is, the rows between to be replayed."""

    depth: int
    every_row: bool = False  # a draft's lane: its own proposals, a row a step, are what it rolls back
    saved: list[tuple[int, State]] = field(default_factory=list)  # (position, state), oldest first
    rows: np.ndarray | None = None  # input rows from `base` to `position`
    base: int = 0
    held: int = 0
    stale: bool = False  # a decode failed: the state is unknown until a checkpoint is loaded
    dropped: list[State] = field(default_factory=list)  # states let go, for their buffers to be reused

    @property
    def position(self) -> int:
        return self.base + (0 if self.rows is None else len(self.rows))

    @property
    def pending(self) -> int:
        """Rows to replay before the next step's own."""
        return self.position - self.held

    def reachable(self, position: int) -> bool:
        """Whether a rollback to `position` can be honoured."""
        return position == 0 or (position >= self.held and not self.stale) or \
            any(p <= position for p, _ in self.saved)

    def rollback(self, position: int) -> Restore | None:
        """Go back to `position` (no-op at or past the lane's); returns what the engine must load."""
        if position >= self.position and not self.stale:
            return None
        if position >= self.held and not self.stale:
            self._cut(position)  # only rows not replayed yet are dropped
            return None
        if position == 0:
            self.dropped += [s for _, s in self.saved]
            self.saved, self.rows, self.base, self.held, self.stale = [], None, 0, 0, False
            return Restore(0, b"")
        keep = [(p, s) for p, s in self.saved if p <= position]
        if not keep:
            oldest = self.saved[0][0] if self.saved else self.held
            raise CannotRollBackError(f"recurrent state cannot roll back to {position}: its oldest "
                                      f"checkpoint is at {oldest}")
        self.dropped += [s for p, s in self.saved if p > position]
        self.saved, self.held, self.stale = keep, keep[-1][0], False
        self._cut(position)
        return Restore(*keep[-1])

    def loaded(self, position: int) -> None:
        """The engine loaded a whole sequence's state, at `position`, with no checkpoint of it."""
        self.rollback(0)
        self.base = self.held = position

    def replay(self) -> tuple[int, np.ndarray] | None:
        """The rows pending since a restore, and where they start: decoded before the next
        step's own, so that step begins where a checkpoint can be taken."""
        if self.rows is None or not self.pending:
            return None
        return self.held, self.rows[self.held - self.base :]

    def replayed(self) -> None:
        """The pending rows are in the state."""
        self.held = self.position

    def wants_checkpoint(self, rows: int) -> bool:
        """Whether a step of `rows` at the lane's position takes a checkpoint first."""
        assert not self.stale, "a stale lane is rolled back (a checkpoint loaded) before a step"
        assert not self.pending, "pending rows are replayed before a step"
        newest = self.saved[-1][0] if self.saved else None
        # a step of one row is rolled back into only from a later frame, whose own checkpoint
        # serves; one is still taken every `depth` rows, to bound a replay
        if newest is None:
            return True
        return newest != self.held and (rows > 1 or self.every_row or self.held - newest >= self.depth)

    def save(self, state: State) -> None:
        """The state at `held`, taken before a step: the oldest is dropped past `depth`."""
        self.saved.append((self.held, state))
        if len(self.saved) > self.depth:
            self.dropped.append(self.saved.pop(0)[1])
            drop = self.saved[0][0] - self.base
            if self.rows is not None:
                self.rows = self.rows[drop:]
            self.base = self.saved[0][0]

    def done(self, rows: np.ndarray) -> None:
        """A step's decode succeeded: its rows are in the state."""
        if self.rows is None or not len(self.rows):
            self.rows, self.base = rows.copy(), self.position
        else:
            self.rows = np.concatenate([self.rows, rows])
        self.held = self.position

    def failed(self) -> None:
        """A step's decode failed part way: only a checkpoint can say what the state is."""
        self.stale = True

    def _cut(self, position: int) -> None:
        if self.rows is not None:
            self.rows = self.rows[: max(position - self.base, 0)]
