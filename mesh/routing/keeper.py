"""The route stage 0 serves on: built, re-cut on measured time, dropped, and stage 0's own
layers and pipeline on it. The healer (mesh/routing/healing.py) rebuilds it through here;
requests (mesh/serving/requests.py) read stage 0's engine from it.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import anyio
import grpc
import psutil

from mesh.model.tokenizer import Tokenizer
from mesh.reports.hop_timing import HopTotals
from mesh.reports.own_work import WorkMark, other_per_frame, work_mark
from mesh.routing.artifact_server import ArtifactServer
from mesh.routing.planner import StageCost, plan_measured, predicted_times, worth_recut
from mesh.routing.route import (
    RemoteStage,
    Route,
    RouteSettings,
    build,
    refresh_status,
    spawn_local_stage,
    teardown,
    wants_mtp,
)
from mesh.routing.route_rows import describe
from mesh.routing.stage_cost import cost_at, decode_frames
from mesh.serving.kv_index import TierIndex
from mesh.serving.pipeline import Pipeline, PipelineOptions
from packages.architectures import keeps_state, mtp_refusal
from packages.manifest import Manifest
from packages.materialize import materialize_stage
from proto import meshpipe_pb2 as pb
from proto import meshpipe_pb2_grpc as pb_grpc
from stage.batcher import close_engine, on_engine_thread
from stage.calibration import BATCH_ROWS, calibrate
from stage.control import split_endpoint
from stage.engine import EngineConfig, RangeEngine
from stage.engine_choice import engine_kind, open_engine
from stage.grpc_auth import TokenInterceptor
from stage.kv_tier import KvTier, tier_stats
from stage.lane_tier import LaneTier, lane_tier
from stage.tls import add_port, client_ssl
from stage.transport import REPLIES_ROLE, Link, connect

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


@dataclass(frozen=True)
class ServedModel:
    """The package a coordinator serves, pinned by its manifest's sha256, and its API name."""

    package_dir: Path
    manifest: Manifest
    manifest_sha: str
    model_id: str


