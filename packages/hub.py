"""Resolve layer packages and drafts on the Hugging Face Hub, through huggingface_hub's own cache.

Files are fetched one by one with `hf_hub_download`, so a stage pulls model-package.json plus
its own range and nothing else, with huggingface_hub's progress bars, resume and locking, and
HF_HOME, HF_HUB_CACHE, HF_HUB_OFFLINE and HF_TOKEN mean what they mean everywhere else.
The cache is not trusted: every artifact is checked against the manifest's sha256 each time it
is used, cache hits included.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import HfApi, constants, hf_hub_download
from huggingface_hub.utils import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from packages.architectures import check_range
from packages.errors import PackageError
from packages.integrity import sha256_bytes, verify_file
from packages.manifest import MANIFEST_NAME, Artifact, Manifest, load_manifest
from packages.refs import HubRef, QuantRef, parse_draft_ref
from packages.speculative import DraftStrategy, declared

_COMMIT = re.compile(r"[0-9a-f]{40}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_LOGIN = "log in with `hf auth login` or set HF_TOKEN"
OnBytes = Callable[[int], None]


def transport_errors() -> tuple[type[BaseException], ...]:
    """The HTTP client's own network errors, which huggingface_hub lets through unwrapped."""
    found: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for module in ("httpx2", "httpx"):  # huggingface_hub 2.x uses httpx2, 1.x httpx; requests' are OSErrors
        try:
            found.append(importlib.import_module(module).TransportError)
        except (ImportError, AttributeError):
            continue
    return tuple(found)


# Everything huggingface_hub raises when a file cannot be had, network errors included.
HUB_ERRORS: tuple[type[BaseException], ...] = (
    HfHubHTTPError, EntryNotFoundError, OfflineModeIsEnabled, *transport_errors())


@dataclass(frozen=True)
class HubPackage:
    """A package on the Hub, pinned to one commit, with its manifest read from the cache."""

    ref: HubRef  # always pinned: every stage that uses it sees the same bytes
    root: Path  # the commit's snapshot directory in the HF cache: a package directory
    manifest: Manifest
    manifest_sha: str


def open_package(ref: HubRef, local_only: bool = False) -> HubPackage:
    """Fetch model-package.json and pin `ref` to the commit it came from."""
    pointer = download(ref, MANIFEST_NAME, local_only)
    root = pointer.parent  # snapshots/<commit>/model-package.json
    if not _COMMIT.fullmatch(root.name):
        raise PackageError(f"{pointer} is not inside a Hugging Face cache snapshot")
    _check_blob_name(pointer, f"{MANIFEST_NAME} of {ref}")
    manifest, sha = load_manifest(root)
    return HubPackage(ref.at(root.name), root, manifest, sha)


def fetch_range(ref: HubRef, start: int, end: int, expect_sha: str | None = None,
                local_only: bool = False, on_bytes: OnBytes | None = None, mtp: bool = False) -> HubPackage:
    """The manifest, the shared artifacts and layers [start, end), all verified; with `mtp`, the
    MTP layers too (a final range of a package that has them, else PackageError)."""
    pkg = open_package(ref, local_only)
    if expect_sha is not None and pkg.manifest_sha != expect_sha:
        raise PackageError(f"{MANIFEST_NAME} of {pkg.ref} has sha256 {pkg.manifest_sha[:12]}…, not the "
                           f"{expect_sha[:12]}… this stage was asked to prepare: refusing it")
    m = pkg.manifest
    check_range(start, end, m.layer_count, m.allowed_cuts)
    _fetch_all(pkg, m.range_artifacts(start, end, mtp), local_only, on_bytes)
    return pkg


def fetch_package(ref: HubRef, local_only: bool = False) -> HubPackage:
    """Every artifact of the package, and its bundled drafts: what a coordinator (stage 0) needs."""
    pkg = open_package(ref, local_only)
    _fetch_all(pkg, pkg.manifest.artifacts(), local_only, None)
    _prefetch_drafts(pkg, local_only)
    return pkg


def _prefetch_drafts(pkg: HubPackage, local_only: bool) -> None:
    # A draft that cannot be had only costs speculation (DESIGN.md §5): the coordinator verifies it
    # when it loads it and says so loudly there, so a failure here is not an error.
    try:
        strategies = declared(pkg.manifest.generation)[1].values()
    except PackageError:
        return
    for path in {s.draft_model for s in strategies if isinstance(s, DraftStrategy) and s.in_package}:
        with contextlib.suppress(PackageError):
            download(pkg.ref, path, local_only)


def cached_range(ref: HubRef, start: int, end: int, expect_sha: str, mtp: bool = False) -> HubPackage | None:
    """The range from the HF cache alone (no network), or None if it is not all there and sound."""
    try:
        return fetch_range(ref, start, end, expect_sha, local_only=True, mtp=mtp)
    except PackageError:
        return None


