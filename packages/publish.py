"""`mesh package publish`: put a validated layer package on the Hugging Face Hub, manifest last.

Two commits. The first deletes any older model-package.json and adds the artifacts; the second
adds the model card and then the manifest. A publish that dies half way therefore leaves a
revision without a manifest, which no `hf://` ref resolves, instead of a manifest whose
artifacts are missing or stale. The second commit's id is the immutable ref to serve.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi, get_token
from huggingface_hub.utils import (
    HfHubHTTPError,
    HFValidationError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    validate_repo_id,
)

from packages.describe import human_bytes
from packages.errors import PackageError
from packages.hub import HUB_ERRORS, transport_errors
from packages.manifest import MANIFEST_NAME, Manifest
from packages.model_card import CARD_NAME, model_card
from packages.refs import SCHEME, HubRef, parse_package_ref
from packages.speculative import DraftStrategy, declared
from packages.validate import validate_package

Say = Callable[[str], None]
# huggingface_hub raises ValueError for requests it refuses before sending (bad README metadata, ...).
_PUBLISH_ERRORS: tuple[type[BaseException], ...] = (*HUB_ERRORS, ValueError)


@dataclass(frozen=True)
class PlannedFile:
    path: str  # where it lands in the repo
    size: int
    source: Path | bytes


@dataclass(frozen=True)
class PublishPlan:
    repo_id: str
    revision: str | None  # a branch; None means main
    private: bool
    artifacts: tuple[PlannedFile, ...]  # first commit
    card: PlannedFile  # second commit, before the manifest
    manifest: PlannedFile  # the very last file to land

    @property
    def files(self) -> tuple[PlannedFile, ...]:
        return (*self.artifacts, self.card, self.manifest)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


def plan_publish(package_dir: Path, repo_id: str, revision: str | None = None, private: bool = False,
                 progress: Say | None = None) -> PublishPlan:
    """Validate the package and list what would be uploaded, in upload order."""
    _check_repo_id(repo_id)
    _check_branch(repo_id, revision)
    manifest, _ = validate_package(package_dir, progress)
    arts = [PlannedFile(a.path, a.artifact_bytes, package_dir / a.path) for a in manifest.artifacts()]
    arts += _bundled_drafts(manifest, package_dir)
    card = model_card(manifest, repo_id, revision).encode()
    manifest_path = package_dir / MANIFEST_NAME
    return PublishPlan(
        repo_id=repo_id, revision=revision, private=private, artifacts=tuple(arts),
        card=PlannedFile(CARD_NAME, len(card), card),
        manifest=PlannedFile(MANIFEST_NAME, manifest_path.stat().st_size, manifest_path),
    )


def format_plan(plan: PublishPlan) -> str:
    width = max(len(human_bytes(f.size)) for f in plan.files)
    where = f"{plan.repo_id}@{plan.revision}" if plan.revision else plan.repo_id
    lines = [f"would upload to {where}{' (private)' if plan.private else ''}, in this order:"]
    lines += [f"  {human_bytes(f.size).rjust(width)}  {f.path}" for f in plan.files]
    lines.append(f"total {human_bytes(plan.total_bytes)} in {len(plan.files)} files; nothing was uploaded")
    return "\n".join(lines)


def publish(plan: PublishPlan, api: HfApi | None = None, say: Say | None = None) -> HubRef:
    """Upload the plan; return the pinned ref of the commit that added the manifest."""
    api = api or HfApi()
    tell = say or (lambda _: None)
    if api.token is None and get_token() is None:
        raise PackageError("no Hugging Face token: log in with `hf auth login` or set HF_TOKEN "
                           "(a token with write access)")
    try:
        _ensure_target(api, plan)
        tell(f"uploading {len(plan.artifacts)} artifacts ({human_bytes(sum(f.size for f in plan.artifacts))})")
        api.create_commit(plan.repo_id, _artifact_operations(api, plan), revision=plan.revision,
                          commit_message="meshpipe: layer package artifacts")
        tell(f"uploading {CARD_NAME} and {MANIFEST_NAME}")
        final = api.create_commit(
            plan.repo_id,
            [CommitOperationAdd(f.path, f.source) for f in (plan.card, plan.manifest)],
            revision=plan.revision, commit_message="meshpipe: publish model-package.json")
    except _PUBLISH_ERRORS as exc:
        raise PackageError(explain_publish(exc, plan, api.endpoint)) from None
    return HubRef(plan.repo_id, final.oid)


def _ensure_target(api: HfApi, plan: PublishPlan) -> None:
    api.create_repo(plan.repo_id, private=plan.private, exist_ok=True)
    if plan.revision not in (None, "main"):
        api.create_branch(plan.repo_id, branch=plan.revision, exist_ok=True)


def _artifact_operations(api: HfApi, plan: PublishPlan) -> list[Any]:
    ops: list[Any] = [CommitOperationAdd(f.path, f.source) for f in plan.artifacts]
    # A manifest from an earlier publish would describe files this commit replaces: drop it first.
    if api.file_exists(plan.repo_id, MANIFEST_NAME, revision=plan.revision):
        ops.insert(0, CommitOperationDelete(MANIFEST_NAME))
    return ops


def explain_publish(exc: BaseException, plan: PublishPlan, endpoint: str) -> str:
    """One line naming what went wrong and what to do; the manifest never went up on failure."""
    repo = plan.repo_id
    status = exc.response.status_code if isinstance(exc, HfHubHTTPError) and exc.response is not None else None
    if isinstance(exc, OfflineModeIsEnabled):
        why = "HF_HUB_OFFLINE is set: publishing needs the network"
    elif isinstance(exc, transport_errors()):
        why = f"cannot reach the Hub at {endpoint} ({type(exc).__name__}: {exc})"
    elif status == 401:
        why = "the Hub rejected the token (HTTP 401): log in again with `hf auth login` or set a valid HF_TOKEN"
    elif status == 403:
        why = f"no permission to write to {repo} (HTTP 403): the token needs write access to that namespace"
    elif isinstance(exc, RepositoryNotFoundError):
        why = f"repository {repo} not found or not writable with this token"
    else:
        first = str(exc).strip().splitlines()
        why = f"{type(exc).__name__}: {first[0] if first else exc!r}"
    return f"publish to {repo} failed: {why}; {MANIFEST_NAME} was not uploaded, so nothing half-published resolves"


def _check_repo_id(repo_id: str) -> None:
    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        raise PackageError(f"bad --repo {repo_id!r}: {str(exc).splitlines()[0]}") from None
    if "/" not in repo_id:
        raise PackageError(f"bad --repo {repo_id!r}: expected org/name")


def _check_branch(repo_id: str, revision: str | None) -> None:
    if revision is None:
        return
    target = parse_package_ref(f"{SCHEME}{repo_id}@{revision}")  # the rules any ref to it must meet
    if isinstance(target, HubRef) and target.pinned:
        raise PackageError(f"--revision {revision} is a commit: publish to a branch")


def _bundled_drafts(manifest: Manifest, package_dir: Path) -> list[PlannedFile]:
    """Draft GGUFs shipped inside the package (validate_package has checked their sha256)."""
    drafts = {s.draft_model: s for s in declared(manifest.generation)[1].values()
              if isinstance(s, DraftStrategy) and s.in_package}
    return [PlannedFile(path, s.draft_bytes or 0, package_dir / path) for path, s in drafts.items()]
