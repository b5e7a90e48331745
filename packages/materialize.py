"""Package + [start, end) -> one stage GGUF that stock llama.cpp loads (DESIGN.md §3 step 1).

Layers are renumbered from 0 and the metadata is the range's (packages/stage_metadata.py). The
embedding and output tensors always ride along, because llama.cpp's loader requires them;
stages that never touch them only pay disk, since the file is memory-mapped.
A final stage built with `mtp` also carries the package's MTP (nextn) layers after its own, which
llama.cpp loads only with `load_mtp` and runs only in an MTP context.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, ReaderTensor

from packages.architectures import MTP_FROM_LAYER_0, RULES, check_range
from packages.gguf_files import KeyValue, TensorCopy, metadata_of, open_gguf, write_gguf
from packages.integrity import atomic_file, sha256_file, verify_file
from packages.manifest import Artifact, Manifest
from packages.stage_metadata import stage_metadata, with_mtp
from packages.writer import block_index

EMBEDDINGS = "token_embd.weight"


def stage_path(cache_dir: Path, manifest_sha: str, start: int, end: int, placeholders: bool = True,
               mtp: bool = False) -> Path:
    kept = ("" if placeholders else "-whole") + ("-mtp" if mtp else "")
    return cache_dir / "stages" / manifest_sha[:16] / f"layers-{start:05d}-{end:05d}{kept}.gguf"


def materialize_stage(
    package_dir: Path, manifest: Manifest, manifest_sha: str, start: int, end: int, cache_dir: Path,
    placeholders: bool = True, mtp: bool = False,
) -> Path:
    """Return a verified stage GGUF for [start, end), building it only on a cache miss.
    `placeholders`: zeros for the tensors the range never reads (llama.cpp); MLX's `mx.load`
    cannot read IQ1_S, and frees what a range skips anyway, so it gets them whole.
    `mtp`: a final range carries the package's MTP layers too (PackageError for any other range,
    or a package without them)."""
    check_range(start, end, manifest.layer_count, manifest.allowed_cuts)
    needed = manifest.range_artifacts(start, end, mtp)
    dest = stage_path(cache_dir, manifest_sha, start, end, placeholders, mtp)
    digest_file = dest.with_suffix(".sha256")
    if dest.is_file() and digest_file.is_file() and sha256_file(dest) == digest_file.read_text().strip():
        return dest
    for art in needed:
        verify_file(package_dir / art.path, art.artifact_bytes, art.sha256, art.path)
    with atomic_file(dest) as tmp:
        digest = _write_stage(package_dir, manifest, (start, end), tmp, placeholders, mtp)
    with atomic_file(digest_file) as tmp_digest:
        tmp_digest.write_text(digest + "\n")
    return dest


def _write_stage(package_dir: Path, manifest: Manifest, span: tuple[int, int], dest: Path,
                 placeholders: bool, mtp: bool) -> str:
    """Write the stage GGUF of layers `span` to `dest`; return its sha256, taken as it was written."""
    arch, (start, end) = manifest.architecture, span
    meta = open_gguf(package_dir / manifest.shared["metadata"].path)
    metadata = stage_metadata(arch, metadata_of(meta), start, end)
    # The loader requires the token embeddings and an untied head on every stage, though only
    # the first reads the one (and the final too, when the head is tied to them, or when it runs
    # the MTP layers, whose graph embeds the drafted token) and only the final the other:
    # elsewhere they are zeros of a small type.
    shared = [c for art in ("embeddings", "output") for c in _copies(package_dir, manifest.shared[art], 0)]
    final, untied = end == manifest.layer_count, any(c.name == "output.weight" for c in shared)
    unused = {n for n, needed in ((EMBEDDINGS, start == 0 or mtp or (final and not untied)),
                                  ("output.weight", final)) if not needed and placeholders}
    tensors = [_placeholder(c) if c.name in unused else c for c in shared]
    rule = RULES.get(arch)
    if rule is not None and start > 0:
        # what the main graph must not add twice, the MTP graph may still read (the embeddings)
        zeroed = set(rule.input_tensors) - ({EMBEDDINGS} if mtp else set())
        tensors = [_zeros(c) if c.name in zeroed else c for c in tensors]
    for layer in manifest.layers[start:end]:
        tensors += _copies(package_dir, layer, start)
    if mtp:
        metadata, extra = _mtp_part(package_dir, manifest, metadata, start)
        tensors += extra
    return write_gguf(dest, arch, metadata, tensors).sha256


def _mtp_part(package_dir: Path, manifest: Manifest, metadata: list[KeyValue],
              start: int) -> tuple[list[KeyValue], list[TensorCopy]]:
    """(the stage's metadata with its MTP layers counted, their tensors renumbered to follow the
    stage's own layers): llama.cpp runs the nextn block at n_layer() = block_count - nextn."""
    entries, tensors = [], []
    for art in manifest.mtp_layers:
        entries.append(metadata_of(open_gguf(package_dir / art.path)))
        tensors += _copies(package_dir, art, start)
    return with_mtp(manifest.architecture, metadata, entries), tensors


# Smallest first; never repacked by ggml's CPU backend, so a placeholder stays its size in memory.
_PLACEHOLDER_TYPES = (GGMLQuantizationType.IQ1_S, GGMLQuantizationType.Q4_1)


def placeholder_bytes(tensor: ReaderTensor) -> int:
    """What a stage that never reads `tensor` holds of it (`_placeholder`)."""
    kind = _placeholder_type(tensor)
    return int(tensor.n_bytes) if kind is None else _rows(tensor) * _row_bytes(tensor, kind)


def _placeholder_type(t: ReaderTensor) -> GGMLQuantizationType | None:
    """The smallest type `t`'s rows fit that is smaller than `t`; None if none is."""
    for kind in _PLACEHOLDER_TYPES:
        if int(t.shape[0]) % GGML_QUANT_SIZES[kind][0] == 0 and _rows(t) * _row_bytes(t, kind) < int(t.n_bytes):
            return kind
    return None


def _rows(t: ReaderTensor) -> int:
    return int(t.n_elements) // int(t.shape[0])


def _row_bytes(t: ReaderTensor, kind: GGMLQuantizationType) -> int:
    block, size = GGML_QUANT_SIZES[kind]
    return int(t.shape[0]) // block * size


def _placeholder(copy: TensorCopy) -> TensorCopy:
    """`copy` as zeros of the smallest type its rows fit (the tensor itself if none is smaller):
    a stage that never reads it holds about a sixth of its Q4_0 bytes instead of all of them."""
    t = copy.source
    kind = _placeholder_type(t)
    if kind is None:
        return copy
    data = np.zeros((_rows(t), _row_bytes(t, kind)), dtype=np.uint8)
    return TensorCopy(copy.name, t._replace(tensor_type=kind, n_bytes=data.nbytes, data_offset=0, data=data))


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


@dataclass(frozen=True)
class MtpCost:
    """What `mtp` adds to a final stage, in tensor bytes: its nextn layers, and the token
    embeddings where the stage would otherwise hold a placeholder of them."""

    layers: int
    nextn_bytes: int
    embedding_bytes: int

    @property
    def total(self) -> int:
        return self.nextn_bytes + self.embedding_bytes


def mtp_cost(package_dir: Path, manifest: Manifest, start: int | None = None) -> MtpCost | None:
    """None for a package without MTP layers. `start`: the final stage's first layer (None: one
    after others, or from layer 0 where the architecture runs MTP there only, MTP_FROM_LAYER_0);
    a stage from layer 0 holds its embeddings anyway, as one with a tied head."""
    if not manifest.mtp_layers:
        return None
    nextn = sum(art.tensor_bytes for art in manifest.mtp_layers)
    first = start if start is not None else 0 if manifest.architecture in MTP_FROM_LAYER_0 else 1
    if first == 0 or not any(t.name == "output.weight" for t in _tensors(package_dir, manifest.shared["output"])):
        return MtpCost(len(manifest.mtp_layers), nextn, 0)
    embeddings = next(t for t in _tensors(package_dir, manifest.shared["embeddings"]) if t.name == EMBEDDINGS)
    return MtpCost(len(manifest.mtp_layers), nextn, int(embeddings.n_bytes) - placeholder_bytes(embeddings))


def _tensors(package_dir: Path, art: Artifact) -> list[ReaderTensor]:
    return list(open_gguf(package_dir / art.path).tensors)
