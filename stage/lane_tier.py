"""One claim's free lanes and the stage's KV tier (DESIGN.md §2, "KV tier"; issue 57).

A request that ends leaves its tokens in its lane (the prefix cache); its END names the key
the coordinator files them under (`FrameHeader.stash`). The lane's KV is read out only when
the lane is taken for another sequence (`begin` with `evict`), so a conversation that comes
back to its own lane costs nothing, and when the stage stops (`flush`), so that a restart
finds it. A request that extends a kept sequence has it loaded into its lane first
(`begin` with a `restore`): the frame's start then trims it to the match, as a lane's own
prefix is trimmed.

Every method but `stash_key` runs on the engine thread, queued on the batcher in order with
the lane's steps (`StageCore`), so a lane's state is never read while a decode writes it.
"""

from __future__ import annotations

import hashlib
import logging
import sys
import time
from dataclasses import dataclass
from typing import Protocol

from common.errors import EngineError
from stage.kv_tier import Kept, KvTier, Shelf, timed_restore

log = logging.getLogger("meshpipe.kv_tier")


def lane_tier(engine: object, tier: KvTier, range_name: str, owner: str) -> LaneTier | None:
    """The tier for one claim's lanes on `engine`, or None: no tier here, no owner named by
    the coordinator (an older one), or an engine that cannot read its lanes out (MLX)."""
    if not tier.enabled or not owner or not hasattr(engine, "export_lane"):
        return None
    return LaneTier(engine, tier, Shelf(tier_namespace(range_name, engine), owner))  # type: ignore[arg-type]


def tier_namespace(range_name: str, engine: object) -> str:
    """A name for everything a saved sequence's bytes depend on: the range (package and layers),
    the engine, its KV types and attention kernels, and the llama.cpp that wrote them."""
    parts = (range_name, type(engine).__name__, getattr(engine, "kv_cache", None),
             getattr(getattr(engine, "cfg", None), "flash_attn", None), getattr(engine, "ctx_per_lane", None),
             getattr(sys.modules.get("llama_cpp"), "__version__", ""))
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:24]


class TierEngine(Protocol):
    """What the tier needs of an engine (llama.cpp's; MLX has no tier)."""

    def export_lane(self, lane: int) -> bytes: ...

    def import_lane(self, lane: int, data: bytes, positions: int) -> None: ...

    def trim(self, lane: int, position: int) -> None: ...


@dataclass(frozen=True)
class Begin:
    """What a request's first frame asks of its lane before it runs: file what the lane holds
    under the key its END named (`evict`), then load the entry `restore` (holding
    `positions` positions), if any, leaving it in the tier too with `keep` (a request that
    reuses only part of it)."""

    evict: bool = False
    restore: str = ""
    positions: int = 0
    keep: bool = False

    def __bool__(self) -> bool:
        return self.evict or bool(self.restore)


class LaneTier:
    def __init__(self, engine: TierEngine, tier: KvTier, shelf: Shelf) -> None:
        self.engine, self.tier, self.shelf = engine, tier, shelf
        self.held: dict[int, tuple[str, int]] = {}  # free engine lane -> (its key, positions held)

    def ended(self, lane: int, key: str, positions: int) -> None:
        """A request ended on the lane, which keeps `positions` positions filed under `key`."""
        if key and positions > 0:
            self.held[lane] = (key, positions)
        else:
            self.held.pop(lane, None)

    def begin(self, lane: int, begin: Begin) -> None:
        """A request takes the lane: what it held is filed in the tier if the coordinator says
        it is evicted (else it is the request's own prefix), then the entry asked for is
        loaded. A missing or bad entry leaves the lane empty, so the frame fails here and the
        coordinator prefills the sequence again."""
        held = self.held.pop(lane, None)
        if begin.evict and held is not None:
            self._save(lane, *held)
        if begin.restore:
            self._restore(lane, begin)

    def flush(self) -> None:
        """The stage stops: every free lane's sequence goes to the tier, then host memory to disk."""
        for lane, (key, positions) in list(self.held.items()):
            self._save(lane, key, positions)
        self.held.clear()
        self.tier.flush()

    def _save(self, lane: int, key: str, positions: int) -> None:
        started = time.perf_counter()
        try:
            data = self.engine.export_lane(lane)
        except EngineError as exc:
            log.warning("kv tier: lane %d could not be saved (%s)", lane, exc)
            return
        self.tier.stats.save_s += time.perf_counter() - started
        self.tier.put(self.shelf, key, Kept(positions, data))

    def _restore(self, lane: int, begin: Begin) -> None:
        started = time.perf_counter()
        kept = self.tier.take(self.shelf, begin.restore, keep=begin.keep)
        if kept is None or kept.positions != begin.positions:
            log.warning("kv tier: entry %s is not here; the coordinator prefills it again", begin.restore[:12])
            self.engine.trim(lane, 0)
            return
        try:
            self.engine.import_lane(lane, kept.data, kept.positions)
        except EngineError as exc:
            log.warning("kv tier: entry %s could not be loaded (%s); the coordinator prefills it again",
                        begin.restore[:12], exc)
            self.engine.trim(lane, 0)
            return
        timed_restore(self.tier, started, kept.positions)
