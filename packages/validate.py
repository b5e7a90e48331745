"""`mesh package validate`: schema, sizes, digests and metadata agreement."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from packages.architectures import allowed_cuts
from packages.errors import PackageError
from packages.gguf_files import metadata_of, open_gguf
from packages.gguf_header import Scalar, read_scalars
from packages.integrity import verify_file
from packages.manifest import Manifest, load_manifest
from packages.speculative import declared, verify_draft


def validate_package(
    package_dir: Path, progress: Callable[[str], None] | None = None
) -> tuple[Manifest, str]:
    """Check everything a stage will rely on; raise PackageError naming the first bad item."""
    if not package_dir.is_dir():
        raise PackageError(f"not a package directory: {package_dir}")
    manifest, manifest_sha = load_manifest(package_dir)
    for i, art in enumerate(manifest.artifacts(), 1):
        verify_file(package_dir / art.path, art.artifact_bytes, art.sha256, art.path)
        if progress:
            progress(f"[{i}/{len(manifest.artifacts())}] ok {art.path}")
    check_metadata_agrees(package_dir, manifest)
    for strategy in declared(manifest.generation)[1].values():
        if strategy.in_package:
            verify_draft(package_dir, strategy)
    return manifest, manifest_sha


def check_metadata_agrees(package_dir: Path, manifest: Manifest) -> None:
    meta = package_dir / manifest.shared["metadata"].path
    # the keys are named by the manifest's architecture, so the header is read once; a file of
    # another architecture is caught by its own name before its numbers are looked at
    arch = manifest.architecture
    header = read_scalars(meta, ["general.architecture", f"{arch}.block_count", f"{arch}.embedding_length"])
    found = str(_required(header, "general.architecture"))
    if found != arch:
        raise PackageError(
            f"field 'architecture' is {manifest.architecture} but metadata says {found}"
        )
    blocks = int(_required(header, f"{arch}.block_count"))
    if blocks != manifest.layer_count:
        raise PackageError(f"field 'layer_count' is {manifest.layer_count} but metadata says {blocks}")
    width = int(_required(header, f"{arch}.embedding_length"))
    if width != manifest.activation_width:
        raise PackageError(
            f"field 'activation_width' is {manifest.activation_width} but metadata says {width}"
        )
    values = {kv.key: kv.value for kv in metadata_of(open_gguf(meta))}
    unsafe = sorted(set(manifest.allowed_cuts) - set(allowed_cuts(arch, blocks, values)))
    if unsafe:
        raise PackageError(f"field 'allowed_cuts' lists {unsafe[0]}, which is unsafe for {arch}")


def _required(header: dict[str, Scalar], key: str) -> Scalar:
    value = header.get(key)
    if value is None:
        raise PackageError(f"GGUF metadata lacks '{key}'")
    return value
