"""The checkpoint ring (stage/checkpoints.py) over random steps, rollbacks, voided frames and
failed decodes (hypothesis; no model). A stand-in engine's state is the exact list of rows it
has consumed, so a restore that loads the wrong checkpoint, or a replay of the wrong rows,
shows as a state other than the committed history's."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stage.checkpoints import CannotRollBackError, LaneRing

DEPTH = 3


@dataclass
class Lane:
    """An engine lane as stage.llama_engine drives its ring; `state` is what its recurrent
    layers have consumed, `history` what the lane should hold (the truth)."""

    ring: LaneRing = field(default_factory=lambda: LaneRing(DEPTH))
    state: list[int] = field(default_factory=list)
    history: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)  # where each step began, newest last

    def rollback(self, position: int) -> None:
        restore = self.ring.rollback(position)
        if restore is not None:
            self.state = np.frombuffer(restore.state, dtype=np.int64).tolist()
            assert len(self.state) == restore.position
        self.history = self.history[:position]

    def step(self, rows: list[int]) -> None:
        start = len(self.history)
        if (pending := self.ring.replay()) is not None:  # decoded first, as the engine does
            at, replayed = pending
            assert at == len(self.state)
            self.state += replayed.tolist()
            self.ring.replayed()
        if self.ring.wants_checkpoint(len(rows)):
            self.ring.save(np.asarray(self.state, dtype=np.int64).tobytes())
        assert start == len(self.state)  # the step's rows follow the state's position
        self.state += rows
        self.ring.done(np.asarray(rows, dtype=np.int64))
        self.history += rows
        self.starts.append(start)

    def check(self) -> None:
        """The state plus the rows pending replay is exactly the history."""
        ring = self.ring
        assert ring.position == len(self.history)
        assert self.state[: ring.held] == self.history[: ring.held]
        if not ring.stale:
            assert len(self.state) == ring.held
        pending = [] if ring.rows is None else ring.rows[ring.held - ring.base :].tolist()
        assert self.history[ring.held :] == pending
        assert len(ring.saved) <= DEPTH


ops = st.lists(st.tuples(st.sampled_from(["step", "reject", "fail", "restart"]),
                         st.integers(1, 6), st.integers(0, 40)), max_size=40)


@settings(max_examples=300, deadline=None)
@given(ops, st.booleans())
def test_random_histories_never_restore_other_than_the_committed_state(script: list[tuple[str, int, int]],
                                                                       every_row: bool) -> None:
    lane = Lane(LaneRing(DEPTH, every_row))  # a stage's ring, or a draft's
    token = iter(range(1000, 100_000))
    for op, rows, back in script:
        if op == "step":
            lane.rollback(len(lane.history))  # a stale lane is reloaded before its next decode
            lane.step([next(token) for _ in range(rows)])
        elif op == "reject":  # a verify rejected at some row: back to a position within reach
            target = max(len(lane.history) - back, 0)
            recent = lane.starts[-DEPTH:]
            if recent and target >= recent[0]:
                assert lane.ring.reachable(target)  # within the frames the ring is sized for
            if lane.ring.reachable(target):
                lane.rollback(target)
            else:
                with pytest.raises(CannotRollBackError):
                    lane.ring.rollback(target)
                continue
        elif op == "fail":  # a decode died part way: the state holds rows nobody committed
            lane.state += [-1] * rows
            lane.ring.failed()
        else:
            lane.rollback(0)
        lane.check()


def test_a_rollback_replays_the_accepted_rows_and_the_next_frame_gets_its_own_checkpoint() -> None:
    lane = Lane()
    lane.step([1, 2, 3])  # a prefill
    lane.step([4, 5, 6, 7])  # a verify frame of 4 rows: its row 1 is rejected
    lane.rollback(5)
    assert lane.ring.held == 3
    assert lane.ring.pending == 2
    at, rows = lane.ring.replay() or (None, None)
    assert (at, rows.tolist() if rows is not None else None) == (3, [4, 5])
    for first in (9, 10, 11):  # rejected at row 1 every time: each replay stays one row long
        lane.step([first, 8, 8, 8])
        lane.rollback(len(lane.history) - 3)  # the row fed first stands, its drafts do not
        assert lane.ring.pending == 1
    assert [p for p, _ in lane.ring.saved] == [5, 6, 7]  # each frame's own, the newest DEPTH


def test_a_rollback_past_the_oldest_checkpoint_is_refused_with_where_it_is() -> None:
    lane = Lane()
    for i in range(DEPTH + 2):
        lane.step([i, i])
    with pytest.raises(CannotRollBackError, match="oldest checkpoint is at 4"):
        lane.ring.rollback(3)
    lane.rollback(0)  # back to nothing is always possible
    assert lane.ring.position == 0
    assert lane.ring.saved == []
