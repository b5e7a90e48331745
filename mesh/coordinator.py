"""The coordinator: stage 0 of the pipeline and the `Backend` the HTTP API talks to.

It builds the route, runs stage 0's layers in-process, and drives each request's generate
loop: prefill, then one pass through the pipeline per token.

Healing (mesh/routing/healing.py) keeps the route serving: it rebuilds a broken route, and an
in-flight generation pauses, prefills its prompt and the tokens generated so far through
the new route, and goes on.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import anyio
import grpc
import psutil

from common.sampling import EXACT
from mesh.backend import (
    Generation,
    GenerationRequest,
)
from mesh.model.tokenizer import Tokenizer
from mesh.reports.health import ClaimHealth, Health, StageHealth, StageState
from mesh.reports.hop_timing import HopTotals
from mesh.reports.own_work import WorkMark, other_per_frame, work_mark
from mesh.reports.recovery import Recoveries
from mesh.routing.artifact_server import ArtifactServer
from mesh.routing.healing import Healer
from mesh.routing.planner import StageCost, plan_measured, predicted_times, worth_recut
from mesh.routing.route import (
    RemoteStage,
    Route,
    RouteSettings,
    build,
    refresh_status,
    spawn_local_stage,
    teardown,
)
from mesh.routing.stage_cost import cost_at, decode_frames, measured
from mesh.serving.pipeline import Pipeline
from mesh.serving.requests import Requests
from mesh.serving.warm_up import chooses, warm_up
from mesh.speculative.draft import Draft, draft_path, vocab_mismatch
from mesh.speculative.ngram import NgramProposer
from mesh.speculative.plan import SpecPlan
from mesh.speculative.proposer import Combined, Proposer
from packages.architectures import keeps_state, package_verdict
from packages.manifest import Manifest
from packages.materialize import materialize_stage
from proto import meshpipe_pb2_grpc as pb_grpc
from stage.batcher import close_engine, on_engine_thread
from stage.calibration import BATCH_ROWS, calibrate
from stage.checkpoints import DEPTH
from stage.control import split_endpoint
from stage.engine import EngineConfig, RangeEngine
from stage.engine_choice import engine_kind, open_engine
from stage.grpc_auth import TokenInterceptor
from stage.llama_model import numerics_promise
from stage.tls import add_port, client_ssl
from stage.transport import REPLIES_ROLE, Link, connect

log = logging.getLogger("meshpipe.coordinator")

STATUS_TIMEOUT = 1.0  # /health answers within about this long even if a stage hangs
STATUS_TTL = 1.5  # a load balancer polling /health must not turn into a Status RPC per poll per stage
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
                 spec_note: str = "", coordinator_id: str | None = None) -> None:
        self.package_dir, self.manifest, self.manifest_sha = package_dir, manifest, manifest_sha
        self.settings, self.topology, self.say = settings, topology, say
        self.model_id = model_id or manifest.model_id
        self.ctx_per_session = settings.ctx_size
        self.route: Route | None = None
        # its claims' name on every stage, route after route (mesh.cli.serve.coordinator_id)
        self.coordinator_id = coordinator_id or uuid.uuid4().hex[:12]
        self.pipeline: Pipeline | None = None
        self.engine: RangeEngine | None = None
        self.tokenizer: Tokenizer | None = None
        self.artifact_server: grpc.aio.Server | None = None
        self.artifact_source = ""
        self.spec, self.spec_note = spec, spec_note
        self.draft: Draft | None = None
        self.proposer: Proposer | None = None  # the draft, prompt lookup, or both (DESIGN.md §6)
        self.hops = HopTotals()  # outlives route rebuilds, like the other counters
        self.stage_costs: tuple[StageCost, ...] = ()  # measured at the last Load; later plans cut on them
        self.work_mark: WorkMark | None = None  # when the route began serving
        self.own_work_s = 0.0  # stage 0's work besides its engines per decode frame, on the last route
        self.status_checked = 0.0  # monotonic time of the last Status round
        self.recoveries = Recoveries()
        self.healer = Healer(self, settings.resume_s, topology.spares, self.recoveries, say)
        self.requests = Requests(self, self.healer, settings, self.recoveries)
        # `Backend.generate` is the request path's own, bound here rather than wrapped
        self.generate: Callable[[GenerationRequest], Generation] = self.requests.generate

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        self.healer.start()  # first: a route that breaks while the draft loads is rebuilt at once
        await self._start_artifact_server()
        m = self.manifest
        self.say(f"model {self.model_id}: {package_verdict(m.architecture, m.allowed_cuts, m.layer_count)}")
        if keeps_state(m.architecture):
            self.say(f"model {self.model_id}: recurrent state rolls back by checkpoint ({DEPTH} a lane): at most "
                     f"{DEPTH - 1} frames in flight, and a free lane is reused only by a prompt that extends it")
        await self.build_route()
        await self._load_draft()
        if self.proposer is not None:
            self.say(f"numerics: {numerics_promise(self.settings.own_threads, self.settings.engines)}")
        if self.settings.warm_up and self.tokenizer is not None and chooses(self.spec, self.proposer):
            await warm_up(self.requests, self.tokenizer, self.say)
        self.healer.watch()

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

    async def build_route(self, healing: bool = False) -> None:
        """Build a route on the last measured costs (parameters at first). The first route
        is re-cut once when its stages' calibrations predict a clearly faster plan."""
        await self._build_once(healing)
        plans = self._measured_plan()
        if healing or plans is None or not self.settings.cut_on_measured or not worth_recut(*plans):
            return
        current, better = plans
        self.say(f"re-cut on measured time: the slowest stage {max(current) * 1e3:.2f} -> "
                 f"{max(better) * 1e3:.2f} ms a decode of {BATCH_ROWS} rows, predicted")
        await self.drop_route()
        await self._build_once(healing=False)
        self._measured_plan()

    def _measured_plan(self) -> tuple[list[float], list[float]] | None:
        """Keep the route's measured costs for later plans; return the predicted stage times
        of its plan and of the best plan on them. None when a stage did not calibrate."""
        route = self.route
        if route is None or route.work is None or route.stage0 is None:
            return None
        calibrations = [route.calibration0, *(s.calibration for s in route.stages)]
        if any(c is None for c in calibrations):
            return None
        known = [c for c in calibrations if c is not None]
        own = [self.own_work_s * BATCH_ROWS] + [0.0] * (len(known) - 1)  # stage 0's work besides its layers
        self.stage_costs = tuple(cost_at(c, BATCH_ROWS, o) for c, o in zip(known, own, strict=True))
        ranges = [route.stage0, *(s.range for s in route.stages if s.range is not None)]
        current = predicted_times(ranges, route.work, self.stage_costs)
        best = plan_measured(route.manifest.allowed_cuts, route.work, self.stage_costs)
        predicted = predicted_times(best, route.work, self.stage_costs)
        self.say("calibrated: " + ", ".join(f"{t * 1e3:.2f}" for t in current) + f" ms a decode of {BATCH_ROWS} rows "
                 "per stage, predicted; the best cut on them: " + ", ".join(f"{t * 1e3:.2f}" for t in predicted))
        return current, predicted

    async def _build_once(self, healing: bool) -> None:
        route = Route(self.package_dir, self.manifest, self.manifest_sha, self.settings,
                      coordinator_id=self.coordinator_id)
        try:
            for index in range(1, self.topology.local_stages):
                with anyio.CancelScope(shield=True):  # a stage spawned is one the teardown ends
                    route.stages.append(await asyncio.to_thread(spawn_local_stage, self.settings, index))
            route.stages += [RemoteStage(endpoint=p) for p in self.topology.peers]
            spares = [RemoteStage(endpoint=p) for p in self.topology.spares] if healing else []
            await build(route, psutil.virtual_memory().available, self.artifact_source, self.say,
                        without_unreachable=healing, spares=spares,
                        measured=self.stage_costs if self.settings.cut_on_measured else ())
            await self._start_stage0(route)
        except BaseException:
            with anyio.CancelScope(shield=True):  # cancelled by a stopping server, it still ends them
                await teardown(route)
            raise
        self.route = route
        self.work_mark = _mark(self.pipeline, self.draft, self.hops)
        self.say("route ready: " + describe(route))

    async def _start_stage0(self, route: Route) -> None:
        assert route.stage0 is not None
        s = self.settings
        gguf = await asyncio.to_thread(materialize_stage, self.package_dir, self.manifest,
                                       self.manifest_sha, route.stage0.start, route.stage0.end,
                                       s.cache_dir, engine_kind(s.engine(0)).placeholders)
        if self.tokenizer is None:
            self.tokenizer = await asyncio.to_thread(Tokenizer, gguf, self.model_id)
        cfg = EngineConfig(first=True, final=not route.stages, lanes=s.lanes,
                           ctx_per_lane=s.ctx_size, batch=s.batch, threads=s.own_threads, cpu_lock=s.cpu_lock)
        self.engine = await on_engine_thread(open_engine, s.engine(0), gguf, cfg)
        assert route.work is not None
        route.calibration0 = await on_engine_thread(calibrate, self.engine, route.work.of(route.stage0), s.wire_dtype)
        link = replies = None
        if route.stages:
            link = await _link(s, route.stages[0], "coordinator", "stage0->downstream")
        if link is not None and len(route.stages) > 1 and s.direct_return:  # else its upstream is us
            try:
                replies = await _link(s, route.stages[-1], REPLIES_ROLE, "stage0->replies")
            except BaseException:
                link.close()
                raise
        self.pipeline = Pipeline(self.engine, link, wire_dtype=s.wire_dtype, hops=self.hops, replies=replies,
                                 micro_batches=s.groups(1 + len(route.stages)), on_break=self.healer.route_broken,
                                 prefix_cache=s.prefix_cache, recurrent=keeps_state(self.manifest.architecture))
        self.pipeline.start()

    async def stop(self) -> None:
        await self.healer.stop()  # the watcher and any rebuild; its build tears down what it spawned
        if self.draft is not None:
            await self.draft.stop()
        await self.drop_route()
        if self.artifact_server is not None:
            await self.artifact_server.stop(grace=1)

    async def drop_route(self, quick: bool = False) -> None:
        if self.work_mark is not None:  # what the route's life says of stage 0's own work
            other = other_per_frame(self.work_mark, _mark(self.pipeline, self.draft, self.hops))
            self.own_work_s, self.work_mark = other if other is not None else self.own_work_s, None
        if self.pipeline is not None:
            pipeline, self.pipeline = self.pipeline, None
            await pipeline.stop()
        if self.engine is not None:
            engine, self.engine = self.engine, None
            await close_engine(engine)
        if self.route is not None:
            route, self.route = self.route, None
            await (teardown(route, QUICK_STOP_S, QUICK_STOP_S) if quick else teardown(route))

    # -- Backend -------------------------------------------------------------------------

    @property
    def speculative_acceptance(self) -> str:
        """The plan's rule; without speculation every draw is the exact-match one."""
        return self.spec.acceptance if self.spec is not None else EXACT

    def tok(self) -> Tokenizer:
        assert self.tokenizer is not None, "coordinator not started"
        return self.tokenizer

    async def health(self) -> Health:
        await self._refresh_stages()
        broken = self.pipeline is None or self.pipeline.broken is not None
        failures = self.requests.failures
        failing = failures.failing()  # a route that serves, but whose generations fail
        return Health(ok=not broken and failing is None, model=self.model_id, route=describe(self.route),
                      stages=stage_rows(self.route, self.pipeline, self.settings, self.hops),
                      error=self.healer.last_error or failing or None,
                      internal_errors=failures.count,
                      last_internal_error=failures.last_line,
                      speculative=self.spec.describe() if self.spec else self.spec_note,
                      draft_busy_s=self.draft.busy_s if self.draft else None,
                      recoveries=self.recoveries.count, sessions_resumed=self.recoveries.sessions,
                      last_recovery=self.recoveries.last)

    async def _refresh_stages(self) -> None:
        """Fresh memory and reachability from every stage, asked at once, at most every STATUS_TTL."""
        route = self.route
        if route is None or time.monotonic() - self.status_checked < STATUS_TTL:
            return
        self.status_checked = time.monotonic()
        await asyncio.gather(*(refresh_status(route, s, STATUS_TIMEOUT) for s in route.stages
                               if s.stub is not None), return_exceptions=True)



