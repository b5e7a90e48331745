"""Every lane's recurrent state in one llama.cpp context: saved, loaded, and rolled back through
each lane's `LaneRing` (stage/checkpoints.py says how; DESIGN.md §3, "Recurrent state").

Only llama.cpp's public state API: `llama_state_seq_get_data_ext` / `_set_data_ext` with
`LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY`, which on a hybrid's memory reads and writes the
recurrent part alone, and `llama_memory_seq_rm` for the attention KV past a loaded state.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np
from llama_cpp import llama_cpp as L

from common.errors import EngineError
from stage.checkpoints import LaneRing, Restore
from stage.engine import Step

_PARTIAL = L.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY  # the recurrent part of a hybrid's memory


class RecurrentLanes:
    def __init__(self, ctx: Any, mem: Any, lanes: int, depth: int, every_row: bool = False) -> None:
        self.ctx, self.mem = ctx, mem
        self.rings = [LaneRing(depth, every_row) for _ in range(lanes)]
        # Buffers of dropped checkpoints, written again: a fresh 20 MB buffer is mapped in page
        # by page as it is written, which made a save 12 ms where a reused one takes 2-3.
        self.spare: list[memoryview] = []

    def position(self, lane: int) -> int:
        return self.rings[lane].position

    def reachable(self, lane: int, position: int) -> bool:
        return self.rings[lane].reachable(position)

    def rollback(self, lane: int, position: int) -> int:
        """Back to `position`, a checkpoint loaded where one must be; the lane's position after."""
        restore = self.rings[lane].rollback(position)
        if restore is not None:
            self.restore(lane, restore)
        return self.rings[lane].position

    def loaded(self, lane: int, position: int) -> None:
        """A whole saved sequence was loaded into the lane: its state stands at `position`."""
        self.rings[lane].loaded(position)

    def replays(self, steps: Sequence[Step], first: bool) -> list[Step]:
        """The rows a restore left pending on the steps' lanes, as steps to decode before them."""
        out = []
        for s in steps:
            if (pending := self.rings[s.lane].replay()) is not None:
                start, rows = pending
                out.append(Step(s.lane, start, tokens=rows) if first else Step(s.lane, start, hidden=rows))
        return out

    def replayed(self, replays: Sequence[Step]) -> None:
        for r in replays:
            self.rings[r.lane].replayed()

    def checkpoint(self, steps: Sequence[Step]) -> None:
        """Save each lane's state before a step that may be rolled back into."""
        for s in steps:
            if self.rings[s.lane].wants_checkpoint(s.n):
                self.rings[s.lane].save(self.save(s.lane))

    def settle(self, steps: Sequence[Step], ok: bool) -> None:
        """How each step's decode ended: its rows are in the state, or the state is unknown."""
        for s in steps:
            if 0 <= s.lane < len(self.rings):
                if ok:
                    data = s.tokens if s.tokens is not None else s.hidden
                    assert data is not None
                    self.rings[s.lane].done(np.asarray(data))
                else:
                    self.rings[s.lane].failed()

    def save(self, lane: int) -> memoryview:
        """The lane's recurrent state alone: on a hybrid the attention KV is trimmed, not saved."""
        self._reclaim()
        size = L.llama_state_seq_get_size_ext(self.ctx, lane, _PARTIAL)
        view = next((v for v in self.spare if len(v) == size), None)
        if view is None:
            view = memoryview((ctypes.c_uint8 * size)()).cast("B")
        else:
            self.spare.remove(view)
        buf = (ctypes.c_uint8 * size).from_buffer(view)  # the same memory: a state is never copied twice
        if L.llama_state_seq_get_data_ext(self.ctx, buf, size, lane, _PARTIAL) != size:
            raise EngineError(f"lane {lane}: llama.cpp could not save its recurrent state")
        return view

    def _reclaim(self) -> None:
        """Take the buffers the rings let go, keeping a lane's worth at most."""
        for ring in self.rings:
            self.spare += [s for s in ring.dropped if isinstance(s, memoryview) and not s.readonly]
            ring.dropped.clear()
        del self.spare[self.rings[0].depth if self.rings else 0 :]

    def restore(self, lane: int, restore: Restore) -> None:
        if not restore.state:
            L.llama_memory_seq_rm(self.mem, lane, -1, -1)
            return
        size = len(restore.state)
        buf = (ctypes.c_uint8 * size).from_buffer(restore.state)
        if L.llama_state_seq_set_data_ext(self.ctx, buf, size, lane, _PARTIAL) == 0:
            raise EngineError(f"lane {lane}: llama.cpp could not restore its recurrent state")
        # the recurrent part now ends before `position`, so only attention KV is dropped
        L.llama_memory_seq_rm(self.mem, lane, restore.position, -1)
