"""Build the route: claim stages, plan ranges, prepare, load (final stage first), link up.

Local stages (`--local-stages N`) are `mesh stage` processes on loopback driven through
exactly the same gRPC calls as remote peers. If any step fails, everything started so far
is stopped and a RouteError explains which stage said what.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import grpc
from google.protobuf.message import Message

from config.errors import MeshpipeError
from mesh.routing.planner import LayerWork, StageCost, StageRange, plan_measured, plan_ranges
from mesh.routing.stage_fit import StageNeed, misfits, package_sizes
from packages.architectures import mtp_refusal, split_refusal
from packages.manifest import Manifest
from packages.parameters import package_parameters
from proto import meshpipe_pb2 as pb
from proto.clients import StageControlClient, Unary, rpc_name, stage_control
from proto.version import PROTOCOL_VERSION
from stage.calibration import Calibration, calibration_of
from stage.engine_choice import Engine, EngineChoiceError, engine_kind
from stage.grpc_auth import token_metadata
from stage.kv_tier import TierSizes
from stage.tls import MeshTls, channel
from stage.transport import NO_EMULATION, WireEmulation

V = PROTOCOL_VERSION
Req = TypeVar("Req", bound=Message)
Reply = TypeVar("Reply", bound=Message)
RPC_TIMEOUT = 30.0
STOP_TIMEOUT = 3.0  # teardown: a stage that cannot answer Stop this fast is ended anyway
EXIT_TIMEOUT = 5.0  # a spawned stage gets this long to exit after SIGTERM, then SIGKILL
# A claim lasts this long unless renewed (every LEASE_S / 3, by the liveness pings): a
# coordinator that dies frees its lanes on every stage within it, and only its own.
LEASE_S = 15.0


class RouteError(MeshpipeError):
    """The route could not be built; the message names the stage and the reason."""


@dataclass
class RemoteStage:
    endpoint: str
    process: subprocess.Popen[bytes] | None = None
    channel: grpc.aio.Channel | None = None
    stub: StageControlClient | None = None
    range: StageRange | None = None
    activation: str = ""
    status: pb.StatusReply | None = None
    reachable: bool = True  # the last Status call answered
    status_at: float = 0.0  # wall time of the last Status reply
    ping_s: float | None = None  # the round trip of the last Status call that answered: the link's
    calibration: Calibration | None = None  # what the stage timed at Load, for the planner
    mtp_layers: int = 0  # a final stage's MTP layers, loaded to draft with (its LoadReply)
    kv_tier: bool = False  # it keeps this coordinator's evicted sequences (its LoadReply)

    @property
    def control(self) -> StageControlClient:
        assert self.stub is not None, f"stage {self.endpoint} is not connected"
        return self.stub


@dataclass(frozen=True)
class BenchKnobs:
    """Benchmark-only settings (`mesh serve`'s hidden flags, mesh/cli/bench_args.py)."""

    wire: WireEmulation = NO_EMULATION  # a delay on every hop, both ways
    direct_return: bool = True  # the final stage answers stage 0 itself; False relays
    stage_cpus: tuple[str, ...] = ()  # a CPU list per local stage, stage 0 first


@dataclass(frozen=True)
class RouteSettings:
    """What routing reads of `mesh serve`'s settings: the stages' engines, lanes and context,
    how the wire and the plan run. Serving's are mesh/serving/settings.py's."""

    token: str | None
    cache_dir: Path
    lanes: int
    ctx_size: int
    batch: int
    threads: int
    wire_dtype: pb.WireDType = pb.F32
    tls: MeshTls | None = None
    cpu_lock: Path | None = None  # shared with local stages, which run on the same cores
    micro_batches: int | None = None  # session groups in flight (DESIGN.md §3); None: one per stage
    prefix_cache: bool = True  # stage 0's pipeline keeps a finished request's tokens (DESIGN.md §2)
    cut_on_measured: bool = True  # re-cut the first route and cut rebuilds on measured time (DESIGN.md §3)
    engines: tuple[Engine, ...] = ("llama",)  # per local stage, stage 0 first; the last one for the rest
    bench: BenchKnobs = BenchKnobs()
    mtp: bool = False  # the final stage drafts with the package's MTP layers (the speculation plan's)
    kv_tier: TierSizes = field(default_factory=TierSizes)  # every stage's KV tier, stage 0 too (DESIGN.md §2)

    def engine(self, index: int) -> Engine:
        """The engine local stage `index` runs (0: this process)."""
        return self.engines[min(index, len(self.engines) - 1)]

    def groups(self, stages: int) -> int:
        """Micro-batches for a route of `stages`: as set, else one group per stage, so each
        stage can work on one while the others compute. Stages that take turns on shared
        cores (a CPU lock) cannot compute at once: there, smaller decodes would only cost."""
        if self.micro_batches is not None:
            return self.micro_batches
        return 1 if self.cpu_lock is not None else stages

    @property
    def own_threads(self) -> int:
        """Engine threads in this process: `threads`, or 0 for one per CPU it may run on."""
        return self.threads or len(os.sched_getaffinity(0))


@dataclass
class Route:
    package_dir: Path
    manifest: Manifest
    manifest_sha: str
    settings: RouteSettings
    stages: list[RemoteStage] = field(default_factory=list)
    stage0: StageRange | None = None
    work: LayerWork | None = None  # each layer's work, which the plan and the calibrations count in
    calibration0: Calibration | None = None  # stage 0's, timed as it loads in the coordinator
    term: int = 0
    # the coordinator's, the same on every route it builds: a stage keeps one lease per id,
    # and a rebuilt route's newer term supersedes the old route's lease there
    coordinator_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    renewed_at: float = 0.0  # monotonic time of the last lease renewal (`renew`)

    async def rpc(self, stage: RemoteStage, call: Unary[Req, Reply], request: Req,
                  deadline_s: float = RPC_TIMEOUT) -> Reply:
        """`call` is one of `stage.control`'s methods, so mypy knows its reply type; a failure
        becomes a RouteError naming the stage and the RPC. The deadline is gRPC's: the stage
        sees it too and stops working on a call nobody waits for."""
        try:
            return await call(request, timeout=deadline_s, metadata=token_metadata(self.settings.token))
        except grpc.aio.AioRpcError as exc:
            raise RouteError(f"stage {stage.endpoint}: {rpc_name(request)} failed: "
                             f"{exc.details() or exc.code().name}") from None


def spawn_local_stage(s: RouteSettings, index: int) -> RemoteStage:
    """Start `mesh stage` on a free loopback port and read back where it listens; `index`
    is its place in the pipeline (stage 0 is the coordinator)."""
    cmd = [sys.executable, "-m", "mesh.cli", "stage", "--listen", "127.0.0.1:0",
           "--cache-dir", str(s.cache_dir)]
    cmd += ["--lanes", str(s.lanes)]  # it serves this coordinator alone: its lanes, not mesh stage's room for more
    if s.threads:  # else the stage runs one engine thread per CPU it may use
        cmd += ["--threads", str(s.threads)]
    if index < len(s.bench.stage_cpus):
        cmd += ["--cpus", s.bench.stage_cpus[index]]
    if s.tls:
        cmd += ["--tls-cert", str(s.tls.cert), "--tls-key", str(s.tls.key), "--tls-ca", str(s.tls.ca)]
    if s.cpu_lock:
        cmd += ["--cpu-lock", str(s.cpu_lock)]
    cmd += ["--engine", s.engine(index), "--cache-ram", str(s.kv_tier.ram), "--cache-disk", str(s.kv_tier.disk)]
    env = dict(os.environ)
    if s.token:
        env["MESHPIPE_TOKEN"] = s.token
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline().decode().strip()
    if not line.startswith("listening "):
        proc.kill()
        raise RouteError(f"local stage failed to start (said {line!r})")
    return RemoteStage(endpoint=line.split()[1], process=proc)


async def connect_stage(route: Route, stage: RemoteStage) -> None:
    stage.channel = channel(stage.endpoint, route.settings.tls)
    stage.stub = stage_control(stage.channel)
    await refresh_status(route, stage, RPC_TIMEOUT)
    assert stage.status is not None
    if stage.status.protocol_version != V:
        raise RouteError(f"stage {stage.endpoint} speaks protocol {stage.status.protocol_version}, "
                         f"this coordinator speaks {V}; upgrade meshpipe so they match")


async def refresh_status(route: Route, stage: RemoteStage, deadline_s: float) -> None:
    """Ask the stage for its state and memory; `reachable` says whether it answered."""
    asked = time.perf_counter()
    try:
        asked_for = pb.StatusRequest(protocol_version=V, coordinator_id=route.coordinator_id)
        stage.status = await route.rpc(stage, stage.control.Status, asked_for, deadline_s)
    except RouteError:
        stage.reachable = False
        raise
    stage.ping_s = time.perf_counter() - asked
    stage.reachable, stage.status_at = True, time.time()


async def build(route: Route, own_memory: int, artifact_source: str, say: Callable[[str], None],
                without_unreachable: bool = False, spares: Sequence[RemoteStage] = (),
                measured: Sequence[StageCost] = ()) -> None:
    """Claim → plan → Prepare → Inventory → Load (final first). Raises RouteError.
    `without_unreachable` (healing): a peer that does not answer is replaced by the first
    spare that does, else left out while the others take its layers. A configured peer is
    tried again at every build, so it rejoins. `measured`, one cost per stage (stage 0
    first), cuts on measured time; without it, or for another number of stages, the
    plan follows parameters and memory."""
    standby = list(spares)
    for i, stage in enumerate(list(route.stages)):
        try:
            await connect_stage(route, stage)
        except RouteError as exc:
            if not without_unreachable or stage.process is not None:
                raise
            await _disconnect(stage)
            route.stages.remove(stage)
            spare = await _first_answering(route, standby)
            if spare is not None:
                route.stages.insert(i, spare)
            say(f"WARNING: {exc}; " + (f"spare {spare.endpoint} takes its place" if spare else "planning without it"))
    weights = [float(own_memory)] + [float(s.status.mem_available_bytes) if s.status else 1.0
                                     for s in route.stages]
    ranges = await _plan(route, weights, own_memory, measured, say)
    route.stage0 = ranges[0]
    route.term = time.time_ns() // 1000
    for stage, rng in zip(route.stages, ranges[1:], strict=True):
        stage.range = rng
        await _claim(route, stage)
    route.renewed_at = time.monotonic()
    for stage in route.stages:
        await _prepare(route, stage, artifact_source)
    await _await_prepared(route, say)
    downstream = ""
    for index in range(len(route.stages), 0, -1):
        stage = route.stages[index - 1]
        await _load(route, stage, index, downstream)
        downstream = stage.activation


async def _plan(route: Route, weights: list[float], own_memory: int, measured: Sequence[StageCost],
                say: Callable[[str], None]) -> list[StageRange]:
    """The ranges, one per stage: on measured time when there is a cost per stage and
    that cut fits, else on parameters and memory. Raises RouteError when neither fits."""
    m = route.manifest
    if len(weights) > 1 and not m.allowed_cuts:
        reason = split_refusal(m.architecture) or "its package lists no allowed cut"
        raise RouteError(f"cannot split {m.model_id} ({m.architecture}) across {len(weights)} stages: {reason}; "
                         "serve it on one node (no --peer, --local-stages 1)")
    p = await asyncio.to_thread(package_parameters, route.package_dir, m)
    route.work = LayerWork(p.active, p.head, p.total)  # time on the active experts, memory on all (_check_fit)
    if (shared := shared_cut(route)) is not None:
        # another coordinator of this package runs a cut on these stages: the same ranges are
        # shared there (loaded once), where another cut would load the model a second time
        say("plan (shared with the stages' other coordinators): " + ", ".join(f"[{r.start},{r.end})" for r in shared))
        return shared
    ranges = plan_ranges(m.layer_count, m.allowed_cuts, weights, p.active, p.head)
    basis = "parameters"
    if len(measured) == len(weights):
        timed = plan_measured(m.allowed_cuts, route.work, measured)
        try:  # measured time knows nothing of memory: a cut that does not fit keeps to parameters
            await _check_fit(route, timed, own_memory)
            ranges, basis = timed, "measured time"
        except RouteError as exc:
            say(f"WARNING: the cut on measured time does not fit ({exc}); cutting on parameters")
    await _check_fit(route, ranges, own_memory)
    say(f"plan ({basis}): " + ", ".join(f"[{r.start},{r.end})" for r in ranges))
    return ranges


def shared_cut(route: Route) -> list[StageRange] | None:
    """The cut other coordinators already run of this package on the route's stages, in
    their order, with stage 0's range before it; None when there is no such whole cut."""
    ranges = []
    for stage in route.stages:
        held = [c for c in (stage.status.claims if stage.status else ())
                if c.manifest_sha256 == route.manifest_sha and c.state == pb.READY
                and c.coordinator_id != route.coordinator_id]
        if not held:
            return None
        ranges.append(StageRange(held[0].layer_start, held[0].layer_end))
    if not ranges or ranges[0].start == 0:
        return None
    cut = [StageRange(0, ranges[0].start), *ranges]
    chained = all(a.end == b.start for a, b in itertools.pairwise(cut))
    return cut if chained and cut[-1].end == route.manifest.layer_count else None


async def _check_fit(route: Route, ranges: list[StageRange], own_memory: int) -> None:
    """Refuse a plan a stage's engine cannot read or its machine cannot hold, before any
    stage prepares; stage 0 and the stages it spawned share this machine's memory."""
    s = route.settings
    sizes = await asyncio.to_thread(package_sizes, route.package_dir, route.manifest, route.settings.mtp)
    needs = [StageNeed("stage 0 (this process)", ranges[0], engine_kind(s.engine(0)), own_memory, "this machine")]
    for index, (stage, rng) in enumerate(zip(route.stages, ranges[1:], strict=True), 1):
        try:
            engine = engine_kind(stage.status.engine if stage.status is not None else None)
        except EngineChoiceError as e:
            raise RouteError(f"stage {index} ({stage.endpoint}): {e}; upgrade this coordinator") from e
        free = stage.status.mem_available_bytes if stage.status is not None else own_memory
        machine = "this machine" if stage.process is not None else stage.endpoint
        needs.append(StageNeed(f"stage {index} ({stage.endpoint})", rng, engine, free, machine))
    problems = misfits(sizes, needs, s.lanes, s.ctx_size)
    if problems:
        raise RouteError("the plan does not fit: " + "; ".join(problems))


async def _first_answering(route: Route, standby: list[RemoteStage]) -> RemoteStage | None:
    while standby:
        spare = standby.pop(0)
        try:
            await connect_stage(route, spare)
            return spare
        except RouteError:
            await _disconnect(spare)
    return None


async def _disconnect(stage: RemoteStage) -> None:
    if stage.channel is not None:
        await stage.channel.close()
        stage.channel = stage.stub = None


async def prefetch(route: Route, spare: RemoteStage, start: int, artifact_source: str) -> None:
    """Claim a spare and have it fetch layers [start, end of model): a later takeover of any
    range in there then prepares from its own cache. Raises RouteError."""
    try:
        await connect_stage(route, spare)
        spare.range = StageRange(start, route.manifest.layer_count)
        await _claim(route, spare)
        await _prepare(route, spare, artifact_source)
        asked = pb.InventoryRequest(protocol_version=V, coordinator_id=route.coordinator_id)
        while (inv := await route.rpc(spare, spare.control.Inventory, asked)).state != pb.PREPARED:
            if inv.state == pb.PREPARE_FAILED:
                raise RouteError(f"stage {spare.endpoint}: {inv.message}")
            await asyncio.sleep(0.5)
    finally:
        await _disconnect(spare)


async def _claim(route: Route, stage: RemoteStage) -> None:
    """Claim the stage, or renew the claim (the same term): a lease of LEASE_S, which the
    liveness pings renew (`renew`), so a coordinator that dies frees its lanes soon."""
    reply = await route.rpc(stage, stage.control.Claim, pb.ClaimRequest(
        protocol_version=V, coordinator_id=route.coordinator_id, term=route.term,
        topology_id=route.manifest_sha[:16], run_id=uuid.uuid4().hex[:8],
        lease_until_ms=int((time.time() + LEASE_S) * 1000)))
    if not reply.ok:
        raise RouteError(f"stage {stage.endpoint} refused the claim: {reply.message}")


async def renew(route: Route) -> None:
    """Renew the route's leases when a third of LEASE_S has passed; raises RouteError when a
    stage refuses (it lost the lease: restarted, or this coordinator was paused past it)."""
    if time.monotonic() - route.renewed_at < LEASE_S / 3:
        return
    route.renewed_at = time.monotonic()
    await asyncio.gather(*(_claim(route, stage) for stage in route.stages))


async def _prepare(route: Route, stage: RemoteStage, artifact_source: str) -> None:
    from packages import hub  # only coordinators prepare stages; stage daemons skip the import

    assert stage.range is not None
    reply = await route.rpc(stage, stage.control.Prepare, pb.PrepareRequest(
        protocol_version=V, term=route.term, coordinator_id=route.coordinator_id,
        package_ref=hub.package_ref(route.package_dir),
        manifest_sha256=route.manifest_sha, layer_start=stage.range.start,
        layer_end=stage.range.end, artifact_source=artifact_source, mtp=_mtp(route, stage)))
    if not reply.accepted:
        raise RouteError(f"stage {stage.endpoint} refused Prepare: {reply.message}")


async def _await_prepared(route: Route, say: Callable[[str], None]) -> None:
    last_report = 0.0
    while True:
        asked = pb.InventoryRequest(protocol_version=V, coordinator_id=route.coordinator_id)
        replies = [await route.rpc(s, s.control.Inventory, asked)
                   for s in route.stages]
        for stage, inv in zip(route.stages, replies, strict=True):
            if inv.state == pb.PREPARE_FAILED:
                raise RouteError(f"stage {stage.endpoint}: {inv.message}")
        done = sum(r.bytes_done for r in replies)
        total = sum(r.bytes_total for r in replies)
        if all(r.state == pb.PREPARED for r in replies):
            say(f"prepared: {done / 1e6:.1f} MB on {len(replies)} stage(s)")
            return
        if time.monotonic() - last_report > 2:
            say(f"preparing: {done / 1e6:.1f}/{max(total, 1) / 1e6:.1f} MB")
            last_report = time.monotonic()
        await asyncio.sleep(0.2)


async def _load(route: Route, stage: RemoteStage, index: int, downstream: str) -> None:
    s = route.settings
    assert stage.range is not None
    assert route.work is not None
    work_layers = route.work.of(stage.range)
    reply = await route.rpc(stage, stage.control.Load, pb.LoadRequest(
        protocol_version=V, term=route.term, coordinator_id=route.coordinator_id, layer_start=stage.range.start,
        layer_end=stage.range.end, ctx_size=s.ctx_size, lanes=s.lanes, wire_dtype=s.wire_dtype,
        final=stage.range.end == route.manifest.layer_count, threads=s.threads, batch=s.batch,
        downstream=downstream, stage_index=index, wire_delay_ms=s.bench.wire.delay_ms,
        wire_jitter_ms=s.bench.wire.jitter_ms, work_layers=work_layers, mtp=_mtp(route, stage),
        kv_owner=route.coordinator_id if s.kv_tier and s.prefix_cache else ""))
    if not reply.ready:
        raise RouteError(f"stage {stage.endpoint} failed to load: {reply.message}")
    stage.activation, stage.mtp_layers, stage.kv_tier = reply.endpoint, reply.mtp_layers, reply.kv_tier
    stage.calibration = calibration_of(reply.calibration, work_layers)


def _mtp(route: Route, stage: RemoteStage) -> bool:
    return stage.range is not None and wants_mtp(route, stage.range.start, stage.range.end)


def wants_mtp(route: Route, start: int, end: int) -> bool:
    """Whether the stage of [start, end) is asked to draft with the package's MTP layers: the
    final one, when the plan drafts so and its architecture runs MTP on such a stage."""
    m = route.manifest
    return route.settings.mtp and end == m.layer_count and bool(m.mtp_layers) and \
        mtp_refusal(m.architecture, start) is None


async def teardown(route: Route, stop_s: float = STOP_TIMEOUT, exit_s: float = EXIT_TIMEOUT) -> None:
    """Stop every stage we claimed and end the processes we spawned, all at once: one hung
    stage must not hold up the others, nor the event loop that serves the rest. A broken
    route is torn down with short waits: sessions are paused until the next one serves."""
    await asyncio.gather(*(_release(route, stage, stop_s, exit_s) for stage in route.stages))


async def _release(route: Route, stage: RemoteStage, stop_s: float, exit_s: float) -> None:
    if stage.stub is not None and route.term:
        with contextlib.suppress(Exception):
            await route.rpc(stage, stage.control.Stop, pb.StopRequest(
                protocol_version=V, term=route.term, coordinator_id=route.coordinator_id), stop_s)
    await _disconnect(stage)
    if stage.process is not None:
        await end_process(stage.process, exit_s)


async def end_process(process: subprocess.Popen[bytes], grace_s: float = EXIT_TIMEOUT) -> None:
    """SIGTERM, then SIGKILL after `grace_s`. Polls rather than waiting in a thread: a cancelled
    wait then leaves no executor thread behind for asyncio.run to block on at exit."""
    if process.poll() is None:
        process.terminate()
    deadline = time.monotonic() + grace_s
    while process.poll() is None:
        if time.monotonic() > deadline:
            process.kill()
            deadline = float("inf")
        await asyncio.sleep(0.05)
