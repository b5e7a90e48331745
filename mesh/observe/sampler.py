"""The snapshot (mesh/reports/snapshot.py), built once a second and handed to every watcher at once.

One task reads the coordinator's state (mesh/observe/readings.py: nothing is asked of any stage;
the healer's pings keep their Status fresh), builds the snapshot and serializes it once;
every open event stream (/ui/events) is woken with those same bytes. A watcher costs the
server a wake-up and a socket write a second, however many there are; the sampler runs with
none, so the chart has its history when a page opens.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncGenerator

from mesh.coordinator import Coordinator
from mesh.observe.metrics import Metrics
from mesh.observe.readings import Readings, per_s, read
from mesh.reports.health import StageHealth
from mesh.reports.snapshot import Healing, Link, Point, Proposer, Requests, Snapshot, Speculation, Stage
from mesh.routing.route_rows import stage_rows

log = logging.getLogger("meshpipe.sampler")

TICK_S = 1.0
HISTORY = 180  # the chart's points: three minutes
TTFT_WINDOW = 60  # readings: the time to first token is the mean over about this many seconds


class Sampler:
    def __init__(self, mesh: Coordinator, metrics: Metrics) -> None:
        self.mesh, self.metrics = mesh, metrics
        self.readings: deque[Readings] = deque(maxlen=TTFT_WINDOW + 1)
        self.history: deque[Point] = deque(maxlen=HISTORY)
        self.last_stages: tuple[Stage, ...] = ()  # the route's, shown while it is rebuilt
        # endpoint -> its last (busy seconds, reply time) and the one before, for the busy fraction
        self.busy_seen: dict[str, tuple[tuple[float, float], tuple[float, float] | None]] = {}
        self.snapshot: Snapshot | None = None
        self.event = b""  # the snapshot as one server-sent event
        self._tick = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.watchers = 0
        self.closed = False

    def start(self) -> None:
        self.sample()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="ui sampler")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def close(self) -> None:
        """End every event stream: the server is stopping, and an endless response would
        hold its graceful shutdown for the whole grace period."""
        self.closed = True
        self._tick.set()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            try:
                self.sample()
            except Exception:  # a bug here must not end the page's updates for good
                log.exception("snapshot failed")

    def sample(self) -> Snapshot:
        """Build the snapshot now, and wake every watcher with it."""
        snap = self.build()
        self.snapshot, self.event = snap, b"data: " + snap.model_dump_json().encode() + b"\n\n"
        woken, self._tick = self._tick, asyncio.Event()
        woken.set()
        return snap

    async def events(self) -> AsyncGenerator[bytes, None]:
        """The latest snapshot at once, then each new one; ends only when its reader goes."""
        self.watchers += 1
        try:
            yield self.event
            while not self.closed:
                tick = self._tick
                await tick.wait()
                if not self.closed:
                    yield self.event
        finally:
            self.watchers -= 1

    def build(self) -> Snapshot:
        m = self.mesh
        r = m.routes
        rows = stage_rows(r.route, r.pipeline, m.settings.engine(0))
        now = read(r.hops, self.metrics, m.requests.generated)
        before = self.readings[-1] if self.readings else None
        oldest = self.readings[0] if self.readings else None
        self.readings.append(now)
        spec = self._speculation(now, before, oldest)
        self.history.append(Point(t=time.time(), tok_s=spec.tok_s, in_flight=spec.frames_in_flight,
                                  accept=_accept(now, before)))
        stages = self._stages(rows, now, before)
        layers = r.model.manifest.layer_count
        return Snapshot(at=time.time(), model=m.model_id, layers=layers, stages=stages,
                        links=tuple(Link(to=s.stage, bytes_per_s=_link_rate(now, before) if rows else None,
                                         round_trip_ms=_ping_ms(rows, s.stage)) for s in stages[1:]),
                        spares=r.topology.spares, speculation=spec, requests=self._requests(now),
                        healing=self._healing(), history=tuple(self.history))

    def _stages(self, rows: tuple[StageHealth, ...], now: Readings, before: Readings | None) -> tuple[Stage, ...]:
        if not rows:  # no route while it is rebuilt: the last route's stages, marked so
            return tuple(s.model_copy(update={"state": "REBUILDING" if s.state != "UNREACHABLE" else s.state,
                                              "busy": None, "frame_ms": None}) for s in self.last_stages)
        replaced = dict(self.mesh.recoveries.timeline[-1].replaced) if self.mesh.recoveries.timeline else {}
        took_over = {new: old for old, new in replaced.items() if new}
        self.last_stages = tuple(_stage(r, now, before, self._busy(r), took_over.get(r.endpoint)) for r in rows)
        for gone in self.busy_seen.keys() - {r.endpoint for r in rows}:
            del self.busy_seen[gone]
        return self.last_stages

    def _busy(self, row: StageHealth) -> float | None:
        """The stage's busy fraction between its last two Status replies (stage 0: two ticks)."""
        if row.busy_s is None:
            return None
        now, was = (row.busy_s, row.status_at), self.busy_seen.get(row.endpoint)
        if was is None or now[1] > was[0][1]:  # a new reply: the one before it is the base
            self.busy_seen[row.endpoint] = (now, was[0] if was else None)
            return busy_fraction(now, was[0] if was else None)
        return busy_fraction(was[0], was[1])

    def _speculation(self, now: Readings, before: Readings | None, oldest: Readings | None) -> Speculation:
        m, p = self.mesh, self.mesh.routes.pipeline
        chose = {name: choice.why for name, choice in m.requests.choices()}
        proposers = tuple(Proposer(name=name, accept_rate=t.accepted / t.proposed, proposed=int(t.proposed),
                                   mean_window=t.proposed / t.windows if t.windows else 0.0, choice=chose.get(name))
                          for name, t in now.proposers if t.proposed)
        frames = now.frames - before.frames if before else 0
        stage_s = sum(s for _, s in now.stage_s) - (sum(s for _, s in before.stage_s) if before else 0.0)
        wire = now.wire_s - before.wire_s if before else 0.0
        ttft = oldest is not None and now.ttft_count > oldest.ttft_count
        return Speculation(
            plan=m.speculation.describe(), tok_s=round(per_s(now, before, "generated"), 2),
            ttft_s=(now.ttft_sum - oldest.ttft_sum) / (now.ttft_count - oldest.ttft_count)
            if ttft and oldest else None,
            frames_in_flight=len(p.waiters) if p is not None else 0,
            stale=now.rows_voided / now.rows_sent if now.rows_sent else 0.0,
            round_trip_ms=(stage_s + wire) * 1e3 / frames if frames else None,
            wire_ms=wire * 1e3 / frames if frames else None, proposers=proposers)

    def _requests(self, now: Readings) -> Requests:
        admission, pipeline = self.mesh.requests.admission, self.mesh.routes.pipeline
        lanes = pipeline.core.lanes if pipeline is not None else None
        return Requests(generating=admission.inside - admission.waiting, queued=admission.waiting,
                        lanes=admission.lanes, lanes_used=len(lanes.by_session) if lanes is not None else 0,
                        prefix_hit=now.prompt_cached / now.prompt_tokens if now.prompt_tokens else 0.0)

    def _healing(self) -> Healing:
        r, p = self.mesh.recoveries, self.mesh.routes.pipeline
        broken = (p.broken if p is not None else None) or (self.mesh.healer.last_error or None)
        if p is None and broken is None:
            broken = "route is being rebuilt"
        since = r.broken_at
        return Healing(ok=broken is None, broken=broken,
                       broken_for_s=round(time.monotonic() - since, 1) if since is not None else None,
                       recoveries=r.count, sessions_resumed=r.sessions, timeline=tuple(r.timeline))


