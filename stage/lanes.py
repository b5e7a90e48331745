"""Map session ids from the wire onto the engine's KV lanes.

A stage shared by several coordinators grants each claim some of its engine's lanes
(stage/leases.py): the lanes a frame names on the wire are the claim's own, 0 up to its
grant, and the pool maps them onto the engine lanes granted. So a frame can never name
another claim's lane.
"""

from __future__ import annotations

from collections.abc import Sequence

from common.ids import LaneId, SessionId
from config.errors import MeshpipeError


class LanesExhaustedError(MeshpipeError):
    pass


class LanePool:
    def __init__(self, lanes: int | Sequence[LaneId]) -> None:
        """`lanes`: how many (the engine's 0..lanes-1), or the engine lanes granted, in wire order."""
        self.granted = [LaneId(lane) for lane in range(lanes)] if isinstance(lanes, int) else list(lanes)
        self.lanes = len(self.granted)
        self.free = list(reversed(self.granted))
        self.by_session: dict[SessionId, LaneId] = {}

    def lane_for(self, session: SessionId, prefer: LaneId | None = None) -> LaneId:
        """The session's lane, taking a free one on first sight: `prefer` if it is free."""
        lane = self.by_session.get(session)
        if lane is None:
            if not self.free:
                raise LanesExhaustedError(f"no free KV lane for session {session}")
            lane = prefer if prefer is not None and prefer in self.free else self.free[-1]
            self._take(session, lane)
        return lane

    def take(self, session: SessionId, lane: LaneId) -> LaneId:
        """The session's lane, which must be `lane`: stage 0 chose it, and a free lane may hold
        a prefix cached for it (DESIGN.md §2), so any other lane would compute on wrong KV."""
        if not 0 <= lane < self.lanes:
            raise ValueError(f"lane {lane} out of range (this claim holds {self.lanes} lanes of this stage)")
        engine_lane = self.granted[lane]
        held = self.by_session.get(session)
        if held is not None:
            if held != engine_lane:
                raise ValueError(f"session {session} holds lane {self.granted.index(held)}, not {lane}")
            return held
        if engine_lane not in self.free:
            raise LanesExhaustedError(f"lane {lane} is taken by another session")
        self._take(session, engine_lane)
        return engine_lane

    def _take(self, session: SessionId, lane: LaneId) -> None:
        self.free.remove(lane)
        self.by_session[session] = lane

    def release(self, session: SessionId) -> LaneId | None:
        lane = self.by_session.pop(session, None)
        if lane is not None:
            self.free.append(lane)
        return lane

    def __len__(self) -> int:
        return len(self.by_session)
