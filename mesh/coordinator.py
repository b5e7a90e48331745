"""The coordinator: stage 0 of the pipeline and the `Backend` the HTTP API talks to.

It builds the route, runs stage 0's layers in-process, and drives each request's generate
loop: prefill, then one pass through the pipeline per token.

Healing (DESIGN.md §2, replay-resume): liveness pings find a dead or frozen stage within
seconds, and a closed link or a missed reply deadline breaks the route at once. The route
is rebuilt as soon as it breaks, with or without traffic. In-flight generations pause,
prefill their prompt and the tokens generated so far through the new route, and go on;
new requests get 503 until it serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import grpc
import psutil

from common.ids import LaneId, SessionId
from mesh.artifact_server import ArtifactServer
from mesh.backend import (
    Acceptance,
    Cached,
    Finished,
    GenerationEvent,
    GenerationRequest,
    MeshUnavailableError,
    RequestRejectedError,
    Resumed,
    Sampled,
)
from mesh.health import Health, StageHealth, StageState
from mesh.hop_timing import HopTotals
from mesh.pipeline import Lease, Pipeline, StageFailedError
from mesh.recovery import Recoveries
from mesh.route import (
    RemoteStage,
    Route,
    RouteSettings,
    build,
    prefetch,
    refresh_status,
    spawn_local_stage,
    teardown,
)
from mesh.speculative.draft import DRAFT, Draft, draft_path, vocab_mismatch
from mesh.speculative.loop import Windows, generate
from mesh.speculative.ngram import NGRAM, NgramProposer
from mesh.speculative.plan import WINDOWS_IN_FLIGHT, SpecPlan
from mesh.speculative.proposer import Combined, Proposer
from mesh.speculative.window import Controller, controller_for
from mesh.tokenizer import Tokenizer
from packages.manifest import Manifest
from packages.materialize import materialize_stage
from proto import meshpipe_pb2 as pb
from proto import meshpipe_pb2_grpc as pb_grpc
from stage.batcher import close_engine, on_engine_thread
from stage.control import split_endpoint
from stage.engine import EngineConfig, RangeEngine
from stage.engine_choice import open_engine
from stage.grpc_auth import TokenInterceptor
from stage.tls import add_port, client_ssl
from stage.transport import REPLIES_ROLE, Link, connect

log = logging.getLogger("meshpipe.coordinator")

STATUS_TIMEOUT = 1.0  # /health answers within about this long even if a stage hangs
STATUS_TTL = 1.5  # a load balancer polling /health must not turn into a Status RPC per poll per stage
PING_S = 1.0  # liveness: every stage is asked for its Status this often
PING_TIMEOUT_S = 2.0  # a stage that cannot answer in this long is frozen or gone: ~3 s to detect
QUICK_STOP_S = 1.0  # tearing down a broken route: Stop and exit waits, short, as sessions are paused


@dataclass(frozen=True)
class Topology:
    peers: tuple[str, ...]
    local_stages: int
    artifact_listen: str  # where the ArtifactTransfer server binds
    advertise: str  # how stages reach the coordinator
    spares: tuple[str, ...] = ()  # standby stages: each takes the place of a peer that does not answer


class Coordinator:
    def __init__(self, package_dir: Path, manifest: Manifest, manifest_sha: str,
                 settings: RouteSettings, topology: Topology, model_id: str | None = None,
                 say: Callable[[str], None] = print, spec: SpecPlan | None = None,
                 spec_note: str = "") -> None:
        self.package_dir, self.manifest, self.manifest_sha = package_dir, manifest, manifest_sha
        self.settings, self.topology, self.say = settings, topology, say
        self.model_id = model_id or manifest.model_id
        self.ctx_per_session = settings.ctx_size
        self.sessions = itertools.count(1)
        self.admission = asyncio.Semaphore(settings.lanes)
        self.route: Route | None = None
        self.pipeline: Pipeline | None = None
        self.engine: RangeEngine | None = None
        self.tokenizer: Tokenizer | None = None
        self.artifact_server: grpc.aio.Server | None = None
        self.artifact_source = ""
        self.rebuilding: asyncio.Task[None] | None = None
        self.last_error = ""
        self.spec, self.spec_note = spec, spec_note
        self.draft: Draft | None = None
        self.proposer: Proposer | None = None  # the draft, prompt lookup, or both (DESIGN.md §6)
        self.shared_windows: dict[str, Controller] = {}
        self.hops = HopTotals()  # outlives route rebuilds, like the other counters
        self.status_checked = 0.0  # monotonic time of the last Status round
        self.recoveries = Recoveries()
        self.watcher: asyncio.Task[None] | None = None
        self.prefetching: asyncio.Task[None] | None = None

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        await self._start_artifact_server()
        await self._build()
        await self._load_draft()
        self.watcher = asyncio.get_running_loop().create_task(self._watch())
        if self.topology.spares and self.route is not None:
            self.prefetching = asyncio.get_running_loop().create_task(self._prefetch_spares(self.route))

    async def _load_draft(self) -> None:
        """Load the planned draft; on any problem serve on without it, loudly: with prompt
        lookup alone where the plan has it, else without speculation."""
        if self.spec is None:
            self.say(f"speculative: {self.spec_note}")
            return
        ngram = self.spec.ngram
        lookup = NgramProposer(ngram.ngram_min, ngram.ngram_max) if ngram else None
        if self.spec.draft_model is None:  # prompt lookup alone: no draft is loaded or downloaded
            self.proposer = lookup
            self.say(f"speculative: {self.spec.describe()}")
            return
        try:
            gguf = await asyncio.to_thread(draft_path, self.spec, self.package_dir)
            s = self.settings
            draft = await asyncio.to_thread(Draft, gguf, s.lanes, s.ctx_size, s.own_threads, s.cpu_lock)
        except Exception as exc:  # noqa: BLE001 -- whatever broke the draft, serve on without it
            return self._no_speculation(f"draft {self.spec.draft_model} unavailable: {exc}")
        assert self.tokenizer is not None
        mismatch = vocab_mismatch(self.tokenizer, draft.engine)
        if mismatch:
            await draft.stop()
            return self._no_speculation(f"draft {self.spec.draft_model} refused: {mismatch}")
        draft.start()
        self.draft = draft
        self.proposer = Combined(lookup, draft) if lookup else draft
        self.say(f"speculative: {self.spec.describe()}")

    def _no_speculation(self, reason: str) -> None:
        if self.spec is not None and self.spec.ngram is not None:  # prompt lookup needs no draft
            ngram = self.spec.ngram
            self.spec = replace(self.spec, draft_model=None, strategy=None, window=ngram.window)
            self.proposer = NgramProposer(ngram.ngram_min, ngram.ngram_max)
            log.warning("draft disabled: %s; serving with prompt lookup alone", reason)
            self.say(f"WARNING: draft disabled: {reason}; speculative: {self.spec.describe()}")
            return
        self.spec, self.spec_note = None, f"off: {reason}"
        log.warning("speculative decoding disabled: %s; serving without it", reason)
        self.say(f"WARNING: speculative decoding disabled: {reason}")

    async def _start_artifact_server(self) -> None:
        if not self.topology.peers and self.topology.local_stages <= 1:
            return
        token = self.settings.token
        server = grpc.aio.server(interceptors=[TokenInterceptor(token)] if token else [])
        pb_grpc.add_ArtifactTransferServicer_to_server(
            ArtifactServer(self.package_dir, self.manifest, self.manifest_sha), server)
        port = add_port(server, self.topology.artifact_listen, self.settings.tls)
        await server.start()
        self.artifact_server = server
        self.artifact_source = f"{self.topology.advertise}:{port}"

    async def _build(self, healing: bool = False) -> None:
        route = Route(self.package_dir, self.manifest, self.manifest_sha, self.settings)
        try:
            for index in range(1, self.topology.local_stages):
                route.stages.append(await asyncio.to_thread(spawn_local_stage, self.settings, index))
            route.stages += [RemoteStage(endpoint=p) for p in self.topology.peers]
            spares = [RemoteStage(endpoint=p) for p in self.topology.spares] if healing else []
            await build(route, psutil.virtual_memory().available, self.artifact_source, self.say,
                        without_unreachable=healing, spares=spares)
            await self._start_stage0(route)
        except BaseException:
            await teardown(route)
            raise
        self.route = route
        self.say("route ready: " + self.describe_route())

    async def _start_stage0(self, route: Route) -> None:
        assert route.stage0 is not None
        s = self.settings
        gguf = await asyncio.to_thread(materialize_stage, self.package_dir, self.manifest,
                                       self.manifest_sha, route.stage0.start, route.stage0.end,
                                       s.cache_dir)
        if self.tokenizer is None:
            self.tokenizer = await asyncio.to_thread(Tokenizer, gguf, self.model_id)
        cfg = EngineConfig(first=True, final=not route.stages, lanes=s.lanes,
                           ctx_per_lane=s.ctx_size, batch=s.batch, threads=s.own_threads, cpu_lock=s.cpu_lock)
        self.engine = await on_engine_thread(open_engine, s.engine(0), gguf, cfg)
        link = replies = None
        if route.stages:
            link = await self._link(route.stages[0], "coordinator", "stage0->downstream")
        if link is not None and len(route.stages) > 1 and s.direct_return:  # else its upstream is us
            try:
                replies = await self._link(route.stages[-1], REPLIES_ROLE, "stage0->replies")
            except BaseException:
                link.close()
                raise
        self.pipeline = Pipeline(self.engine, link, wire_dtype=s.wire_dtype, hops=self.hops, replies=replies,
                                 micro_batches=s.groups(1 + len(route.stages)), on_break=self._route_broken,
                                 prefix_cache=s.prefix_cache)
        self.pipeline.start()

    async def _link(self, stage: RemoteStage, role: str, name: str) -> Link:
        s = self.settings
        host, port = split_endpoint(stage.activation)
        return await connect(host, port, token=s.token, role=role, ssl_context=client_ssl(s.tls),
                             emulation=s.wire, name=name)

    async def stop(self) -> None:
        for task in (self.watcher, self.prefetching):
            if task:
                task.cancel()
        if self.rebuilding:
            self.rebuilding.cancel()  # its build tears down the stages it spawned; wait for that
            await asyncio.wait([self.rebuilding])
        if self.draft is not None:
            await self.draft.stop()
        await self._drop_route()
        if self.artifact_server is not None:
            await self.artifact_server.stop(grace=1)

    async def _drop_route(self, quick: bool = False) -> None:
        if self.pipeline is not None:
            pipeline, self.pipeline = self.pipeline, None
            await pipeline.stop()
        if self.engine is not None:
            engine, self.engine = self.engine, None
            await close_engine(engine)
        if self.route is not None:
            route, self.route = self.route, None
            await (teardown(route, QUICK_STOP_S, QUICK_STOP_S) if quick else teardown(route))

    def _route_broken(self, reason: str) -> None:
        """The route is broken (the pipeline says so, or a ping did): rebuild it now."""
        self.last_error = reason
        self.recoveries.broke(reason)
        if self.rebuilding is None or self.rebuilding.done():
            self.rebuilding = asyncio.get_running_loop().create_task(self._rebuild())

    async def _rebuild(self) -> None:
        """Withdraw the broken route and build a fresh one, retrying with backoff."""
        await self._drop_route(quick=True)
        delay = 1.0
        while True:
            try:
                await self._build(healing=True)
                self.last_error = ""
                self.recoveries.healed()
                return
            except Exception as exc:  # noqa: BLE001 -- a stage killed mid-build can fail it any way; try again
                self.last_error = f"rebuilding route: {exc}"
                log.warning(self.last_error)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 8.0)  # sessions are waiting: keep trying often

    # -- Backend -------------------------------------------------------------------------

    def tok(self) -> Tokenizer:
        assert self.tokenizer is not None, "coordinator not started"
        return self.tokenizer

    async def health(self) -> Health:
        await self._refresh_stages()
        broken = self.pipeline is None or self.pipeline.broken is not None
        return Health(ok=not broken, model=self.model_id, route=self.describe_route(),
                      stages=self.stage_rows(), error=self.last_error or None,
                      speculative=self.spec.describe() if self.spec else self.spec_note,
                      draft_busy_s=self.draft.busy_s if self.draft else None,
                      recoveries=self.recoveries.count, sessions_resumed=self.recoveries.sessions,
                      last_recovery=self.recoveries.last)

    async def _prefetch_spares(self, route: Route) -> None:
        """Claim every spare and have it fetch the layers past stage 0's, so that taking over
        any peer's range needs no download (DESIGN.md §2, healing)."""
        assert route.stage0 is not None
        for endpoint in self.topology.spares:
            try:
                await prefetch(route, RemoteStage(endpoint=endpoint), route.stage0.end, self.artifact_source)
                self.say(f"spare {endpoint}: layers [{route.stage0.end},{self.manifest.layer_count}) fetched")
            except Exception as exc:  # noqa: BLE001 -- a spare that cannot prefetch may still take over later
                self.say(f"WARNING: spare {endpoint} could not prefetch: {exc}")

    async def _watch(self) -> None:
        """Liveness: find a dead or frozen stage within seconds, with or without traffic."""
        while True:
            await asyncio.sleep(PING_S)
            pipeline, route = self.pipeline, self.route
            if pipeline is None or route is None or pipeline.broken:
                if self.rebuilding is None or self.rebuilding.done():  # a build that never started, or died
                    self._route_broken(self.last_error or "no route")
                continue
            problem = await _ping(route)
            if problem is None:
                self.recoveries.alive()
            elif self.pipeline is pipeline:  # still the route that was pinged
                pipeline.fail(problem)

    async def _refresh_stages(self) -> None:
        """Fresh memory and reachability from every stage, asked at once, at most every STATUS_TTL."""
        route = self.route
        if route is None or time.monotonic() - self.status_checked < STATUS_TTL:
            return
        self.status_checked = time.monotonic()
        await asyncio.gather(*(refresh_status(route, s, STATUS_TIMEOUT) for s in route.stages
                               if s.stub is not None), return_exceptions=True)

    def describe_route(self) -> str:
        if self.route is None or self.route.stage0 is None:
            return "none"
        r0 = self.route.stage0
        hops = [f"coordinator [{r0.start},{r0.end})"]
        hops += [f"{s.endpoint} [{s.range.start},{s.range.end})" for s in self.route.stages
                 if s.range is not None]
        return " -> ".join(hops)

    def stage_rows(self) -> tuple[StageHealth, ...]:
        if self.route is None or self.route.stage0 is None:
            return ()
        vm = psutil.virtual_memory()
        own = StageHealth(stage=0, endpoint="coordinator", start=self.route.stage0.start,
                          end=self.route.stage0.end, state="READY",
                          rss_bytes=psutil.Process().memory_info().rss,
                          mem_available_bytes=vm.available, status_at=time.time(),
                          busy_s=self.pipeline.core.batcher.busy_s if self.pipeline else None,
                          engine=self.settings.engine(0))
        ready: StageState = "READY" if self.pipeline and not self.pipeline.broken else "BROKEN"
        return (own, *(_remote_row(i, s, ready) for i, s in enumerate(self.route.stages, 1)))

    async def generate(self, req: GenerationRequest) -> AsyncGenerator[GenerationEvent, None]:
        if len(req.prompt) == 0:
            raise RequestRejectedError("the prompt is empty")
        if len(req.prompt) + req.max_tokens > self.ctx_per_session:
            raise RequestRejectedError(f"prompt ({len(req.prompt)}) + max_tokens ({req.max_tokens}) "
                                  f"exceeds the context of {self.ctx_per_session} tokens")
        # the final stage checks these too, but a refusal there could only be a 503
        if self.engine is not None and (problem := req.sampling.problem(self.engine.n_vocab)):
            raise RequestRejectedError(problem)
        async with self.admission:
            pipeline = await self._live_pipeline()
            session, draft = SessionId(next(self.sessions)), self.proposer if self.spec is not None else None
            done: list[int] = []  # the completion so far: a resumed run prefills it again
            lane: LaneId | None = None
            carried = _Carried()
            try:
                while True:
                    again = replace(req, done=tuple(done))
                    # a resumed request asks for its old lane: the draft's KV is still there
                    lease = pipeline.lease(session, again.prefill, lane)
                    lane = lease.lane
                    try:
                        # closed here, not left to the garbage collector: a client that leaves
                        # must free the session on every stage before the next request comes
                        attempt = self._attempt(pipeline, lease, again, draft, first=not carried.resumed)
                        async with contextlib.aclosing(attempt) as events:
                            async for event in events:
                                event = carried.add(event)
                                if isinstance(event, Sampled):
                                    done.append(event.token)
                                yield event
                        return
                    except MeshUnavailableError:
                        if pipeline.broken is None or self.settings.resume_s <= 0:
                            raise
                    paused, cause = time.monotonic(), pipeline.broken
                    log.info("session %d: paused after %d tokens: %s", session, len(done), cause)
                    pipeline = await self._next_pipeline(cause)
                    log.info("session %d: resuming after %.1fs", session, time.monotonic() - paused)
                    carried.resume()
                    self.recoveries.sessions += 1
                    yield Resumed(cause, time.monotonic() - paused)
            finally:
                if draft is not None and lane is not None:
                    if not self.settings.prefix_cache:  # with it, the draft's KV serves the lane's next request too
                        draft.forget(lane)
                    log.info("session %d: %s", session, _outcome(carried.finished or carried.acceptance))

    async def _attempt(self, pipeline: Pipeline, lease: Lease, req: GenerationRequest,
                       draft: Proposer | None, first: bool) -> AsyncGenerator[GenerationEvent, None]:
        """One run of the generate loop on one route; the session ends there with it, and
        what every stage's KV holds of it stays in the lane (the prefix cache). The first
        run says how much of the prompt was cached; a resumed one prefills it again."""
        try:
            if first:
                yield Cached(lease.cached)
            in_flight = windows_in_flight(self.spec, pipeline.link is not None, self.settings.cpu_lock)
            async for event in generate(pipeline, lease, req, self.ctx_per_session, draft,
                                        self._window(), in_flight):
                yield event
        except StageFailedError as exc:
            raise MeshUnavailableError(f"a stage failed this request: {exc}") from None
        finally:
            with contextlib.suppress(Exception):
                await asyncio.shield(pipeline.end(lease.session, lease.held))

    async def _next_pipeline(self, cause: str) -> Pipeline:
        """The rebuilt route's pipeline, once it serves; MeshUnavailableError after resume_s."""
        give_up = time.monotonic() + self.settings.resume_s
        while time.monotonic() < give_up:
            p = self.pipeline
            if p is not None and not p.broken:
                return p
            await asyncio.sleep(0.05)
        raise MeshUnavailableError(f"the route broke ({cause}) and no new one served within "
                                   f"{self.settings.resume_s:g}s: {self.last_error or 'still rebuilding'}")

    def _window(self) -> Windows | None:
        """Window controllers for a new session, one per proposer. Cost-aware is shared by
        every session: step and verify costs are the machine's, and short requests cannot
        learn them alone; the others follow the session's own acceptance."""
        if self.spec is None:
            return None
        policies = {NGRAM: self.spec.ngram.window} if self.spec.ngram else {}
        if self.spec.draft_model is not None:
            policies[DRAFT] = self.spec.window
        windows = {}
        for name, policy in policies.items():
            if policy.policy != "cost-aware":
                windows[name] = controller_for(policy)
            else:
                windows[name] = self.shared_windows.setdefault(name, controller_for(policy))
        return windows

    async def _live_pipeline(self) -> Pipeline:
        """The route's pipeline. During a rebuild a new request waits for the next route as a
        paused one does (bounded by resume_s) instead of being refused mid-recovery."""
        p = self.pipeline
        if p is not None and not p.broken:
            return p
        reason = (p.broken if p else None) or self.last_error or "route is being rebuilt"
        if p is not None:
            self._route_broken(reason)
        if self.settings.resume_s <= 0:
            raise MeshUnavailableError(f"mesh unavailable: {reason}")
        return await self._next_pipeline(reason)


