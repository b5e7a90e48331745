"""StageControl: the gRPC control plane of a stage daemon (DESIGN.md §4).

A coordinator claims the stage with a term; only the holder of the highest live term may
prepare, load or stop it (fencing). Prepare runs in the background; Load starts the engine
and the activation listener and answers with its endpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil

from proto import meshpipe_pb2 as pb
from proto import meshpipe_pb2_grpc as pb_grpc
from proto.version import PROTOCOL_VERSION, check_version
from stage.activations import ActivationStage
from stage.artifact_fetch import ArtifactFetcher
from stage.batcher import close_engine, on_engine_thread
from stage.calibration import Calibration, calibrate
from stage.engine import EngineConfig, RangeEngine
from stage.engine_choice import Engine, open_engine
from stage.grpc_auth import token_metadata
from stage.prepare import Fetcher, PreparedStage, Progress, prepare_stage
from stage.tls import MeshTls, client_ssl, server_ssl
from stage.transport import Limits, WireEmulation, connect, serve

log = logging.getLogger("meshpipe.stage")
MAX_LANES, MAX_CTX, MAX_BATCH = 256, 1 << 20, 8192
MAX_WIRE_DELAY_MS = 10_000.0


@dataclass(frozen=True)
class StageOptions:
    host: str  # where listeners bind
    advertise: str  # how other machines reach this one
    cache_dir: Path
    token: str | None
    threads: int
    tls: MeshTls | None = None
    cpu_lock: Path | None = None
    engine: Engine = "llama"  # resolved from --engine at start (stage.engine_choice)


class StageControl(pb_grpc.StageControlServicer):
    def __init__(self, options: StageOptions) -> None:
        self.opt = options
        self.stage_id = uuid.uuid4().hex[:12]
        self.term = 0
        self.lease_until_ms = 0
        self.state = pb.STARTING
        self.message = ""
        self.progress = Progress()
        self.prepare_task: asyncio.Task[PreparedStage] | None = None
        self.prepared: PreparedStage | None = None
        self.active: ActivationStage | None = None
        self.listener: asyncio.Server | None = None
        self.engine: RangeEngine | None = None
        self.calibration: Calibration | None = None  # of the loaded range, timed at Load
        self.range = (0, 0)

    # -- fencing -------------------------------------------------------------------------

    def _refuse(self, version: int, term: int | None = None) -> str | None:
        problem = check_version(version)
        if problem:
            return problem
        if term is not None and term != self.term:
            return f"stale coordinator term {term}: this stage is claimed by term {self.term}"
        return None

    async def Claim(self, request: pb.ClaimRequest, context: object) -> pb.ClaimReply:
        problem = check_version(request.protocol_version)
        if problem:
            return pb.ClaimReply(ok=False, message=problem, current_term=self.term)
        live = self.lease_until_ms > time.time() * 1000
        if request.term < self.term and live:
            return pb.ClaimReply(ok=False, current_term=self.term,
                                 message=f"stale coordinator term {request.term} < {self.term}")
        if request.term > self.term:
            await self._unload()  # a newer coordinator supersedes whatever the old one ran
        self.term = request.term
        self.lease_until_ms = request.lease_until_ms
        return pb.ClaimReply(ok=True, current_term=self.term)

    # -- preparation ---------------------------------------------------------------------

    async def Prepare(self, request: pb.PrepareRequest, context: object) -> pb.PrepareReply:
        problem = self._refuse(request.protocol_version, request.term)
        if problem:
            return pb.PrepareReply(accepted=False, message=problem)
        if request.layer_end <= request.layer_start:
            return pb.PrepareReply(accepted=False, message="empty layer range")
        await self._cancel_prepare()
        self.progress = Progress()
        self.prepared = None
        self.range = (request.layer_start, request.layer_end)
        fetch = _fetcher(request.artifact_source, request.manifest_sha256, self.opt)
        self.prepare_task = asyncio.get_running_loop().create_task(prepare_stage(
            request.package_ref, request.manifest_sha256, request.layer_start, request.layer_end,
            self.opt.cache_dir, fetch, self.progress, placeholders=self.opt.engine == "llama"))
        self.prepare_task.add_done_callback(self._prepared)
        return pb.PrepareReply(accepted=True)

    def _prepared(self, task: asyncio.Task[PreparedStage]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self.message = f"prepare failed: {exc}"
            log.error(self.message)
        else:
            self.prepared = task.result()

    async def _cancel_prepare(self) -> None:
        if self.prepare_task and not self.prepare_task.done():
            self.prepare_task.cancel()
            await asyncio.gather(self.prepare_task, return_exceptions=True)
        self.prepare_task = None

    async def Inventory(self, request: pb.InventoryRequest, context: object) -> pb.InventoryReply:
        problem = check_version(request.protocol_version)
        if problem:
            return pb.InventoryReply(state=pb.PREPARE_FAILED, message=problem)
        task = self.prepare_task
        if task is None:
            state = pb.IDLE
        elif not task.done():
            state = pb.PREPARING
        elif not task.cancelled() and task.exception() is None:
            # read the result here: `_prepared` runs a loop turn after the task is done, and
            # an Inventory in that turn would otherwise report a failure with no message
            self.prepared, state = task.result(), pb.PREPARED
        else:
            state = pb.PREPARE_FAILED
        sha = self.prepared.manifest_sha if self.prepared else ""
        return pb.InventoryReply(state=state, message=self.message if state == pb.PREPARE_FAILED else "",
                                 bytes_done=self.progress.bytes_done,
                                 bytes_total=self.progress.bytes_total,
                                 layer_start=self.range[0], layer_end=self.range[1],
                                 manifest_sha256=sha, engine=self.opt.engine)

    # -- loading -------------------------------------------------------------------------

    async def Load(self, request: pb.LoadRequest, context: object) -> pb.LoadReply:
        problem = self._refuse(request.protocol_version, request.term) or self._check_load(request)
        if problem:
            return pb.LoadReply(ready=False, message=problem)
        await self._unload()
        prepared = self.prepared
        assert prepared is not None
        try:
            endpoint = await self._start(prepared, request)
        except Exception as exc:  # noqa: BLE001 -- a failed load is a FAILED state the coordinator reads
            self.state, self.message = pb.FAILED, f"load failed: {exc}"
            log.error(self.message)  # the coordinator shows it too; this stage's operator sees it here
            await self._unload(keep_state=True)
            return pb.LoadReply(ready=False, message=self.message)
        self.state = pb.READY
        assert self.calibration is not None
        return pb.LoadReply(ready=True, endpoint=endpoint, calibration=self.calibration.to_wire())

    def _check_load(self, r: pb.LoadRequest) -> str | None:
        p = self.prepared
        if p is None or (p.start, p.end) != (r.layer_start, r.layer_end):
            return f"layers [{r.layer_start},{r.layer_end}) are not prepared on this stage"
        if r.final != (p.end == p.manifest.layer_count):
            return "the final flag disagrees with the prepared range"
        if not 0 < r.lanes <= MAX_LANES or not 0 < r.ctx_size <= MAX_CTX:
            return f"lanes must be in 1..{MAX_LANES} and ctx_size in 1..{MAX_CTX}"
        if not 0 <= r.batch <= MAX_BATCH or r.threads > 512:
            return "batch or threads out of range"
        if not (0 <= r.wire_delay_ms <= MAX_WIRE_DELAY_MS and 0 <= r.wire_jitter_ms <= MAX_WIRE_DELAY_MS):
            return f"wire delay and jitter must be in 0..{MAX_WIRE_DELAY_MS:g} ms"
        return None

    async def _start(self, p: PreparedStage, r: pb.LoadRequest) -> str:
        cfg = EngineConfig(first=p.start == 0, final=r.final, lanes=r.lanes,
                           ctx_per_lane=r.ctx_size, batch=r.batch or 256,
                           threads=r.threads or self.opt.threads, cpu_lock=self.opt.cpu_lock)
        self.engine = await on_engine_thread(open_engine, self.opt.engine, p.gguf, cfg)
        # before the listener opens: no session's lane can be in use yet
        self.calibration = await on_engine_thread(calibrate, self.engine, r.work_layers or p.end - p.start,
                                                  r.wire_dtype)
        emulation = WireEmulation(r.wire_delay_ms, r.wire_jitter_ms)  # benchmark-only; 0 on real meshes
        downstream = None
        if r.downstream:
            host, port = split_endpoint(r.downstream)
            downstream = await connect(host, port, token=self.opt.token, role="stage",
                                       ssl_context=client_ssl(self.opt.tls), emulation=emulation,
                                       name=f"stage{r.stage_index}->downstream")
        limits = Limits(max_width=self.engine.width, max_rows=max(cfg.batch, 4096))
        self.active = ActivationStage(self.engine, r.stage_index, r.wire_dtype, downstream, emulation)
        self.active.start()
        self.listener = await serve(self.opt.host, 0, self.active.handle_upstream,
                                    token=self.opt.token, ssl_context=server_ssl(self.opt.tls),
                                    limits=limits)
        port = self.listener.sockets[0].getsockname()[1]
        return f"{self.opt.advertise}:{port}"

    async def _unload(self, keep_state: bool = False) -> None:
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        if self.active is not None:
            await self.active.stop()
            self.active = None
        if self.engine is not None:
            engine, self.engine = self.engine, None
            await close_engine(engine)
        if not keep_state:
            self.state = pb.STARTING

    async def Stop(self, request: pb.StopRequest, context: object) -> pb.Ack:
        problem = self._refuse(request.protocol_version, request.term)
        if problem:
            return pb.Ack(ok=False, message=problem)
        self.state = pb.STOPPING
        await self._cancel_prepare()
        await self._unload()
        self.state = pb.STOPPED
        return pb.Ack(ok=True)

    async def Status(self, request: pb.StatusRequest, context: object) -> pb.StatusReply:
        vm = psutil.virtual_memory()
        failed = self.active.failed if self.active else None
        return pb.StatusReply(
            state=pb.FAILED if failed else self.state, message=failed or self.message,
            term=self.term, layer_start=self.range[0], layer_end=self.range[1],
            mem_total_bytes=vm.total, mem_available_bytes=vm.available,
            rss_bytes=psutil.Process(os.getpid()).memory_info().rss,
            stage_id=self.stage_id, protocol_version=PROTOCOL_VERSION,
            busy_seconds=self.active.core.batcher.busy_s if self.active else 0.0,
            engine=self.opt.engine,
        )


def split_endpoint(endpoint: str, listening: bool = False) -> tuple[str, int]:
    """HOST:PORT -> (host, port); port 0 (pick a free one) only for listeners."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit() or not (0 if listening else 1) <= int(port) < 65536:
        raise ValueError(f"bad endpoint {endpoint!r}: expected HOST:PORT")
    return host.strip("[]"), int(port)


def own_address() -> str:
    """This host's address as other machines see it, for a listener bound to 0.0.0.0.

    The host name often resolves to 127.0.1.1 (Debian, Ubuntu), which other machines cannot
    dial; the source address of the default route is the better guess. Callers warn when
    even that is a loopback address.
    """
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))  # TEST-NET-1; connecting a UDP socket sends nothing
        address = str(s.getsockname()[0])
        if not address.startswith("127."):
            return address
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _fetcher(source: str, manifest_sha: str, opt: StageOptions) -> Fetcher | None:
    """Pull files from the coordinator's ArtifactTransfer service, or None without a source."""
    if not source:
        return None
    return ArtifactFetcher(source, manifest_sha, opt.tls, token_metadata(opt.token))
