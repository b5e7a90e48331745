"""`mesh package write`: split a GGUF into a layer package (DESIGN.md §5)."""

from __future__ import annotations

import re
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gguf import GGMLQuantizationType, GGUFReader, LlamaFileType, ReaderTensor

from packages.architectures import allowed_cuts, describe_rule, require_servable
from packages.errors import PackageError
from packages.gguf_files import (
    KeyValue,
    SourceDigest,
    TensorCopy,
    architecture_of,
    field_value,
    metadata_of,
    open_gguf,
    tensor_bytes,
    write_gguf,
)
from packages.integrity import atomic_dir
from packages.manifest import MANIFEST_NAME, Artifact, LayerArtifact, Manifest, SourceModel
from packages.speculative import DraftStrategy, WindowPolicy, block_for, bundle_draft, declared, ref_in_package
from packages.stage_metadata import nextn_entries, package_metadata

_BLOCK = re.compile(r"^blk\.(\d+)\.")
Progress = Callable[[str], None]


def block_index(tensor_name: str) -> int | None:
    match = _BLOCK.match(tensor_name)
    return int(match.group(1)) if match else None


def layer_path(index: int) -> str:
    return f"layers/layer-{index:05d}.gguf"


def mtp_path(nth: int) -> str:
    """The `nth` MTP (nextn) layer's artifact; its tensors keep the source's names."""
    return f"layers/mtp-{nth:05d}.gguf"


def write_package(
    src: Path, out_dir: Path, model_id: str | None = None, progress: Progress | None = None,
    draft: str | None = None, window: WindowPolicy | None = None, created_at: int | None = None,
) -> Manifest:
    """Split `src` into `out_dir`; on any failure `out_dir` is left as it was.

    `created_at` (default: now) is the manifest's time: a fixed one makes the same source
    give the same manifest, and so the same manifest sha256, on every machine.

    `draft` declares a draft-model strategy: a local GGUF is copied into the package,
    an `hf://` or `org/repo:QUANT` ref is recorded as given, with `window` (default: adaptive).
    """
    say = progress or _stderr_progress
    if draft and ref_in_package(draft) and not Path(draft).expanduser().is_file():
        raise PackageError(f"draft model not found: {draft}")  # before minutes of splitting
    reader = open_gguf(src)
    arch = architecture_of(reader)
    require_servable(arch)
    source_metadata = metadata_of(reader)
    metadata, layer_count = package_metadata(arch, source_metadata)
    values = {kv.key: kv.value for kv in metadata}
    cuts = allowed_cuts(arch, layer_count, values)
    say(describe_rule(arch, values))
    by_layer = _group_tensors(reader, int(field_value(reader, f"{arch}.block_count")), layer_count)
    nextn = nextn_entries(arch, source_metadata) if _keeps_mtp(by_layer, layer_count, say) else []
    source = SourceDigest(reader.data)  # hashed from the bytes copied out, as they are copied
    with atomic_dir(out_dir) as tmp:
        shared, layers, mtp = _write_artifacts(metadata, arch, tmp, by_layer, nextn, say, source)
        source_sha = source.hexdigest()
        manifest = Manifest(
            model_id=model_id or src.stem,
            source_model=SourceModel(
                path=src.name, repo=None, revision=None, sha256=source_sha, files=(src.name,)
            ),
            architecture=arch,
            layer_count=layer_count,
            activation_width=int(field_value(reader, f"{arch}.embedding_length")),
            quantization=quantization_of(reader),
            allowed_cuts=tuple(cuts),
            shared=shared,
            layers=tuple(layers),
            mtp_layers=tuple(mtp),
            generation=_generation(draft, window or WindowPolicy(), tmp, model_id or src.stem),
            created_at_unix_secs=int(time.time()) if created_at is None else created_at,
        )
        (tmp / MANIFEST_NAME).write_bytes(manifest.to_json())
    say(f"wrote {out_dir}")
    return manifest


def _generation(draft: str | None, window: WindowPolicy, package_dir: Path, name: str) -> dict[str, Any]:
    if draft is None:
        return {}
    if ref_in_package(draft):
        local = Path(draft).expanduser()
        if not local.is_file():
            raise PackageError(f"draft model not found: {draft}")
        strategy = bundle_draft(local, package_dir, f"{name}-draft", window)
    else:
        strategy = DraftStrategy(name=f"{name}-draft", type="draft-model", draft_model=draft, window=window)
    declared(block_for(strategy))  # the same checks `validate` runs, on the JSON as written
    return block_for(strategy)


