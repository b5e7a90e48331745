"""Package + [start, end) -> one stage GGUF that stock llama.cpp loads (DESIGN.md §3 step 1).

Layers are renumbered from 0 and the metadata is the range's (packages/stage_metadata.py). The
embedding and output tensors always ride along, because llama.cpp's loader requires them;
stages that never touch them only pay disk, since the file is memory-mapped.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from packages.architectures import RULES, check_range
from packages.gguf_files import TensorCopy, metadata_of, open_gguf, write_gguf
from packages.integrity import atomic_file, sha256_file, verify_file
from packages.manifest import Artifact, Manifest
from packages.stage_metadata import stage_metadata
from packages.writer import block_index


def stage_path(cache_dir: Path, manifest_sha: str, start: int, end: int, placeholders: bool = True) -> Path:
    kept = "" if placeholders else "-whole"
    return cache_dir / "stages" / manifest_sha[:16] / f"layers-{start:05d}-{end:05d}{kept}.gguf"


def materialize_stage(
    package_dir: Path, manifest: Manifest, manifest_sha: str, start: int, end: int, cache_dir: Path,
    placeholders: bool = True,
) -> Path:
    """Return a verified stage GGUF for [start, end), building it only on a cache miss.
    `placeholders`: zeros for the tensors the range never reads (llama.cpp); MLX's `mx.load`
    cannot read IQ1_S, and frees what a range skips anyway, so it gets them whole."""
    check_range(start, end, manifest.layer_count, manifest.allowed_cuts)
    dest = stage_path(cache_dir, manifest_sha, start, end, placeholders)
    digest_file = dest.with_suffix(".sha256")
    if dest.is_file() and digest_file.is_file() and sha256_file(dest) == digest_file.read_text().strip():
        return dest
    needed = [*manifest.shared.values(), *manifest.layers[start:end]]
    for art in needed:
        verify_file(package_dir / art.path, art.artifact_bytes, art.sha256, art.path)
    with atomic_file(dest) as tmp:
        digest = _write_stage(package_dir, manifest, start, end, tmp, placeholders)
    with atomic_file(digest_file) as tmp_digest:
        tmp_digest.write_text(digest + "\n")
    return dest


def _write_stage(package_dir: Path, manifest: Manifest, start: int, end: int, dest: Path,
                 placeholders: bool = True) -> str:
    """Write the stage GGUF to `dest`; return its sha256, taken as it was written."""
    arch = manifest.architecture
    meta = open_gguf(package_dir / manifest.shared["metadata"].path)
    metadata = stage_metadata(arch, metadata_of(meta), start, end)
    # The loader requires the token embeddings and an untied head on every stage, though only
    # the first reads the one (and the final too, when the head is tied to them) and only the
    # final the other: elsewhere they are zeros of a small type.
    shared = [c for art in ("embeddings", "output") for c in _copies(package_dir, manifest.shared[art], 0)]
    final, untied = end == manifest.layer_count, any(c.name == "output.weight" for c in shared)
    unused = {n for n, needed in (("token_embd.weight", start == 0 or (final and not untied)),
                                  ("output.weight", final)) if not needed and placeholders}
    tensors = [_placeholder(c) if c.name in unused else c for c in shared]
    rule = RULES.get(arch)
    if rule is not None and start > 0:
        tensors = [_zeros(c) if c.name in rule.input_tensors else c for c in tensors]
    for layer in manifest.layers[start:end]:
        tensors += _copies(package_dir, layer, start)
    return write_gguf(dest, arch, metadata, tensors).sha256


# Smallest first; never repacked by ggml's CPU backend, so a placeholder stays its size in memory.
_PLACEHOLDER_TYPES = (GGMLQuantizationType.IQ1_S, GGMLQuantizationType.Q4_1)


def _placeholder(copy: TensorCopy) -> TensorCopy:
    """`copy` as zeros of the smallest type its rows fit (the tensor itself if none is smaller):
    a stage that never reads it holds about a sixth of its Q4_0 bytes instead of all of them."""
    t = copy.source
    width, rows = int(t.shape[0]), int(t.n_elements) // int(t.shape[0])
    for kind in _PLACEHOLDER_TYPES:
        block, size = GGML_QUANT_SIZES[kind]
        if width % block == 0 and rows * width // block * size < int(t.n_bytes):
            data = np.zeros((rows, width // block * size), dtype=np.uint8)
            zeros = t._replace(tensor_type=kind, n_bytes=data.nbytes, data_offset=0, data=data)
            return TensorCopy(copy.name, zeros)
    return copy


def _zeros(copy: TensorCopy) -> TensorCopy:
    """`copy` as zeros, which every ggml type decodes from zero bytes: a placeholder where one is
    smaller, else zero bytes of its own type."""
    small = _placeholder(copy)
    if small is not copy:
        return small
    t = copy.source
    return TensorCopy(copy.name, t._replace(data_offset=0, data=np.zeros_like(t.data)))


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
