"""A stage's second tier of KV (DESIGN.md §2, "KV tier"; issue 57): sequences evicted from
their lanes, kept in host memory up to `ram` bytes, then on disk up to `disk` bytes, the least
recently used going first.

An entry is named by a namespace that names everything its bytes depend on (the package, the
range, the engine and its KV types: `Shelf.namespace`), the coordinator that owns it (its stable
id, so that several coordinators on one stage keep their own entries, all bounded together) and
a key that coordinator chose (a hash of the tokens the sequence holds); the stage never reads
tokens. A stage started again with the same directory finds its disk entries; one whose
package, cut, engine or KV type changed looks under another namespace and finds none.

A file is written whole under a temporary name and renamed, with a header holding the
namespace, owner, key, positions, payload length and the payload's SHA-256. A file that does
not check out (torn, truncated, flipped) is deleted with a warning and counts as a miss: the
coordinator then prefills the sequence again, so a bad file is never served.

Every call but `stats` runs on the engine thread (save and restore are engine work); the lock
only keeps a Status read consistent.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from proto import meshpipe_pb2 as pb

log = logging.getLogger("meshpipe.kv_tier")

MAGIC = b"MESHKV01"
DEFAULT_CACHE_RAM = 2 << 30  # llama-server keeps 8 GiB of prompts; a stage holds a share of each
_LENGTH = struct.Struct("<I")


@dataclass(frozen=True)
class TierSizes:
    """The tier's bounds in bytes (`--cache-ram`, `--cache-disk`); none at all turns it off."""

    ram: int = DEFAULT_CACHE_RAM
    disk: int = 0

    def __bool__(self) -> bool:
        return self.ram > 0 or self.disk > 0


@dataclass(frozen=True)
class Kept:
    """A sequence's state as the engine serialised it, holding `positions` positions."""

    positions: int
    data: bytes


@dataclass
class TierStats:
    """What the tier did since the stage started, and what it holds now."""

    hits_ram: int = 0
    hits_disk: int = 0
    misses: int = 0
    saved: int = 0
    dropped: int = 0  # evicted past both bounds, or refused as too large
    corrupt: int = 0
    ram_bytes: int = 0
    disk_bytes: int = 0
    save_s: float = 0.0  # the engine's time reading lanes out, summed
    restore_s: float = 0.0  # reading entries (from disk too) and loading them into lanes, summed
    restored_positions: int = 0


@dataclass(frozen=True)
class Shelf:
    """Where one claim's entries go: its range's namespace and its coordinator."""

    namespace: str
    owner: str


Name = tuple[str, str, str]  # (namespace, owner, key)


@dataclass
class _OnDisk:
    path: Path
    size: int


