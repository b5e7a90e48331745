"""Ids that must not be mixed up: each is an int on the wire and a distinct type here."""

from typing import NewType

SessionId = NewType("SessionId", int)  # one request's life at stage 0, named in every frame
LaneId = NewType("LaneId", int)  # a KV lane, the same index on every stage
FrameId = NewType("FrameId", int)  # one frame in flight, unique per session
