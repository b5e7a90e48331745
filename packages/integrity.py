"""Hashing and atomic installation of files and directories."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from packages.errors import PackageError

_CHUNK = 4 * 1024 * 1024


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def verify_file(path: Path, size: int, sha256: str, label: str) -> None:
    """Raise PackageError naming `label` unless `path` has exactly this size and digest."""
    if not path.is_file():
        raise PackageError(f"missing file: {label} ({path})")
    actual_size = path.stat().st_size
    if actual_size != size:
        raise PackageError(f"size mismatch in {label}: expected {size} bytes, found {actual_size}")
    if sha256_file(path) != sha256:
        raise PackageError(f"sha256 mismatch in {label}: the file was modified or corrupted")


@contextlib.contextmanager
def atomic_file(dest: Path) -> Iterator[Path]:
    """Yield a temp path beside `dest`; rename it over `dest` only if the block succeeds."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".partial", dir=dest.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        os.replace(tmp_path, dest)
    finally:
        tmp_path.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_dir(dest: Path) -> Iterator[Path]:
    """Yield a temp directory beside `dest`; it becomes `dest` only if the block succeeds."""
    if dest.exists() and any(dest.iterdir()):
        raise PackageError(f"output directory is not empty: {dest}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".partial", dir=dest.parent))
    try:
        yield tmp
        tmp.chmod(0o755)  # mkdtemp makes it 0700; a package is meant to be shared
        if dest.exists():
            dest.rmdir()
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
