"""Get a stage's artifacts (local package, local cache, the coordinator, the Hub) and materialize.

Runs in the background after Prepare; Inventory reads `progress`. Only the manifest and the
artifacts of the stage's own range are fetched, each verified before it is installed. When the
package ref is a pinned `hf://` ref, the HF cache is tried before the coordinator, and the Hub
after it: peer transfer stays the default, so stages need no Hub access or token.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from packages.errors import PackageError
from packages.integrity import atomic_file, sha256_bytes, sha256_file
from packages.manifest import MANIFEST_NAME, Artifact, Manifest, load_manifest
from packages.materialize import materialize_stage
from packages.refs import HubRef, is_hub_ref, parse_hub_ref

log = logging.getLogger("meshpipe.stage")

# (path, offset) -> chunks of the file from that offset
Fetcher = Callable[[str, int], AsyncIterator[bytes | memoryview]]


@dataclass
class Progress:
    bytes_done: int = 0
    bytes_total: int = 0


@dataclass(frozen=True)
class PreparedStage:
    gguf: Path
    manifest: Manifest
    manifest_sha: str
    start: int
    end: int
    mtp: bool = False  # the GGUF carries the MTP layers: llama.cpp loads them with `load_mtp`


@dataclass(frozen=True)
class Wanted:
    """The range a stage is asked to prepare: layers [start, end) of a package (a directory or
    an hf:// ref) pinned by its manifest's sha256; with `mtp`, a final range with the package's
    MTP layers too (packages/materialize.py)."""

    package_ref: str
    manifest_sha: str
    start: int
    end: int
    mtp: bool = False


async def prepare_stage(wanted: Wanted, cache_dir: Path, fetch: Fetcher | None, progress: Progress,
                        placeholders: bool = True) -> PreparedStage:
    """`placeholders`: whether the stage GGUF may hold zeros for what the range never reads
    (packages/materialize.py): not for an MLX engine."""
    try:
        return await _prepare(wanted, cache_dir, fetch, progress, placeholders)
    finally:
        close = getattr(fetch, "aclose", None)  # an ArtifactFetcher's channel (stage/artifact_fetch.py)
        if close is not None:
            await close()


async def _prepare(wanted: Wanted, cache_dir: Path, fetch: Fetcher | None, progress: Progress,
                   placeholders: bool) -> PreparedStage:
    package_ref, start, end = wanted.package_ref, wanted.start, wanted.end
    hub_ref = parse_hub_ref(package_ref) if is_hub_ref(package_ref) else None
    package_dir, fetch = await _package_dir(wanted, cache_dir, fetch, hub_ref)
    manifest, sha = load_manifest(package_dir)
    needed = manifest.range_artifacts(start, end, wanted.mtp)
    progress.bytes_total = sum(a.artifact_bytes for a in needed)
    try:
        for art in needed:
            await _ensure_artifact(package_dir, art, fetch, progress)
    except _COORDINATOR_FAILURES as exc:
        if hub_ref is None or fetch is None:
            raise
        log.warning("the coordinator could not supply the artifacts (%s); fetching them from the Hub", exc)
        progress.bytes_done = 0
        package_dir = await _from_hub(hub_ref, wanted, progress)
    gguf = await asyncio.to_thread(
        materialize_stage, package_dir, manifest, sha, start, end, cache_dir, placeholders, wanted.mtp
    )
    return PreparedStage(gguf, manifest, sha, start, end, wanted.mtp)


# What a failed pull from the coordinator raises: it lacks the file, is unreachable, or sent bad bytes.
_COORDINATOR_FAILURES = (grpc.RpcError, PackageError, OSError)


async def _package_dir(
    wanted: Wanted, cache_dir: Path, fetch: Fetcher | None, hub_ref: HubRef | None,
) -> tuple[Path, Fetcher | None]:
    """The package directory to use, and the fetcher for what it lacks (None: it lacks nothing)."""
    package_ref, manifest_sha = wanted.package_ref, wanted.manifest_sha
    cached = cache_dir / "packages" / manifest_sha
    for here in (Path(package_ref), cached):  # a manifest read is file I/O: off the event loop
        if await asyncio.to_thread(_manifest_sha, here) == manifest_sha:
            return here, fetch
    if hub_ref is not None:
        # A `mesh package pull`ed range (or the coordinator's own download on this host) needs no transfer.
        from packages import hub  # only Hub refs need it; a stage's RSS stays smaller

        pulled = await asyncio.to_thread(hub.cached_range, hub_ref, wanted.start, wanted.end, manifest_sha,
                                         wanted.mtp)
        if pulled is not None:
            return pulled.root, None
    if fetch is not None:
        try:
            return await _fetch_manifest(cached, manifest_sha, fetch), fetch
        except _COORDINATOR_FAILURES as exc:
            if hub_ref is None:
                raise
            log.warning("the coordinator could not supply %s (%s); fetching from the Hub", MANIFEST_NAME, exc)
    if hub_ref is None:
        raise PackageError(f"package {package_ref} is not here and no artifact source was given")
    return await _from_hub(hub_ref, wanted, Progress()), None


async def _from_hub(hub_ref: HubRef, wanted: Wanted, progress: Progress) -> Path:
    """The range straight from the Hub into the HF cache, verified; a different manifest is refused."""
    def count(n: int) -> None:
        progress.bytes_done += n

    from packages import hub

    pkg = await asyncio.to_thread(hub.fetch_range, hub_ref, wanted.start, wanted.end, wanted.manifest_sha, False,
                                  count, wanted.mtp)
    return pkg.root


async def _fetch_manifest(cached: Path, manifest_sha: str, fetch: Fetcher) -> Path:
    data = b"".join([chunk async for chunk in fetch(MANIFEST_NAME, 0)])
    if sha256_bytes(data) != manifest_sha:
        raise PackageError("manifest from the coordinator does not match manifest_sha256")
    with atomic_file(cached / MANIFEST_NAME) as tmp:
        tmp.write_bytes(data)
    return cached


def _manifest_sha(package_dir: Path) -> str | None:
    path = package_dir / MANIFEST_NAME
    return sha256_file(path) if path.is_file() else None


async def _ensure_artifact(
    package_dir: Path, art: Artifact, fetch: Fetcher | None, progress: Progress
) -> None:
    dest = package_dir / art.path
    size_ok = dest.is_file() and dest.stat().st_size == art.artifact_bytes
    if size_ok and await asyncio.to_thread(sha256_file, dest) == art.sha256:
        progress.bytes_done += art.artifact_bytes
        return
    if fetch is None:
        raise PackageError(f"missing file: {art.path} and no artifact source to fetch it from")
    with atomic_file(dest) as tmp:  # renamed into place only once verified
        if await _receive(fetch, art, tmp, progress) != art.sha256:
            raise PackageError(f"{art.path}: transferred file failed verification")


async def _receive(fetch: Fetcher, art: Artifact, tmp: Path, progress: Progress) -> str:
    """Write `art` from `fetch` into `tmp`; return the sha256 of what came, hashed as it came.

    With more than one core, each chunk is hashed and written on a worker thread while the next
    arrives (both let go of the GIL), so the hash costs the transfer little time; on one core
    that handoff only adds thread switches (a pull measured ~15% slower), so it is done inline.
    """
    digest, size = hashlib.sha256(), 0
    with tmp.open("wb") as out:  # a chunk is a MiB: it goes to the file in one write, past the buffer
        def put(chunk: bytes | memoryview) -> None:
            digest.update(chunk)
            out.write(chunk)

        pending: asyncio.Future[None] | None = None
        async for chunk in fetch(art.path, 0):
            size += len(chunk)
            if size > art.artifact_bytes:
                raise PackageError(f"{art.path}: the source sent more bytes than the manifest says")
            if pending is not None:
                await pending
            if _THREADED:
                pending = asyncio.ensure_future(asyncio.to_thread(put, chunk))
            else:
                put(chunk)
            progress.bytes_done += len(chunk)
        if pending is not None:
            await pending
    if size != art.artifact_bytes:
        raise PackageError(f"{art.path}: the source sent {size} bytes, the manifest says {art.artifact_bytes}")
    return digest.hexdigest()


_THREADED = len(os.sched_getaffinity(0)) > 1 if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1) > 1