class RouteKeeper:
    """The route, stage 0's engine and pipeline on it, and what later plans learn from it."""

    def __init__(self, model: ServedModel, settings: RouteSettings, topology: Topology, coordinator_id: str,
                 say: Callable[[str], None]) -> None:
        self.model, self.settings, self.topology, self.say = model, settings, topology, say
        self.coordinator_id = coordinator_id  # its claims' name on every stage, route after route
        self.route: Route | None = None
        self.pipeline: Pipeline | None = None
        self.engine: RangeEngine | None = None
        self.tokenizer: Tokenizer | None = None
        self.artifact_server: grpc.aio.Server | None = None
        self.artifact_source = ""
        self.hops = HopTotals()  # outlives route rebuilds, like the other counters
        self.stage_costs: tuple[StageCost, ...] = ()  # measured at the last Load; later plans cut on them
        self.work_mark: WorkMark | None = None  # when the route began serving
        self.own_work_s = 0.0  # stage 0's work besides its engines per decode frame, on the last route
        self.status_checked = 0.0  # monotonic time of the last Status round
        self.on_break: Callable[[str], None] = lambda _: None  # the healer's, set when it is made
        self.other_busy_s: Callable[[], float] = lambda: 0.0  # stage 0's other engine time: the draft's
        # stage 0's KV tier and the index of what every stage's keeps: both outlive routes
        tier = settings.kv_tier
        self.kv_tier = KvTier(tier.ram, tier.disk, settings.cache_dir / "kv")
        index = settings.cache_dir / "kv" / f"index-{coordinator_id}-{model.manifest_sha[:16]}.json"
        self.tier_index = TierIndex(index if tier.disk else None) if tier and settings.prefix_cache else None

    async def start_artifact_server(self) -> None:
        if not self.topology.peers and self.topology.local_stages <= 1:
            return
        token, m = self.settings.token, self.model
        server = grpc.aio.server(interceptors=[TokenInterceptor(token)] if token else [])
        pb_grpc.add_ArtifactTransferServicer_to_server(ArtifactServer(m.package_dir, m.manifest, m.manifest_sha),
                                                       server)
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
        m = self.model
        route = Route(m.package_dir, m.manifest, m.manifest_sha, self.settings, coordinator_id=self.coordinator_id)
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
        self.work_mark = self._mark()
        self.say("route ready: " + describe(route))

    async def _start_stage0(self, route: Route) -> None:
        assert route.stage0 is not None
        s, m = self.settings, self.model
        final = not route.stages
        mtp = wants_mtp(route, route.stage0.start, route.stage0.end)
        gguf = await asyncio.to_thread(functools.partial(
            materialize_stage, m.package_dir, m.manifest, m.manifest_sha, route.stage0.start, route.stage0.end,
            s.cache_dir, engine_kind(s.engine(0)).placeholders, mtp=mtp))
        if self.tokenizer is None:
            self.tokenizer = await asyncio.to_thread(Tokenizer, gguf, m.model_id)
        cfg = EngineConfig(first=True, final=final, lanes=s.lanes, ctx_per_lane=s.ctx_size, batch=s.batch,
                           threads=s.own_threads, cpu_lock=s.cpu_lock, mtp=mtp)
        self.engine = await on_engine_thread(open_engine, s.engine(0), gguf, cfg)
        assert route.work is not None
        route.calibration0 = await on_engine_thread(calibrate, self.engine, route.work.of(route.stage0), s.wire_dtype)
        link, replies = await _links(s, route)
        stage0_tier = lane_tier(self.engine, self.kv_tier, f"{m.manifest_sha}:{route.stage0.start}:"
                                f"{route.stage0.end}:{mtp}", self.coordinator_id)
        options = PipelineOptions(wire_dtype=s.wire_dtype, micro_batches=s.groups(1 + len(route.stages)),
                                  prefix_cache=s.prefix_cache, recurrent=keeps_state(m.manifest.architecture),
                                  mtp=self._mtp_layers(route) > 0, tier=self._tier_index(route, stage0_tier))
        self.pipeline = Pipeline(self.engine, link, replies, self.hops, self.on_break, options)
        self.pipeline.core.tier = stage0_tier
        self.pipeline.start()

    def _tier_index(self, route: Route, stage0: LaneTier | None) -> TierIndex | None:
        """The KV tier's index when every stage keeps a tier, else none (said once, when a
        stage cannot: a restored lane needs every stage's share of the sequence)."""
        if self.tier_index is None:
            return None
        lacking = ["stage 0"] if stage0 is None else []
        lacking += [f"stage {i + 1} ({s.endpoint})" for i, s in enumerate(route.stages) if not s.kv_tier]
        if lacking:
            self.say(f"WARNING: no KV tier on this route: {', '.join(lacking)} keeps none (an MLX engine, "
                     "--cache-ram 0 and --cache-disk 0 there, or an older meshpipe); lanes still cache prefixes")
            return None
        return self.tier_index

    def _mtp_layers(self, route: Route) -> int:
        """The MTP layers the route's final stage drafts with; said loudly when the plan wanted
        them and that stage has none (an engine without them, or an older peer)."""
        head = getattr(self.engine, "mtp", None) if not route.stages else None
        layers = head.layers if head is not None else route.stages[-1].mtp_layers if route.stages else 0
        if self.settings.mtp and not layers:
            m = route.manifest
            final = route.stages[-1].range if route.stages else route.stage0
            why = final is not None and mtp_refusal(m.architecture, final.start)
            self.say(f"WARNING: the final stage drafts nothing: {why or 'it did not load the MTP layers'}; "
                     "serving without MTP drafts")
        return layers

    async def drop_route(self, quick: bool = False) -> None:
        if self.work_mark is not None:  # what the route's life says of stage 0's own work
            other = other_per_frame(self.work_mark, self._mark())
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

    async def stop(self) -> None:
        await self.drop_route()
        if self.artifact_server is not None:
            await self.artifact_server.stop(grace=1)

    async def refresh_stages(self) -> None:
        """Fresh memory and reachability from every stage, asked at once, at most every STATUS_TTL."""
        route = self.route
        if route is None or time.monotonic() - self.status_checked < STATUS_TTL:
            return
        self.status_checked = time.monotonic()
        await asyncio.gather(*(refresh_status(route, s, STATUS_TIMEOUT) for s in route.stages
                               if s.stub is not None), return_exceptions=True)

    def tier_figures(self) -> list[tuple[str, pb.KvTierStats]]:
        """Each stage's KV tier figures, by its place in the route: stage 0's read here, the
        others' from their last Status reply."""
        figures = []
        if (own := tier_stats(self.kv_tier)) is not None:
            figures.append(("0", own))
        for index, stage in enumerate(self.route.stages if self.route else [], start=1):
            if stage.status is not None and stage.status.HasField("kv_tier"):
                figures.append((str(index), stage.status.kv_tier))
        return figures

    def _mark(self) -> WorkMark:
        """Stage 0's engine seconds so far, its layers' and the draft's, and the decode frames."""
        engine_s = (self.pipeline.core.batcher.busy_s if self.pipeline else 0.0) + self.other_busy_s()
        return work_mark(engine_s, decode_frames(self.hops))


async def _links(s: RouteSettings, route: Route) -> tuple[Link | None, Link | None]:
    """Stage 0's link to the next stage, and the final stage's link back where replies go direct."""
    if not route.stages:
        return None, None
    link = await _link(s, route.stages[0], "coordinator", "stage0->downstream")
    if len(route.stages) == 1 or not s.bench.direct_return:  # else its upstream is us
        return link, None
    try:
        return link, await _link(s, route.stages[-1], REPLIES_ROLE, "stage0->replies")
    except BaseException:
        link.close()
        raise


async def _link(s: RouteSettings, stage: RemoteStage, role: str, name: str) -> Link:
    host, port = split_endpoint(stage.activation)
    return await connect(host, port, token=s.token, role=role, ssl_context=client_ssl(s.tls),
                         emulation=s.bench.wire, name=name)
