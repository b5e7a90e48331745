"""Healing (DESIGN.md §2, replay-resume): keep a route serving while stages die or hang.

Liveness pings find a dead or frozen stage within seconds, and a closed link breaks the
route at once (`Pipeline.fail`, which tells `route_broken`). A reply past its deadline breaks
it only when no stage made progress meanwhile: the pings read each stage's engine time, and
one that grew means the stage works through a queue (slow under load is not dead). The
route is rebuilt as soon as it breaks, with or without traffic. In-flight generations wait
for the new route (`next_pipeline`) and resume on it; new requests wait as they do
(`live_pipeline`), or get 503 with `--resume-timeout 0`.

The watcher, the spares' prefetch and every rebuild run in the server's task scope: `stop`
cancels them all and returns once they have ended, a cancelled build's stages torn down.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from typing import Protocol

import anyio

from common.task_scope import TaskScope
from mesh.backend import MeshUnavailableError
from mesh.reports.recovery import Recoveries
from mesh.routing.route import RemoteStage, Route, RouteError, prefetch, refresh_status, renew
from mesh.serving.pipeline import Pipeline
from proto import meshpipe_pb2 as pb

log = logging.getLogger("meshpipe.healing")

PING_S = 1.0  # liveness: every stage is asked for its Status this often
PING_TIMEOUT_S = 2.0  # a stage that cannot answer in this long is frozen or gone: ~3 s to detect
WAIT_POLL_S = 0.05  # how often a paused request looks for the new route


class Served(Protocol):
    """What the healer keeps serving: the coordinator's route, with stage 0's pipeline on it."""

    pipeline: Pipeline | None
    route: Route | None
    artifact_source: str

    async def build_route(self, healing: bool = False) -> None: ...

    async def drop_route(self, quick: bool = False) -> None: ...


class Healer:
    def __init__(self, served: Served, resume_s: float, spares: tuple[str, ...], recoveries: Recoveries,
                 say: Callable[[str], None]) -> None:
        self.served, self.resume_s, self.spares = served, resume_s, spares
        self.recoveries, self.say = recoveries, say
        self.last_error = ""
        self.rebuilding = False
        self.busy: dict[str, float] = {}  # each stage's engine seconds at the last ping
        self.tasks = TaskScope("server")

    def start(self) -> None:
        """Open the server's task scope: a break from now on is rebuilt at once."""
        self.tasks.start()

    def watch(self) -> None:
        """Start pinging the route's stages, and have the spares prefetch their layers."""
        self.tasks.spawn(self._watch, "liveness watcher")
        if self.spares and self.served.route is not None:
            self.tasks.spawn(functools.partial(self._prefetch_spares, self.served.route), "spare prefetch")

    async def stop(self) -> None:
        """Cancel the watcher, the prefetch and any rebuild, and wait for them: a rebuild's
        build tears down the stages it spawned first. Requests still waiting give up."""
        await self.tasks.stop()

    def route_broken(self, reason: str) -> None:
        """The route is broken (the pipeline says so, or a ping did): rebuild it now."""
        self.last_error = reason
        self.recoveries.broke(reason)
        if not self.rebuilding:
            self.rebuilding = self.tasks.spawn(self._rebuild, "rebuild")

    async def next_pipeline(self, cause: str) -> Pipeline:
        """The rebuilt route's pipeline, once it serves; MeshUnavailableError after resume_s."""
        give_up = time.monotonic() + self.resume_s
        while time.monotonic() < give_up and not self.tasks.stopped:
            p = self.served.pipeline
            if p is not None and not p.broken:
                return p
            await asyncio.sleep(WAIT_POLL_S)
        if self.tasks.stopped:
            raise MeshUnavailableError(f"the route broke ({cause}) and the server is stopping")
        raise MeshUnavailableError(f"the route broke ({cause}) and no new one served within "
                                   f"{self.resume_s:g}s: {self.last_error or 'still rebuilding'}")

    async def live_pipeline(self) -> Pipeline:
        """The route's pipeline. During a rebuild a new request waits for the next route as a
        paused one does (bounded by resume_s) instead of being refused mid-recovery."""
        p = self.served.pipeline
        if p is not None and not p.broken:
            return p
        reason = (p.broken if p else None) or self.last_error or "route is being rebuilt"
        if p is not None:
            self.route_broken(reason)
        if self.resume_s <= 0:
            raise MeshUnavailableError(f"mesh unavailable: {reason}")
        return await self.next_pipeline(reason)

    async def _rebuild(self) -> None:
        """Withdraw the broken route and build a fresh one, retrying with backoff."""
        try:
            before = endpoints(self.served.route)
            with anyio.CancelScope(shield=True):  # a route being dropped is dropped whole
                await self.served.drop_route(quick=True)
            delay = 1.0
            while True:
                try:
                    await self.served.build_route(healing=True)
                    self.last_error = ""
                    self.recoveries.healed(replacements(before, endpoints(self.served.route)))
                    return
                except Exception as exc:  # noqa: BLE001 -- a stage killed mid-build can fail it any way; try again
                    self.last_error = f"rebuilding route: {exc}"
                    log.warning(self.last_error)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 8.0)  # sessions are waiting: keep trying often
        finally:
            self.rebuilding = False

    async def _watch(self) -> None:
        """Liveness: find a dead or frozen stage within seconds, with or without traffic."""
        while True:
            await asyncio.sleep(PING_S)
            pipeline, route = self.served.pipeline, self.served.route
            if pipeline is None or route is None or pipeline.broken:
                if not self.rebuilding:  # a build that never started, or died
                    self.route_broken(self.last_error or "no route")
                continue
            problem = await ping(route)
            if problem is None:
                self.recoveries.alive()
                if worked(route, self.busy):
                    pipeline.watch.progressed()
            elif self.served.pipeline is pipeline:  # still the route that was pinged
                pipeline.fail(problem)

    async def _prefetch_spares(self, route: Route) -> None:
        """Claim every spare and have it fetch the layers past stage 0's, so that taking over
        any peer's range needs no download (DESIGN.md §2, healing)."""
        assert route.stage0 is not None
        for endpoint in self.spares:
            try:
                await prefetch(route, RemoteStage(endpoint=endpoint), route.stage0.end, self.served.artifact_source)
                self.say(f"spare {endpoint}: layers [{route.stage0.end},{route.manifest.layer_count}) fetched")
            except Exception as exc:  # noqa: BLE001 -- a spare that cannot prefetch may still take over later
                self.say(f"WARNING: spare {endpoint} could not prefetch: {exc}")