@dataclass
class KvTier:
    ram: int  # bytes of host memory; 0: none
    disk: int  # bytes on disk; 0: none
    root: Path | None  # where the disk tier's namespaces live
    stats: TierStats = field(default_factory=TierStats)

    def __post_init__(self) -> None:
        self.in_ram: OrderedDict[Name, Kept] = OrderedDict()
        self.on_disk: OrderedDict[Name, _OnDisk] = OrderedDict()
        self.lock = threading.Lock()
        self.dir = self.root if self.disk > 0 else None
        self.scanned: set[tuple[str, str]] = set()  # shelves whose files on disk are known

    @property
    def enabled(self) -> bool:
        return self.ram > 0 or self.dir is not None

    def put(self, shelf: Shelf, key: str, kept: Kept) -> None:
        """Keep `kept` as `key` on the shelf, replacing an entry of that name."""
        name = (shelf.namespace, shelf.owner, key)
        with self.lock:
            self._scan(shelf)
            self._forget(name)
            self.in_ram[name] = kept
            self.stats.saved += 1
            self._spill()
            self._count()

    def take(self, shelf: Shelf, key: str, keep: bool = False) -> Kept | None:
        """The entry, removed from the tier (it goes back into a lane) unless `keep` (then it
        is only the most recently used), or None."""
        name = (shelf.namespace, shelf.owner, key)
        with self.lock:
            self._scan(shelf)
            kept = self.in_ram.get(name)
            if kept is not None:
                self.stats.hits_ram += 1
                self._taken(self.in_ram, name, keep)
            elif (disk := self.on_disk.get(name)) is not None:
                kept = self._read(name, disk)
                if kept is not None:
                    self.stats.hits_disk += 1
                    self._taken(self.on_disk, name, keep)
            if kept is None:
                self.stats.misses += 1
            self._count()
            return kept

    def _taken(self, store: OrderedDict[Name, Kept] | OrderedDict[Name, _OnDisk], name: Name, keep: bool) -> None:
        if keep:
            store.move_to_end(name)
        else:
            self._forget(name)

    def flush(self) -> None:
        """Write what host memory holds to disk, as the disk bound allows (a stop): a stage
        started again with the same directory finds it there."""
        with self.lock:
            if self.dir is None:
                return
            for name in list(self.in_ram):
                self._to_disk(name, self.in_ram.pop(name))
            self._count()

    def _spill(self) -> None:
        """Past the host-memory bound, the least recently used entries go to disk, or are dropped."""
        while self.in_ram and sum(len(k.data) for k in self.in_ram.values()) > self.ram:
            name, kept = self.in_ram.popitem(last=False)
            self._to_disk(name, kept)

    def _to_disk(self, name: Name, kept: Kept) -> None:
        namespace, owner, key = name
        if self.dir is None or len(kept.data) > self.disk:
            self.stats.dropped += 1
            return
        while self.on_disk and sum(d.size for d in self.on_disk.values()) + len(kept.data) > self.disk:
            _, old = self.on_disk.popitem(last=False)
            _unlink(old.path)
            self.stats.dropped += 1
        path = self.dir / _safe(namespace) / _safe(owner) / f"{_safe(key)}.kv"
        try:
            _write(path, _header(name, kept), kept.data)
        except OSError as exc:
            log.warning("kv tier: could not write %s (%s): the entry is dropped", path, exc)
            self.stats.dropped += 1
            return
        self.on_disk[name] = _OnDisk(path, len(kept.data))

    def _read(self, name: Name, disk: _OnDisk) -> Kept | None:
        """The entry in `disk`'s file; a file that does not check out is deleted (and forgotten)."""
        try:
            return _load(disk.path, name[0])
        except (OSError, ValueError) as exc:
            log.warning("kv tier: %s is not a whole entry (%s): deleted, and prefilled again", disk.path, exc)
            self.stats.corrupt += 1
        self._forget(name)
        return None

    def _forget(self, name: Name) -> None:
        self.in_ram.pop(name, None)
        if (old := self.on_disk.pop(name, None)) is not None:
            _unlink(old.path)

    def _scan(self, shelf: Shelf) -> None:
        """The shelf's entries a stage left on disk before, oldest first, on its first use here.
        Only the shelf's: stages of one machine may share the directory, each with its own."""
        if self.dir is None or (shelf.namespace, shelf.owner) in self.scanned:
            return
        self.scanned.add((shelf.namespace, shelf.owner))
        where = self.dir / _safe(shelf.namespace) / _safe(shelf.owner)
        files = []
        for path in where.glob("*.kv"):
            with contextlib.suppress(OSError):
                files.append((path.stat().st_mtime, path.stat().st_size, path))
        for path in where.glob("*.tmp"):  # a write cut short by a crash
            _unlink(path)
        found = OrderedDict(((shelf.namespace, shelf.owner, _unsafe(path.stem)), _OnDisk(path, size))
                            for _, size, path in sorted(files))
        self.on_disk = OrderedDict([*found.items(), *self.on_disk.items()])  # older than this run's
        while self.on_disk and sum(d.size for d in self.on_disk.values()) > self.disk:
            _unlink(self.on_disk.popitem(last=False)[1].path)
        self._count()

    def _count(self) -> None:
        self.stats.ram_bytes = sum(len(k.data) for k in self.in_ram.values())
        self.stats.disk_bytes = sum(d.size for d in self.on_disk.values())


def tier_stats(tier: KvTier) -> pb.KvTierStats | None:
    """The tier's figures for a Status reply (None: the stage keeps none)."""
    if not tier.enabled:
        return None
    with tier.lock:
        st = tier.stats
        return pb.KvTierStats(hits=st.hits_ram + st.hits_disk, hits_disk=st.hits_disk, misses=st.misses,
                              saved=st.saved, ram_bytes=st.ram_bytes, disk_bytes=st.disk_bytes,
                              restore_seconds=st.restore_s, save_seconds=st.save_s,
                              restored_positions=st.restored_positions, ram_limit=tier.ram,
                              disk_limit=tier.disk if tier.dir is not None else 0)


def timed_restore(tier: KvTier, started: float, positions: int) -> None:
    """Count a restore that began at `started` (perf_counter) and loaded `positions`."""
    with tier.lock:
        tier.stats.restore_s += time.perf_counter() - started
        tier.stats.restored_positions += positions


def _header(name: Name, kept: Kept) -> bytes:
    namespace, owner, key = name
    return json.dumps({"namespace": namespace, "owner": owner, "key": key, "positions": kept.positions,
                       "length": len(kept.data), "sha256": hashlib.sha256(kept.data).hexdigest()}).encode()


def _write(path: Path, header: bytes, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(MAGIC + _LENGTH.pack(len(header)) + header)
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _load(path: Path, namespace: str) -> Kept:
    with open(path, "rb") as f:
        if f.read(len(MAGIC)) != MAGIC:
            raise ValueError("not a meshpipe KV entry")
        (size,) = _LENGTH.unpack(f.read(_LENGTH.size))
        header = json.loads(f.read(size))
        data = f.read()
    if header.get("namespace") != namespace:
        raise ValueError("written for another package, range, engine or KV type")
    if len(data) != header["length"] or hashlib.sha256(data).hexdigest() != header["sha256"]:
        raise ValueError(f"its payload is {len(data)} bytes where {header['length']} were written, or differs")
    return Kept(int(header["positions"]), data)


def _unlink(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()


def _safe(name: str) -> str:
    """A name as one path component (hex of anything that is not plainly safe)."""
    if name and all(c.isalnum() or c in "-_." for c in name) and not name.startswith((".", "x")):
        return name
    return "x" + name.encode().hex()


def _unsafe(component: str) -> str:
    if component.startswith("x"):
        with contextlib.suppress(ValueError):
            return bytes.fromhex(component[1:]).decode()
    return component