def windows_in_flight(spec: SpecPlan | None, downstream: bool, cpu_lock: Path | None) -> int:
    """The verify frames a session may keep out: the configured number, else (auto) 1 where
    frames sent ahead cannot overlap, with no stage past stage 0 or with stages taking turns
    on shared cores, and WINDOWS_IN_FLIGHT elsewhere, for the cost-aware window to price."""
    if spec is None:
        return 1
    if spec.in_flight is not None:
        return spec.in_flight
    return WINDOWS_IN_FLIGHT if downstream and cpu_lock is None else 1


async def _ping(route: Route) -> str | None:
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
    return None


@dataclass
class _Carried:
    """What a generation carries across resumes: the draft's record up to the last break,
    which each new run's record adds to, and how often it resumed."""

    before: Acceptance = field(default_factory=Acceptance)
    acceptance: Acceptance | None = None  # the running record, carried
    finished: Finished | None = None
    resumed: int = 0
    cached: int = 0  # prompt tokens the first run found in its lane

    def add(self, event: GenerationEvent) -> GenerationEvent:
        if isinstance(event, Cached):
            self.cached = event.tokens
        elif isinstance(event, Acceptance):
            event = self.acceptance = self.before.plus(event)
        elif isinstance(event, Finished):
            spec = None if event.speculative is None else self.before.plus(event.speculative)
            event = self.finished = replace(event, speculative=spec, resumed=self.resumed, cached_tokens=self.cached)
        return event

    def resume(self) -> None:
        self.resumed += 1
        self.before = self.acceptance or self.before


def _remote_row(index: int, s: RemoteStage, ready: StageState) -> StageHealth:
    """A stage as its last Status reply left it; a stage that stopped answering is UNREACHABLE."""
    return StageHealth(stage=index, endpoint=s.endpoint,
                       start=s.range.start if s.range else None, end=s.range.end if s.range else None,
                       state=ready if s.reachable else "UNREACHABLE",
                       rss_bytes=s.status.rss_bytes if s.status else None,
                       mem_available_bytes=s.status.mem_available_bytes if s.status else None,
                       status_at=s.status_at, busy_s=s.status.busy_seconds if s.status else None,
                       engine=s.status.engine or None if s.status else None)


def _outcome(last: Acceptance | Finished | None) -> str:
    if isinstance(last, Finished):
        return f"{last.completion_tokens} tokens ({last.finish_reason}), speculative {last.speculative}"
    return f"ended early, speculative {last}"  # a stop string, a client gone or an error closed it