def endpoints(route: Route | None) -> tuple[str, ...]:
    """The route's stages past stage 0, in pipeline order."""
    return tuple(s.endpoint for s in route.stages) if route is not None else ()


def replacements(before: tuple[str, ...], after: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """(gone, in its place), in pipeline order: each stage not in the new route with the next
    new one; a stage left out with no spare in its place pairs with "" (the others took its
    layers). Local stages are spawned anew at every rebuild: each is a replacement."""
    gone = [e for e in before if e not in after]
    new = [e for e in after if e not in before]
    return tuple((old, new[i] if i < len(new) else "") for i, old in enumerate(gone))


def worked(route: Route, seen: dict[str, float]) -> bool:
    """Whether a stage's engine time grew since the last ping (`seen` is updated): it finished
    work, so a frame past its reply deadline is queued behind others', not lost."""
    grew = False
    for stage in route.stages:
        if stage.status is not None:
            busy = stage.status.busy_seconds
            grew = grew or busy > seen.get(stage.endpoint, busy)
            seen[stage.endpoint] = busy
    for gone in seen.keys() - {s.endpoint for s in route.stages}:
        del seen[gone]  # a rebuilt route's local stages listen on new ports: forget the old ones
    return grew


async def ping(route: Route) -> str | None:
    """What is wrong with the route's stages, or None when every one answers in time."""
    for stage in route.stages:
        if stage.process is not None and (code := stage.process.poll()) is not None:
            return f"stage {stage.endpoint} exited (code {code})"
    answers = await asyncio.gather(*(refresh_status(route, s, PING_TIMEOUT_S) for s in route.stages),
                                   return_exceptions=True)
    for stage, answer in zip(route.stages, answers, strict=True):
        if isinstance(answer, BaseException):
            return f"stage {stage.endpoint} did not answer a liveness ping within {PING_TIMEOUT_S:g}s"
        if stage.status is not None and stage.status.state == pb.FAILED:
            return f"stage {stage.endpoint} failed: {stage.status.message}"
    try:
        await renew(route)
    except RouteError as exc:
        return str(exc)
    return None
