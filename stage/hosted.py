"""The layer ranges a stage has loaded, each shared by every claim that runs it (DESIGN.md §4).

Two coordinators serving the same package over the same cut run one engine per range here,
not two: a range is keyed by (manifest, first layer, end), and each claim on it is granted
some of the engine's lanes. A range of another model loads beside it when the stage's
memory allows; otherwise the Load is refused with the figures. The last claim to let go of
a range unloads it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from common.ids import LaneId
from packages.gguf_files import open_gguf
from proto import meshpipe_pb2 as pb
from stage.batcher import Batcher, close_engine, on_engine_thread
from stage.calibration import Calibration, calibrate
from stage.engine import EngineConfig, RangeEngine
from stage.engine_choice import Engine, EngineKind, engine_kind
from stage.prepare import PreparedStage


@dataclass(frozen=True)
class RangeKey:
    manifest_sha: str
    start: int
    end: int
    mtp: bool = False  # a final range loaded with the package's MTP layers, to draft with

    def __str__(self) -> str:
        with_mtp = " with MTP" if self.mtp else ""
        return f"layers [{self.start},{self.end}) of package {self.manifest_sha[:12]}{with_mtp}"


@dataclass
class Hosted:
    """A loaded range: its engine, the one batcher every claim's frames share (so they
    batch together), the lanes not granted, and who holds the rest."""

    key: RangeKey
    engine: RangeEngine
    calibration: Calibration
    footprint: int  # bytes counted against the stage's memory
    batcher: Batcher = field(init=False)
    free: list[LaneId] = field(init=False)
    holders: dict[str, list[LaneId]] = field(default_factory=dict)  # coordinator -> its engine lanes

    def __post_init__(self) -> None:
        self.batcher = Batcher(self.engine)
        self.free = [LaneId(lane) for lane in range(self.engine.lanes)]

    def grant(self, coordinator: str, lanes: int) -> list[LaneId] | str:
        """`lanes` of the engine's for `coordinator`, or why not (the numbers, and who holds the rest)."""
        if lanes > len(self.free):
            held = ", ".join(f"coordinator {c} holds {len(ls)}" for c, ls in self.holders.items()) or "none held"
            return (f"coordinator {coordinator} asks {lanes} lanes of {self.key}; {len(self.free)} of this "
                    f"stage's {self.engine.lanes} are free ({held}): start the stage with a larger --lanes "
                    "to share it, or ask for fewer")
        granted, self.free = self.free[:lanes], self.free[lanes:]
        self.holders[coordinator] = granted
        return granted

    async def give_back(self, coordinator: str) -> None:
        """Empty the coordinator's lanes (the next claim must not find its KV) and free them."""
        lanes = self.holders.pop(coordinator, [])
        try:
            for lane in lanes:
                self.batcher.discard_lane(lane)
                with contextlib.suppress(Exception):  # a stopped engine has nothing left to empty
                    await self.batcher.trim(lane, 0)
        finally:  # even cut short, they are free: a frame's start position trims what is left
            self.free.extend(lanes)


class Hosting:
    """Every range this stage holds, within its memory (`budget`: bytes, or None for what the
    machine has free at each Load)."""

    def __init__(self, engine: Engine, threads: int, budget: int | None, lanes: int) -> None:
        self.engine_kind, self.threads, self.budget = engine_kind(engine), threads, budget
        self.lanes = lanes  # an engine's lanes when it opens: at least this many (0: what the first claim asks)
        self.ranges: dict[RangeKey, Hosted] = {}
        # one Load at a time: two coordinators loading the same new range at once (both healing
        # onto the same spare) must share one engine, not open two and lose one
        self.loading = asyncio.Lock()

    async def host(self, p: PreparedStage, r: pb.LoadRequest, cpu_lock: Path | None) -> Hosted:
        """The range `p`, loaded now or already; raises ValueError when it cannot be."""
        async with self.loading:
            return await self._host(p, r, cpu_lock)

    async def _host(self, p: PreparedStage, r: pb.LoadRequest, cpu_lock: Path | None) -> Hosted:
        key = RangeKey(p.manifest_sha, p.start, p.end, p.mtp and r.mtp)
        hosted = self.ranges.get(key)
        if hosted is not None:
            if r.ctx_size > hosted.engine.ctx_per_lane:
                raise ValueError(f"{key} is loaded here with {hosted.engine.ctx_per_lane} tokens a lane, "
                                 f"fewer than the {r.ctx_size} asked (--ctx-size)")
            return hosted
        lanes = max(self.lanes, r.lanes)
        need = footprint(p, self.engine_kind, lanes, r.ctx_size)
        if problem := self._no_room(key, need, lanes, r.ctx_size):
            raise ValueError(problem)
        cfg = EngineConfig(first=p.start == 0, final=r.final, lanes=lanes, ctx_per_lane=r.ctx_size,
                           batch=r.batch or 256, threads=r.threads or self.threads,
                           cpu_lock=cpu_lock, mtp=key.mtp)
        engine = await on_engine_thread(self.engine_kind.open, p.gguf, cfg)
        try:  # before any claim runs on it: no session's lane can be in use yet
            calibration = await on_engine_thread(calibrate, engine, r.work_layers or p.end - p.start, r.wire_dtype)
        except BaseException:
            await close_engine(engine)
            raise
        hosted = self.ranges[key] = Hosted(key, engine, calibration, need)
        hosted.batcher.start()
        return hosted

    def _no_room(self, key: RangeKey, need: int, lanes: int, ctx: int) -> str | None:
        held = sum(h.footprint for h in self.ranges.values())
        if self.budget is not None:
            left, of = self.budget - held, f" of this stage's --memory {_mib(self.budget)}"
        else:
            left, of = psutil.virtual_memory().available, " free on this machine"
        if need <= left:
            return None
        others = "; ".join(f"{h.key} holds {_mib(h.footprint)}" for h in self.ranges.values())
        return (f"{key} needs {_mib(need)} (weights and KV for {lanes} lanes of {ctx} tokens) and "
                f"{_mib(max(left, 0))} is left{of}" + (f" ({others})" if others else ""))

    async def release(self, hosted: Hosted, coordinator: str) -> None:
        """The coordinator's lanes back; the range unloads when no claim holds it."""
        await hosted.give_back(coordinator)
        if not hosted.holders:
            await self._unload(hosted)

    async def close(self) -> None:
        for hosted in list(self.ranges.values()):
            for coordinator in list(hosted.holders):
                await self.release(hosted, coordinator)
            await self._unload(hosted)  # held by nobody: none left, normally

    async def _unload(self, hosted: Hosted) -> None:
        if hosted.batcher.stopped:  # unloaded already
            return
        if self.ranges.get(hosted.key) is hosted:
            del self.ranges[hosted.key]
        await hosted.batcher.stop()
        await close_engine(hosted.engine)


def footprint(p: PreparedStage, engine: EngineKind, lanes: int, ctx: int) -> int:
    """What loading `p` costs this machine: its file (weights), its KV for every lane's
    whole context, and the engine's own."""
    widths = 0
    for t in open_gguf(p.gguf).tensors:
        if t.name.endswith((".attn_k.weight", ".attn_v.weight")):
            widths += int(t.shape[-1])
    return os.path.getsize(p.gguf) + lanes * ctx * engine.kv_bytes * widths + engine.overhead


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.0f} MiB"