def _fetch_all(pkg: HubPackage, arts: Iterable[Artifact], local_only: bool, on_bytes: OnBytes | None) -> None:
    for art in arts:
        fetch_artifact(pkg, art, local_only)
        if on_bytes is not None:
            on_bytes(art.artifact_bytes)


def fetch_artifact(pkg: HubPackage, art: Artifact, local_only: bool = False) -> Path:
    """Download (or find in the cache) one artifact and verify it against the manifest."""
    label = f"{art.path} of {pkg.ref}"
    path = download(pkg.ref, art.path, local_only)
    try:
        verify_file(path, art.artifact_bytes, art.sha256, label)
        return path
    except PackageError as cached_error:
        if local_only or constants.HF_HUB_OFFLINE:
            raise PackageError(f"{cached_error}; the cached copy is {path.resolve()}: delete it and "
                               "fetch it again with network access") from None
    # The cached copy was modified or truncated: fetch it once more, and keep it only if it verifies.
    path = download(pkg.ref, art.path, local_only=False, force=True)
    try:
        verify_file(path, art.artifact_bytes, art.sha256, label)
    except PackageError as served_error:
        _evict(path)
        raise PackageError(f"{served_error} (as served by the Hub; removed from the cache)") from None
    return path


def download(ref: HubRef, filename: str, local_only: bool = False, force: bool = False) -> Path:
    """One file of `ref` into the HF cache; its path there. Hub errors become one-line PackageErrors."""
    try:
        return Path(hf_hub_download(ref.repo_id, filename, revision=ref.rev,
                                    local_files_only=local_only, force_download=force))
    except HUB_ERRORS as exc:
        raise PackageError(explain(exc, ref, filename, local_only)) from None


def explain(exc: BaseException, ref: HubRef, filename: str | None, local_only: bool = False) -> str:
    """A one-line, actionable message for a huggingface_hub failure."""
    what = f"{filename} of {ref}" if filename else str(ref)
    if isinstance(exc, GatedRepoError):
        return f"{ref.repo_id} is gated: accept its terms on the Hub, then {_LOGIN}"
    if isinstance(exc, RepositoryNotFoundError):
        return f"repository {ref.repo_id} not found on the Hub (if it is private, {_LOGIN})"
    if isinstance(exc, RevisionNotFoundError):
        return f"revision {ref.rev} not found in {ref.repo_id}"
    if isinstance(exc, (LocalEntryNotFoundError, OfflineModeIsEnabled)):
        return _not_cached(ref, what, local_only)
    if isinstance(exc, EntryNotFoundError):
        if filename == MANIFEST_NAME:
            return (f"{ref} has no {MANIFEST_NAME}: it is not a layer package, or its publish did not finish "
                    "(the manifest is uploaded last)")
        return f"{ref} has no file {filename}"
    if isinstance(exc, HfHubHTTPError) and exc.response is not None and exc.response.status_code in (401, 403):
        return f"the Hub refused access to {what} (HTTP {exc.response.status_code}): {_LOGIN}"
    if isinstance(exc, transport_errors()):
        return f"cannot reach the Hub at {constants.ENDPOINT} for {what}: {type(exc).__name__}: {exc}"
    return f"Hub request for {what} failed: {str(exc).strip().splitlines()[0] if str(exc).strip() else exc!r}"


def _not_cached(ref: HubRef, what: str, local_only: bool) -> str:
    cache = Path(constants.HF_HUB_CACHE)
    where = f"the Hugging Face cache ({cache})"
    if constants.HF_HUB_OFFLINE or local_only:
        why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "only the cache was consulted"
        if not _repo_cache(ref.repo_id).is_dir():
            return f"{ref.repo_id} is not in {where} and {why}: run `mesh package pull {ref}` with network first"
        return f"{what} is not in {where} and {why}: run `mesh package pull {ref}` with network first"
    return (f"cannot reach the Hub at {constants.ENDPOINT} for {what}, and it is not in {where}: "
            "check the network, HF_ENDPOINT or a proxy")


def _repo_cache(repo_id: str) -> Path:
    return Path(constants.HF_HUB_CACHE) / ("models--" + repo_id.replace("/", "--"))


def _check_blob_name(pointer: Path, label: str) -> None:
    """huggingface_hub names a blob by its git sha1 (or LFS sha256): a mismatch means it was edited."""
    if not pointer.is_symlink():
        return  # a cache without symlinks (Windows) keeps copies: nothing to compare against
    name = Path(os.readlink(pointer)).name
    data = pointer.read_bytes()
    if _SHA256.fullmatch(name):
        actual = sha256_bytes(data)
    elif _COMMIT.fullmatch(name):
        actual = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
    else:
        return
    if actual != name:
        raise PackageError(f"checksum mismatch in {label}: the cached file {pointer.resolve()} was modified; "
                           "delete it and fetch it again")