def _group_tensors(reader: GGUFReader, blocks: int, layer_count: int) -> dict[int | None, list[ReaderTensor]]:
    """Tensors by layer (None: global), the nextn layers' (from `layer_count` on) included."""
    groups: dict[int | None, list[ReaderTensor]] = {i: [] for i in range(blocks)}
    groups[None] = []
    for tensor in reader.tensors:
        index = block_index(tensor.name)
        if index is not None and index >= blocks:
            raise PackageError(f"tensor {tensor.name} lies beyond block_count {blocks}")
        groups[index].append(tensor)
    empty = [i for i in range(layer_count) if not groups[i]]
    if empty:
        raise PackageError(f"GGUF has no tensors for layer {empty[0]}")
    return groups


def _keeps_mtp(by_layer: dict[int | None, list[ReaderTensor]], layer_count: int, say: Progress) -> bool:
    """Whether the package keeps MTP layers; if the GGUF lacks some of their tensors, their groups
    are dropped from `by_layer`: a GGUF converted without its MTP tensors still declares its
    nextn layers, and llama.cpp loads such a trunk alone (glm4-moe.cpp's `trunk_only`)."""
    nextn = [i for i in by_layer if i is not None and i >= layer_count]
    if all(by_layer[i] for i in nextn):
        return bool(nextn)
    for i in nextn:
        del by_layer[i]
    say(f"the GGUF declares {len(nextn)} nextn layer(s) without all their tensors: no MTP layers packaged")
    return False


def _write_artifacts(
    metadata: list[KeyValue], arch: str, root: Path, by_layer: dict[int | None, list[ReaderTensor]],
    nextn: list[list[KeyValue]], say: Progress, source: SourceDigest,
) -> tuple[dict[str, Artifact], list[LayerArtifact], list[LayerArtifact]]:
    """(shared, layers, MTP layers): every artifact, written in the order of their tensors in
    the source, so that `source` hashes the file from the bytes being copied, in one read of it."""
    main = len(by_layer) - 1 - len(nextn)
    paths = {i: layer_path(i) if i < main else mtp_path(i - main) for i in by_layer if i is not None}
    jobs = [(rel, meta, tensors) for rel, meta, tensors in _shared_parts(metadata, by_layer[None])]
    jobs += [(paths[i], [] if i < main else nextn[i - main], by_layer[i]) for i in sorted(paths)]
    jobs.sort(key=lambda job: min((int(t.data_offset) for t in job[2]), default=-1))
    written = {}
    for rel, meta, tensors in jobs:
        written[rel] = _write_artifact(root, rel, arch, meta, tensors, source)
        if rel.startswith("layers/"):
            say(f"[{sum(r.startswith('layers/') for r in written)}/{len(jobs) - 3}] {rel}")
    shared = {name: written[f"shared/{name}.gguf"] for name in ("metadata", "embeddings", "output")}
    layers = [LayerArtifact(**vars(written[paths[i]]), layer_index=i) for i in sorted(paths)]
    return shared, layers[:main], layers[main:]


def _shared_parts(
    metadata: list[KeyValue], tensors: list[ReaderTensor]
) -> list[tuple[str, list[KeyValue], list[ReaderTensor]]]:
    embeddings = [t for t in tensors if t.name == "token_embd.weight"]
    if not embeddings:
        raise PackageError("GGUF has no token_embd.weight tensor")
    # Everything global that is not the embedding (output_norm, output, rope_freqs, ...).
    output = [t for t in tensors if t.name != "token_embd.weight"]
    return [("shared/metadata.gguf", metadata, []), ("shared/embeddings.gguf", [], embeddings),
            ("shared/output.gguf", [], output)]


def _write_artifact(
    root: Path, rel: str, arch: str, metadata: list[KeyValue], tensors: list[ReaderTensor],
    source: SourceDigest,
) -> Artifact:
    dest = root / rel
    dest.parent.mkdir(parents=True, exist_ok=True)
    written = write_gguf(dest, arch, metadata, [TensorCopy(t.name, t) for t in tensors], source)
    return Artifact(
        path=rel,
        sha256=written.sha256,
        artifact_bytes=written.size,
        tensor_count=len(tensors),
        tensor_bytes=tensor_bytes(tensors),
    )


def quantization_of(reader: GGUFReader) -> str:
    """The file's declared quantization, else the commonest tensor type in its layers."""
    declared = reader.fields.get("general.file_type")
    if declared is not None:
        try:
            return LlamaFileType(int(declared.contents())).name.removeprefix("MOSTLY_")
        except ValueError:
            pass
    kinds = Counter(t.tensor_type for t in reader.tensors if block_index(t.name) is not None)
    return GGMLQuantizationType(kinds.most_common(1)[0][0]).name if kinds else "unknown"


def _stderr_progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
