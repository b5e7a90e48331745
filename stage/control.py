"""StageControl: the gRPC control plane of a stage daemon (DESIGN.md §4).

Several coordinators may claim the stage at once, each with a lease of its own (stage/leases.py),
fenced by its own term: only a coordinator's live lease at its newest term may prepare, load
or stop what that coordinator runs here. Prepare runs in the background; Load runs the range
(loaded once, shared by every claim on it: stage/hosted.py) on lanes granted to the claim,
opens the claim's activation listener and answers with its endpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import psutil

from proto import meshpipe_pb2 as pb
from proto import meshpipe_pb2_grpc as pb_grpc
from proto.version import PROTOCOL_VERSION, check_version
from stage.activations import ActivationStage
from stage.artifact_fetch import ArtifactFetcher
from stage.core import StageCore
from stage.engine_choice import Engine, engine_kind
from stage.grpc_auth import token_metadata
from stage.hosted import MAX_LANES, Hosting
from stage.hosted import SHARES as SHARES  # for mesh stage's --lanes help
from stage.kv_tier import DEFAULT_CACHE_RAM, KvTier, tier_stats
from stage.lane_tier import lane_tier
from stage.lanes import LanePool
from stage.leases import Lease
from stage.prepare import Fetcher, PreparedStage
from stage.tls import MeshTls, client_ssl, server_ssl
from stage.transport import Limits, WireEmulation, connect, serve

log = logging.getLogger("meshpipe.stage")
MAX_CTX, MAX_BATCH = 1 << 20, 8192
MAX_WIRE_DELAY_MS = 10_000.0
T = TypeVar("T")
REAP_S = 1.0  # how often leases that ran out are looked for


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
    memory: int | None = None  # bytes its loaded ranges may take (--memory); None: what is free at each Load
    lanes: int = 0  # lanes an engine opens with, shared by the claims on it (--lanes); 0: by memory (size_lanes)
    cache_ram: int = DEFAULT_CACHE_RAM  # the KV tier's host memory (--cache-ram), every claim's together
    cache_disk: int = 0  # and its disk, under cache_dir/kv (--cache-disk)


class StageControl(pb_grpc.StageControlServicer):
    def __init__(self, options: StageOptions) -> None:
        self.opt = options
        self.stage_id = uuid.uuid4().hex[:12]
        self.leases: dict[str, Lease] = {}  # one per coordinator (stage/leases.py)
        self.hosting = Hosting(options.engine, options.threads, options.memory, options.lanes)
        self.reaper: asyncio.Task[None] | None = None
        self.shielded: set[asyncio.Future[Any]] = set()  # Loads and cleanups, run on if their callers go
        self.kv_tier = KvTier(options.cache_ram, options.cache_disk, options.cache_dir / "kv")

    # -- fencing -------------------------------------------------------------------------

    def _lease(self, version: int, coordinator: str, term: int) -> tuple[Lease | None, str | None]:
        """The coordinator's live lease at `term`, or why there is none."""
        if problem := check_version(version):
            return None, problem
        lease = self.leases.get(coordinator)
        if lease is None or not lease.live:
            return None, f"coordinator {coordinator or '(unnamed)'} holds no live claim on this stage"
        if term != lease.term:
            return None, (f"stale coordinator term {term}: coordinator {coordinator} claimed this stage "
                          f"with term {lease.term}")
        return lease, None

    async def Claim(self, request: pb.ClaimRequest, context: object) -> pb.ClaimReply:
        """A new lease, a renewal (the same term), or a newer term of the same coordinator,
        which ends its older lease. Other coordinators' leases are not touched."""
        problem = check_version(request.protocol_version)
        lease = self.leases.get(request.coordinator_id)
        if problem:
            return pb.ClaimReply(ok=False, message=problem, current_term=lease.term if lease else 0)
        if lease is not None and request.term < lease.term and lease.live:
            return pb.ClaimReply(ok=False, current_term=lease.term,
                                 message=f"stale coordinator term {request.term} < {lease.term}")
        if lease is not None and request.term == lease.term and lease.live:
            lease.until_ms = max(lease.until_ms, request.lease_until_ms)
            return pb.ClaimReply(ok=True, current_term=lease.term)
        if lease is not None:
            await self._end(lease)  # superseded, or run out: what it ran goes
        self.leases[request.coordinator_id] = Lease(request.coordinator_id, request.term, request.lease_until_ms)
        if self.reaper is None:
            self.reaper = asyncio.get_running_loop().create_task(self._reap())
        return pb.ClaimReply(ok=True, current_term=request.term)

    async def _reap(self) -> None:
        """End every lease its coordinator stopped renewing: a coordinator that died frees
        its lanes, and only its own."""
        while True:
            await asyncio.sleep(REAP_S)
            for lease in [lease for lease in self.leases.values() if not lease.live]:
                log.warning("coordinator %s's lease ran out: its lanes are freed", lease.coordinator)
                await self._end(lease)

    async def _end(self, lease: Lease) -> None:
        """End the lease; its cleanup runs to the end even when the call that asked is
        cancelled (a Stop past its deadline): lanes taken from the engine and never given
        back would be lost to every later claim."""
        if self.leases.get(lease.coordinator) is lease:
            del self.leases[lease.coordinator]
        await self._shielded(lease.end(self.hosting.release))

    async def _shielded(self, work: Coroutine[Any, Any, T]) -> T:
        """`work`, run to its end even if the call that awaits it is cancelled."""
        task = asyncio.ensure_future(work)
        self.shielded.add(task)
        task.add_done_callback(self.shielded.discard)
        return await asyncio.shield(task)

    # -- preparation ---------------------------------------------------------------------

    async def Prepare(self, request: pb.PrepareRequest, context: object) -> pb.PrepareReply:
        lease, problem = self._lease(request.protocol_version, request.coordinator_id, request.term)
        if lease is None:
            return pb.PrepareReply(accepted=False, message=problem)
        if request.layer_end <= request.layer_start:
            return pb.PrepareReply(accepted=False, message="empty layer range")
        await lease.cancel_prepare()
        lease.prepare(request, _fetcher(request.artifact_source, request.manifest_sha256, self.opt),
                      self.opt.cache_dir, placeholders=engine_kind(self.opt.engine).placeholders)
        return pb.PrepareReply(accepted=True)

    async def Inventory(self, request: pb.InventoryRequest, context: object) -> pb.InventoryReply:
        problem = check_version(request.protocol_version)
        if problem:
            return pb.InventoryReply(state=pb.PREPARE_FAILED, message=problem)
        lease = self.leases.get(request.coordinator_id)
        if lease is None:
            return pb.InventoryReply(state=pb.IDLE, engine=self.opt.engine)
        lease.touch()  # a coordinator polling a long download is alive
        return lease.inventory(self.opt.engine)

    # -- loading -------------------------------------------------------------------------

    async def Load(self, request: pb.LoadRequest, context: object) -> pb.LoadReply:
        lease, problem = self._lease(request.protocol_version, request.coordinator_id, request.term)
        problem = problem or self._check_load(request, lease)
        if problem or lease is None:
            return pb.LoadReply(ready=False, message=problem)
        # a Load cut short by its deadline runs on: the engine it opens and the lanes it takes
        # are then the lease's, let go with it, not lost
        return await self._shielded(self._load(lease, request))

    async def _load(self, lease: Lease, request: pb.LoadRequest) -> pb.LoadReply:
        await lease.unload(self.hosting.release)
        assert lease.prepared is not None
        lease.loading = True
        try:
            endpoint = await self._start(lease, lease.prepared, request)
        except Exception as exc:  # noqa: BLE001 -- a failed load is a FAILED state the coordinator reads
            lease.state, lease.message = pb.FAILED, f"load failed: {exc}"
            log.error(lease.message)  # the coordinator shows it too; this stage's operator sees it here
            await lease.unload(self.hosting.release)
            return pb.LoadReply(ready=False, message=lease.message)
        finally:
            lease.loading = False
            lease.touch()
        lease.state = pb.READY
        assert lease.hosted is not None
        head = getattr(lease.hosted.engine, "mtp", None)  # an MTP layer it drafts with (stage/mtp_head.py)
        tiered = lease.active is not None and lease.active.core.tier is not None
        return pb.LoadReply(ready=True, endpoint=endpoint, calibration=lease.hosted.calibration.to_wire(),
                            mtp_layers=head.layers if head is not None else 0, kv_tier=tiered)

    def _check_load(self, r: pb.LoadRequest, lease: Lease | None) -> str | None:
        p = lease.prepared if lease is not None else None
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

    async def _start(self, lease: Lease, p: PreparedStage, r: pb.LoadRequest) -> str:
        """Run the lease on its range (loaded now, or shared), on lanes granted to it."""
        hosted = await self.hosting.host(p, r, self.opt.cpu_lock)
        granted = hosted.grant(lease.coordinator, r.lanes)
        if isinstance(granted, str):
            if not hosted.holders:
                await self.hosting.release(hosted, lease.coordinator)
            raise ValueError(granted)
        lease.hosted = hosted
        emulation = WireEmulation(r.wire_delay_ms, r.wire_jitter_ms)  # benchmark-only; 0 on real meshes
        downstream = None
        if r.downstream:
            host, port = split_endpoint(r.downstream)
            downstream = await connect(host, port, token=self.opt.token, role="stage",
                                       ssl_context=client_ssl(self.opt.tls), emulation=emulation,
                                       name=f"stage{r.stage_index}->downstream")
        engine = hosted.engine
        limits = Limits(max_width=engine.width, max_rows=max(r.batch or 256, 4096))
        core = StageCore(engine, r.stage_index, r.wire_dtype, shared=hosted.batcher, lanes=LanePool(granted))
        core.tier = lane_tier(engine, self.kv_tier, str(hosted.key), r.kv_owner)
        lease.active = ActivationStage(engine, r.stage_index, r.wire_dtype, downstream, emulation, core=core)
        lease.active.start()
        lease.listener = await serve(self.opt.host, 0, lease.active.handle_upstream,
                                     token=self.opt.token, ssl_context=server_ssl(self.opt.tls),
                                     limits=limits)
        port = lease.listener.sockets[0].getsockname()[1]
        return f"{self.opt.advertise}:{port}"

    async def Stop(self, request: pb.StopRequest, context: object) -> pb.Ack:
        lease, problem = self._lease(request.protocol_version, request.coordinator_id, request.term)
        if lease is None:
            return pb.Ack(ok=False, message=problem)
        lease.state = pb.STOPPING
        await self._end(lease)
        return pb.Ack(ok=True)

    async def close(self) -> None:
        """End every lease and unload every range: the daemon is stopping."""
        if self.reaper is not None:
            self.reaper.cancel()
        for lease in list(self.leases.values()):
            await self._end(lease)
        await asyncio.gather(*self.shielded, return_exceptions=True)
        await self.hosting.close()

    async def Status(self, request: pb.StatusRequest, context: object) -> pb.StatusReply:
        """The machine, every claim, and in the top-level fields the asking coordinator's."""
        vm = psutil.virtual_memory()
        lease = self.leases.get(request.coordinator_id)
        failed = lease.active.failed if lease is not None and lease.active else None
        state = pb.STOPPED if lease is None else lease.state
        return pb.StatusReply(
            state=pb.FAILED if failed else state,  # type: ignore[arg-type]
            message=failed or (lease.message if lease else ""),
            term=lease.term if lease else 0, layer_start=lease.range[0] if lease else 0,
            layer_end=lease.range[1] if lease else 0,
            mem_total_bytes=vm.total, mem_available_bytes=vm.available,
            rss_bytes=psutil.Process(os.getpid()).memory_info().rss,
            stage_id=self.stage_id, protocol_version=PROTOCOL_VERSION,
            busy_seconds=lease.hosted.batcher.busy_s if lease and lease.hosted else 0.0,
            engine=self.opt.engine, claims=[lease.claim_info() for lease in self.leases.values()],
            ranges_loaded=len(self.hosting.ranges), kv_tier=tier_stats(self.kv_tier),
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
