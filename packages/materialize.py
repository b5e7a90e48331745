"""Package + [start, end) -> one stage GGUF that stock llama.cpp loads (DESIGN.md §3 step 1).

Layers are renumbered from 0 and the metadata is the range's (packages/stage_metadata.py). The
embedding and output tensors always ride along, because llama.cpp's loader requires them;
stages that never touch them only pay disk, since the file is memory-mapped.
"""

from __future__ import annotations

from pathlib import Path

from packages.architectures import check_range
from packages.gguf_files import TensorCopy, metadata_of, open_gguf, write_gguf
from packages.integrity import atomic_file, sha256_file, verify_file
from packages.manifest import Artifact, Manifest
from packages.stage_metadata import stage_metadata
from packages.writer import block_index


def stage_path(cache_dir: Path, manifest_sha: str, start: int, end: int) -> Path:
    return cache_dir / "stages" / manifest_sha[:16] / f"layers-{start:05d}-{end:05d}.gguf"


def materialize_stage(
    package_dir: Path, manifest: Manifest, manifest_sha: str, start: int, end: int, cache_dir: Path
) -> Path:
    """Return a verified stage GGUF for [start, end), building it only on a cache miss."""
    check_range(start, end, manifest.layer_count, manifest.allowed_cuts)
    dest = stage_path(cache_dir, manifest_sha, start, end)
    digest_file = dest.with_suffix(".sha256")
    if dest.is_file() and digest_file.is_file() and sha256_file(dest) == digest_file.read_text().strip():
        return dest
    needed = [*manifest.shared.values(), *manifest.layers[start:end]]
    for art in needed:
        verify_file(package_dir / art.path, art.artifact_bytes, art.sha256, art.path)
    with atomic_file(dest) as tmp:
        digest = _write_stage(package_dir, manifest, start, end, tmp)
    with atomic_file(digest_file) as tmp_digest:
        tmp_digest.write_text(digest + "\n")
    return dest


def _write_stage(package_dir: Path, manifest: Manifest, start: int, end: int, dest: Path) -> str:
    """Write the stage GGUF to `dest`; return its sha256, taken as it was written."""
    arch = manifest.architecture
    meta = open_gguf(package_dir / manifest.shared["metadata"].path)
    metadata = stage_metadata(arch, metadata_of(meta), start, end)
    tensors = [
        *_copies(package_dir, manifest.shared["embeddings"], 0),
        *_copies(package_dir, manifest.shared["output"], 0),
    ]
    for layer in manifest.layers[start:end]:
        tensors += _copies(package_dir, layer, start)
    return write_gguf(dest, arch, metadata, tensors).sha256


def _copies(package_dir: Path, art: Artifact, shift: int) -> list[TensorCopy]:
    reader = open_gguf(package_dir / art.path)
    out = []
    for tensor in reader.tensors:
        index = block_index(tensor.name)
        if index is None:
            out.append(TensorCopy(tensor.name, tensor))
        else:
            suffix = tensor.name.split(".", 2)[2]
            out.append(TensorCopy(f"blk.{index - shift}.{suffix}", tensor))
    return out
