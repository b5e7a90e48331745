"""The mesh as it stands, once a second: what the web page and `mesh status --watch` show.

One frozen model on both sides of the wire, as /health is (mesh/reports/health.py): the sampler
(mesh/observe/sampler.py) builds it from state the coordinator already holds, /ui/events pushes it,
and the terminal reads it back with the same model. Rates are over the last interval.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from mesh.reports.health import ClaimHealth, TierHealth

# READY, BROKEN and UNREACHABLE as in /health; REBUILDING: the route is being rebuilt and
# the stage is shown as the last route had it
StageView = Literal["READY", "BROKEN", "UNREACHABLE", "REBUILDING"]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")


class Stage(_Frozen):
    """One stage of the route, in pipeline order; stage 0 is the coordinator."""

    stage: int
    endpoint: str
    engine: str | None
    start: int | None  # the layer range [start, end)
    end: int | None
    state: StageView
    rss_bytes: int | None
    mem_available_bytes: int | None
    busy: float | None  # the fraction of the last interval its engine computed
    frame_ms: float | None  # its time per frame over the last interval: queue, compute, codec, sample
    replaced: str | None = None  # the endpoint it took over from in the last recovery
    parameters: int | None = None  # of its layers, as /health: all, and those a decode multiplies
    active_parameters: int | None = None
    claims: tuple[ClaimHealth, ...] = ()  # as /health: every coordinator's on the stage
    kv_tier: TierHealth | None = None  # as /health


class Link(_Frozen):
    """The activation link from stage `to - 1` into stage `to`."""

    to: int
    bytes_per_s: float | None  # measured on stage 0's link: every activation link carries the same rows
    round_trip_ms: float | None = None  # the last Status call to the stage it leads to (the watcher's ping)


class Proposer(_Frozen):
    name: str  # "draft" or "ngram"
    accept_rate: float  # accepted / proposed, since start
    mean_window: float  # proposed / windows, since start
    proposed: int
    choice: str | None = None  # what its cost-aware window controller chose and why, now


class Speculation(_Frozen):
    plan: str  # the draft and window policy, or why speculation is off
    tok_s: float  # tokens handed to clients over the last interval
    ttft_s: float | None  # mean time to first token of the requests that began in the last minute
    frames_in_flight: int  # frames sent and not yet answered, now
    stale: float  # rows of frames voided (work thrown away) / rows sent, since start
    round_trip_ms: float | None  # a frame's way through the stages and back, over the last interval
    wire_ms: float | None  # the part of it on sockets and event loops, every link together
    proposers: tuple[Proposer, ...]


class Requests(_Frozen):
    generating: int
    queued: int
    lanes: int
    lanes_used: int
    prefix_hit: float  # prompt tokens found in the KV / prompt tokens, since start


class Recovery(_Frozen):
    """One recovery of the route: what broke it, how long the break went unnoticed, how long
    until a new route served, and the stages that took another's place."""

    cause: str
    at: float  # wall time the new route served
    detect_s: float
    resume_s: float
    replaced: tuple[tuple[str, str], ...] = ()  # (the endpoint gone, the one in its place)


class Healing(_Frozen):
    ok: bool
    broken: str | None  # the break being recovered from, if any
    broken_for_s: float | None
    recoveries: int
    sessions_resumed: int
    timeline: tuple[Recovery, ...]  # the latest last, at most a few dozen


class Point(_Frozen):
    """One second of the chart."""

    t: float
    tok_s: float
    accept: float | None  # acceptance over the interval's finished windows, all proposers
    in_flight: int


class Snapshot(_Frozen):
    at: float  # wall time
    model: str
    layers: int  # the model's, for the layer bars
    stages: tuple[Stage, ...]
    links: tuple[Link, ...]
    spares: tuple[str, ...]
    speculation: Speculation
    requests: Requests
    healing: Healing
    history: tuple[Point, ...]  # the last few minutes, oldest first