def _stage(row: StageHealth, now: Readings, before: Readings | None, busy: float | None,
           replaced: str | None) -> Stage:
    spent = dict(now.stage_s).get(str(row.stage))
    spent_before = dict(before.stage_s).get(str(row.stage), 0.0) if before else 0.0
    frames = now.frames - before.frames if before else 0
    return Stage(stage=row.stage, endpoint=row.endpoint, engine=row.engine, start=row.start, end=row.end,
                 state=row.state, rss_bytes=row.rss_bytes, mem_available_bytes=row.mem_available_bytes,
                 busy=busy, frame_ms=(spent - spent_before) * 1e3 / frames if frames and spent is not None else None,
                 replaced=replaced, parameters=row.parameters, active_parameters=row.active_parameters,
                 claims=row.claims, kv_tier=row.kv_tier)


def busy_fraction(now: tuple[float, float], before: tuple[float, float] | None) -> float | None:
    """Engine seconds per second between two (busy seconds, wall time of the Status reply)
    of a stage: a remote stage's count moves only when a ping's reply comes, so its own
    times divide it. None without two replies apart, or where the count restarted (a new route)."""
    if before is None or now[1] <= before[1] or now[0] < before[0]:
        return None
    return round(min((now[0] - before[0]) / (now[1] - before[1]), 1.0), 3)


def _accept(now: Readings, before: Readings | None) -> float | None:
    if before is None:
        return None
    proposed = now.tally.proposed - before.tally.proposed
    return (now.tally.accepted - before.tally.accepted) / proposed if proposed > 0 else None


def _link_rate(now: Readings, before: Readings | None) -> float | None:
    return round(per_s(now, before, "bytes_sent"), 1) if before is not None else None


def _ping_ms(rows: tuple[StageHealth, ...], stage: int) -> float | None:
    """The round trip of the last Status call to a stage: its link's, from the watcher's pings."""
    row = next((r for r in rows if r.stage == stage), None)
    return round(row.link_ms, 2) if row is not None and row.link_ms is not None else None