def _mark(pipeline: Pipeline | None, draft: Draft | None, hops: HopTotals) -> WorkMark:
    """Stage 0's engine seconds so far, its layers' and the draft's, and the decode frames."""
    engine_s = (pipeline.core.batcher.busy_s if pipeline else 0.0) + (draft.busy_s if draft else 0.0)
    return work_mark(engine_s, decode_frames(hops))


async def _link(s: RouteSettings, stage: RemoteStage, role: str, name: str) -> Link:
    host, port = split_endpoint(stage.activation)
    return await connect(host, port, token=s.token, role=role, ssl_context=client_ssl(s.tls),
                         emulation=s.wire, name=name)


def describe(route: Route | None) -> str:
    if route is None or route.stage0 is None:
        return "none"
    r0 = route.stage0
    hops = [f"coordinator [{r0.start},{r0.end})"]
    hops += [f"{s.endpoint} [{s.range.start},{s.range.end})" for s in route.stages if s.range is not None]
    return " -> ".join(hops)


def stage_rows(route: Route | None, pipeline: Pipeline | None, settings: RouteSettings,
               hops: HopTotals | None = None) -> tuple[StageHealth, ...]:
    if route is None or route.stage0 is None:
        return ()
    vm = psutil.virtual_memory()
    own = StageHealth(stage=0, endpoint="coordinator", start=route.stage0.start,
                      end=route.stage0.end, state="READY",
                      rss_bytes=psutil.Process().memory_info().rss,
                      mem_available_bytes=vm.available, status_at=time.time(),
                      busy_s=pipeline.core.batcher.busy_s if pipeline else None,
                      engine=settings.engine(0))
    ready: StageState = "READY" if pipeline and not pipeline.broken else "BROKEN"
    rows = (own, *(_remote_row(i, s, ready, route.coordinator_id) for i, s in enumerate(route.stages, 1)))
    return tuple(row.model_copy(update={**_timing(route, hops, row.stage), **_parameters(route, row.stage)})
                 for row in rows)


