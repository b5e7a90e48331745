"""The layer ranges a stage has loaded, each shared by every claim that runs it (DESIGN.md §4).

Two coordinators serving the same package over the same cut run one engine per range here,
not two: a range is keyed by (manifest, first layer, end), and each claim on it is granted
some of the engine's lanes. A llama.cpp context cannot grow, so an engine opens with every
lane it will have (`size_lanes`): `mesh stage --lanes`, or by default room for `SHARES` claims
like the first, as memory allows. A range of another model loads beside it when the stage's
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

MAX_LANES = 256  # llama.cpp's LLAMA_MAX_SEQ: the most sequences (lanes) one context holds
# `mesh stage` without --lanes: a range opens with lanes for this many claims asking as many as
# the first, so further coordinators are admitted, fewer where memory says so (`size_lanes`)
SHARES = 4


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
    held_to: str = ""  # how memory held its lanes below the default's when it opened; "" when it did not
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
            refused = (f"coordinator {coordinator} asks {lanes} lanes of {self.key}; {len(self.free)} of this "
                       f"stage's {self.engine.lanes} are free ({held})")
            if self.held_to:  # memory is why there are no more
                return f"{refused}: {self.held_to}"
            return f"{refused}: start the stage with a larger --lanes to share it, or ask for fewer"
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
        self.lanes = lanes  # --lanes: what an engine opens with, or its first claim's ask if more; 0: size_lanes
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
        cost = range_cost(p, self.engine_kind, r.ctx_size)
        room = self._room()
        lanes = size_lanes(r.lanes, self.lanes, cost, room.left)
        if cost.of(lanes) > room.left:
            raise ValueError(self._no_room(key, cost.of(lanes), lanes, r.ctx_size, room))
        held_to = "" if self.lanes or lanes >= default_lanes(r.lanes) else \
            held_by_memory(lanes, r.lanes, cost, r.ctx_size, room)
        cfg = EngineConfig(first=p.start == 0, final=r.final, lanes=lanes, ctx_per_lane=r.ctx_size,
                           batch=r.batch or 256, threads=r.threads or self.threads,
                           cpu_lock=cpu_lock, mtp=key.mtp)
        engine = await on_engine_thread(self.engine_kind.open, p.gguf, cfg)
        try:  # before any claim runs on it: no session's lane can be in use yet
            calibration = await on_engine_thread(calibrate, engine, r.work_layers or p.end - p.start, r.wire_dtype)
        except BaseException:
            await close_engine(engine)
            raise
        hosted = self.ranges[key] = Hosted(key, engine, calibration, cost.of(lanes), held_to)
        hosted.batcher.start()
        return hosted

    def _room(self) -> Room:
        """What a new range may take: what --memory leaves beside the ranges held, or what is free."""
        if self.budget is None:
            return Room(psutil.virtual_memory().available, " free on this machine", "free memory on this machine")
        held = sum(h.footprint for h in self.ranges.values())
        return Room(self.budget - held, f" of this stage's --memory {_mib(self.budget)}",
                    "give the stage more --memory")

    def _no_room(self, key: RangeKey, need: int, lanes: int, ctx: int, room: Room) -> str:
        others = "; ".join(f"{h.key} holds {_mib(h.footprint)}" for h in self.ranges.values())
        return (f"{key} needs {_mib(need)} (weights and KV for {lanes} lanes of {ctx} tokens) and "
                f"{_mib(max(room.left, 0))} is left{room.of}" + (f" ({others})" if others else ""))

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


@dataclass(frozen=True)
class Room:
    """The bytes a new range may take (`left`), of what (`of`, for messages), and how to have more."""

    left: int
    of: str
    remedy: str


@dataclass(frozen=True)
class Cost:
    """What a range costs this machine: its weights and the engine's own (`fixed`), and each
    lane's KV for its whole context (`per_lane`)."""

    fixed: int
    per_lane: int

    def of(self, lanes: int) -> int:
        return self.fixed + lanes * self.per_lane


def range_cost(p: PreparedStage, engine: EngineKind, ctx: int) -> Cost:
    """Loading `p` with lanes of `ctx` tokens: its file (weights), the engine's own, and a
    lane's KV (`attn_k` and `attn_v` widths, `kv_bytes` an element)."""
    widths = 0
    for t in open_gguf(p.gguf).tensors:
        if t.name.endswith((".attn_k.weight", ".attn_v.weight")):
            widths += int(t.shape[-1])
    return Cost(os.path.getsize(p.gguf) + engine.overhead, ctx * engine.kv_bytes * widths)


def default_lanes(asked: int) -> int:
    """The lanes a range opens with by default (no --lanes) where memory allows: room for
    SHARES claims asking what its first claim asks."""
    return min(MAX_LANES, SHARES * asked)


def size_lanes(asked: int, explicit: int, cost: Cost, left: int) -> int:
    """The lanes a range's engine opens with, for a first claim asking `asked`, with `left`
    bytes left for it. `explicit` (--lanes) when set, or more if the claim asks more; else
    `default_lanes`, fewer where the lanes past the ask would take more than half of what the
    ask leaves (the rest stays for other ranges and the machine), never fewer than asked
    (whether those fit is the Load's memory check)."""
    if explicit:
        return max(explicit, asked)
    spare = max(left - cost.of(asked), 0) // 2
    room = asked + spare // cost.per_lane if cost.per_lane else MAX_LANES
    return max(asked, min(default_lanes(asked), room))


def held_by_memory(lanes: int, asked: int, cost: Cost, ctx: int, room: Room) -> str:
    """Why a range opened `lanes` lanes, fewer than `default_lanes(asked)`: memory, in figures."""
    return (f"memory held this range to {lanes} lanes when it loaded (a lane's KV for {ctx} tokens takes "
            f"{cost.per_lane / (1 << 20):.1f} MiB; with its first claim's {asked} lanes it took "
            f"{_mib(cost.of(asked))} of the {_mib(max(room.left, 0))} left{room.of}, and lanes past a first "
            f"claim's take at most half of the rest): {room.remedy}, or start the stage with --lanes N to open N lanes")


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.0f} MiB"
