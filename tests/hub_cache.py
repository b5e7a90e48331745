"""Lay files out in a Hugging Face cache directory exactly as huggingface_hub does after a download.

    <HF_HUB_CACHE>/models--org--name/
        blobs/<etag>                        the bytes; etag = LFS sha256, or git blob sha1 for small files
        snapshots/<commit>/<path> -> ../../blobs/<etag>   (relative symlinks)
        refs/main                           the commit `main` pointed at when last seen

No Hub is reachable from CI, so tests build this layout and run the real resolution code with
HF_HUB_OFFLINE=1 against it.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

import pytest
from huggingface_hub import constants

from packages.manifest import MANIFEST_NAME, load_manifest

COMMIT = "c0ffee" + "0" * 28 + "123456"
OTHER_COMMIT = "feed" + "1" * 36


def etag(data: bytes, path: str) -> str:
    if path.endswith(".gguf"):  # the Hub stores these with LFS: the etag is the sha256
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def repo_dir(hub_cache: Path, repo_id: str) -> Path:
    return hub_cache / ("models--" + repo_id.replace("/", "--"))


def add_files(hub_cache: Path, repo_id: str, commit: str, files: dict[str, bytes | Path],
              branch: str | None = "main") -> Path:
    """Put `files` (repo path -> bytes or a file to copy) into the cache at `commit`; its snapshot dir."""
    repo = repo_dir(hub_cache, repo_id)
    snapshot = repo / "snapshots" / commit
    for rel, content in files.items():
        data = content.read_bytes() if isinstance(content, Path) else content
        blob = repo / "blobs" / etag(data, rel)
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        pointer = snapshot / rel
        pointer.parent.mkdir(parents=True, exist_ok=True)
        pointer.unlink(missing_ok=True)
        os.symlink(os.path.relpath(blob, pointer.parent), pointer)
    if branch is not None:
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / branch).write_text(commit)  # no trailing newline, like huggingface_hub
    return snapshot


def package_files(package_dir: Path, layers: Iterable[int] | None = None) -> dict[str, bytes | Path]:
    """The manifest, the shared artifacts and the chosen layers (default: all) of a package."""
    manifest, _ = load_manifest(package_dir)
    chosen = manifest.layers if layers is None else [manifest.layers[i] for i in layers]
    arts = [*manifest.shared.values(), *chosen]
    return {MANIFEST_NAME: package_dir / MANIFEST_NAME, **{a.path: package_dir / a.path for a in arts}}


def cache_package(hub_cache: Path, repo_id: str, package_dir: Path, commit: str = COMMIT,
                  layers: Iterable[int] | None = None) -> Path:
    return add_files(hub_cache, repo_id, commit, package_files(package_dir, layers))


def use_hf_home(hf_home: Path, monkeypatch: pytest.MonkeyPatch, offline: bool = True) -> Path:
    """Point this process's huggingface_hub at `hf_home` (it reads its env once, at import); the hub cache."""
    hub_cache = hf_home / "hub"
    hub_cache.mkdir(parents=True, exist_ok=True)
    for key, value in {"HF_HOME": str(hf_home), "HF_HUB_CACHE": str(hub_cache),
                       "HF_HUB_OFFLINE": "1" if offline else "0"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(constants, "HF_HOME", str(hf_home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    return hub_cache