def _parameters(route: Route, index: int) -> dict[str, int | None]:
    """A stage's parameters, all and active (fewer in a mixture of experts), as planned."""
    rng = route.stages[index - 1].range if index else route.stage0
    if rng is None or route.work is None:
        return {"parameters": None, "active_parameters": None}
    total, active = route.work.parameters(rng)
    return {"parameters": round(total), "active_parameters": round(active)}


def _timing(route: Route, hops: HopTotals | None, index: int) -> dict[str, float | None]:
    """A stage's predicted and measured time per decode, in ms, and its link's round trip."""
    stage = route.stages[index - 1] if index else None
    cal = stage.calibration if stage else route.calibration0
    rng = stage.range if stage else route.stage0
    seen = measured(hops, index) if hops is not None else None
    predicted = None
    if cal is not None and rng is not None and route.work is not None:
        predicted = cost_at(cal, seen.rows if seen else BATCH_ROWS).time(route.work.of(rng)) * 1e3
    return {"predicted_ms": predicted, "measured_ms": seen.time_s * 1e3 if seen else None,
            "link_ms": stage.ping_s * 1e3 if stage and stage.ping_s is not None else None}


def _remote_row(index: int, s: RemoteStage, ready: StageState, coordinator: str) -> StageHealth:
    """A stage as its last Status reply left it; a stage that stopped answering is UNREACHABLE."""
    claims = tuple(ClaimHealth(coordinator=c.coordinator_id, this=c.coordinator_id == coordinator,
                               start=c.layer_start, end=c.layer_end, lanes=c.lanes, lanes_in_use=c.lanes_in_use)
                   for c in (s.status.claims if s.status else ()))
    return StageHealth(stage=index, endpoint=s.endpoint,
                       start=s.range.start if s.range else None, end=s.range.end if s.range else None,
                       state=ready if s.reachable else "UNREACHABLE",
                       rss_bytes=s.status.rss_bytes if s.status else None,
                       mem_available_bytes=s.status.mem_available_bytes if s.status else None,
                       status_at=s.status_at, busy_s=s.status.busy_seconds if s.status else None,
                       engine=s.status.engine or None if s.status else None, claims=claims)