def _evict(pointer: Path) -> None:
    blob = pointer.resolve()
    pointer.unlink(missing_ok=True)
    if blob != pointer:
        blob.unlink(missing_ok=True)


# -- package dirs that live in the HF cache -----------------------------------------------------------


def pinned_ref_of(package_dir: Path) -> HubRef | None:
    """The pinned hf:// ref of a package directory that is a HF cache snapshot, else None."""
    snapshots, commit = package_dir.parent, package_dir.name
    repo_dir = snapshots.parent
    if snapshots.name != "snapshots" or not _COMMIT.fullmatch(commit):
        return None
    org, sep, name = repo_dir.name.removeprefix("models--").partition("--")
    if not repo_dir.name.startswith("models--") or not sep or "--" in name:
        return None
    return HubRef(f"{org}/{name}", commit)


def package_ref(package_dir: Path) -> str:
    """What a coordinator hands stages as Prepare.package_ref: a pinned hf:// ref, else the path."""
    ref = pinned_ref_of(package_dir)
    return str(ref) if ref is not None else str(package_dir)


# -- drafts ---------------------------------------------------------------------------------------------


def resolve_draft(ref: str, package_dir: Path) -> Path:
    """A draft model's GGUF on disk, from any draft ref form (DESIGN.md §5)."""
    parsed = parse_draft_ref(ref)
    if isinstance(parsed, HubRef):
        assert parsed.path is not None
        return download(parsed.package(), parsed.path)
    if isinstance(parsed, QuantRef):
        commit, files = _repo_files(parsed)
        name = pick_quant(files, parsed.quant, str(parsed))
        return download(HubRef(parsed.repo_id, commit), name)
    return _local_draft(parsed, package_dir)


def _local_draft(path: Path, package_dir: Path) -> Path:
    if path.is_absolute():
        if not path.is_file():
            raise PackageError(f"draft model not found: {path}")
        return path
    if ".." in path.parts:
        raise PackageError(f"draft path {path} escapes the package directory")
    local = package_dir / path
    if local.is_file():
        return local
    hub_ref = pinned_ref_of(package_dir)
    if hub_ref is None:
        raise PackageError(f"draft model not found: {local}")
    return download(hub_ref, path.as_posix())  # a Hub package fetches its draft from the same commit


def _repo_files(ref: QuantRef) -> tuple[str, list[str]]:
    """(commit, files) at the head of the repo's main branch: from the Hub, or offline from the cache."""
    hub_ref = HubRef(ref.repo_id)
    if constants.HF_HUB_OFFLINE:
        return _cached_files(hub_ref)
    try:
        info = HfApi().model_info(ref.repo_id)
    except HUB_ERRORS as exc:
        raise PackageError(explain(exc, hub_ref, None)) from None
    if info.sha is None:
        raise PackageError(f"the Hub did not say which commit {ref.repo_id} is at")
    return info.sha, [s.rfilename for s in info.siblings or []]


def _cached_files(ref: HubRef) -> tuple[str, list[str]]:
    repo = _repo_cache(ref.repo_id)
    head = repo / "refs" / ref.rev
    commit = head.read_text().strip() if head.is_file() else ref.rev
    snapshot = repo / "snapshots" / commit
    if not snapshot.is_dir():
        raise PackageError(_not_cached(ref, str(ref), local_only=True))
    return commit, sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file())


def pick_quant(files: Iterable[str], quant: str, where: str) -> str:
    """The one GGUF whose name carries `quant` as a token (case-insensitive); else a clear error."""
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf"))
    loose = _quant_pattern(quant, "A-Za-z0-9")
    found = [f for f in ggufs if loose.search(f.rsplit("/", 1)[-1])]
    if len(found) > 1:
        # Q4_0 should pick x-Q4_0.gguf over x-Q4_0_4_4.gguf, while Q4_K stays ambiguous.
        strict = _quant_pattern(quant, "A-Za-z0-9_")
        exact = [f for f in found if strict.search(f.rsplit("/", 1)[-1])]
        if len(exact) == 1:
            return exact[0]
        raise PackageError(f"draft {where}: quant {quant} is ambiguous; candidates: {', '.join(found)}")
    if not found:
        listed = ", ".join(ggufs) if ggufs else "none"
        raise PackageError(f"draft {where}: no GGUF named with quant {quant}; GGUF files: {listed}")
    return found[0]


def _quant_pattern(quant: str, word: str) -> re.Pattern[str]:
    return re.compile(rf"(?<![{word}]){re.escape(quant)}(?![{word}])", re.IGNORECASE)
