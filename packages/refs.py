"""Model and draft references: a local path, a package on the Hugging Face Hub, or one file there.

Package refs (`--model`, `mesh package validate|pull`):
    /path/to/package            a local directory (or GGUF file)
    hf://org/name               the package at the head of `main`
    hf://org/name@rev           at a branch, tag or commit (`hf://org/name:rev` means the same)

Draft refs (`generation.speculative_decoding`, DESIGN.md §5):
    org/repo:QUANT              the GGUF in that repo whose name carries QUANT (case-insensitive)
    hf://org/repo@rev/f.gguf    one file; a `/` inside rev is written `%2F`
    relative/path.gguf          a file inside the package directory
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath
from urllib.parse import quote, unquote

from packages.errors import PackageError

SCHEME = "hf://"
_COMMIT = re.compile(r"[0-9a-f]{40}")
_REPO = r"(?P<repo>[^/@:\s]+/[^/@:\s]+)"
_PACKAGE = re.compile(rf"{_REPO}(?:[@:](?P<rev>\S+))?")
_FILE = re.compile(rf"{_REPO}(?:[@:](?P<rev>[^/\s]+))?/(?P<path>\S+)")
_QUANT = re.compile(rf"{_REPO}:(?P<quant>[A-Za-z0-9][A-Za-z0-9_.\-]*)")
# Git forbids these in ref names; refusing them early gives a clearer error than the Hub's 404.
_BAD_REVISION = re.compile(r"\.\.|//|@\{|[\s~^:?*\[\\]|^/|/$|\.lock$|^\.|\.$")
_PACKAGE_FORMS = "a package directory, hf://org/name, hf://org/name@rev or hf://org/name:rev"
_DRAFT_FORMS = "org/repo:QUANT, hf://org/repo@rev/file.gguf or relative/path.gguf"


@dataclass(frozen=True)
class HubRef:
    """A repo on the Hub at a revision (None: `main`), or one file in it."""

    repo_id: str
    revision: str | None = None
    path: str | None = None

    @property
    def pinned(self) -> bool:
        """True when the revision is a commit, so the bytes behind the ref can never change."""
        return self.revision is not None and _COMMIT.fullmatch(self.revision) is not None

    @property
    def rev(self) -> str:
        return self.revision or "main"

    def at(self, commit: str) -> HubRef:
        return replace(self, revision=commit)

    def package(self) -> HubRef:
        """The package this file ref lives in."""
        return replace(self, path=None)

    def __str__(self) -> str:
        if self.path is None:
            return f"{SCHEME}{self.repo_id}" + (f"@{self.revision}" if self.revision else "")
        rev = f"@{quote(self.revision, safe='')}" if self.revision else ""
        return f"{SCHEME}{self.repo_id}{rev}/{self.path}"


@dataclass(frozen=True)
class QuantRef:
    """`org/repo:QUANT`: the one GGUF in the repo whose file name carries QUANT."""

    repo_id: str
    quant: str

    def __str__(self) -> str:
        return f"{self.repo_id}:{self.quant}"


def is_hub_ref(text: str) -> bool:
    return text.startswith(SCHEME)


def parse_package_ref(text: str) -> HubRef | Path:
    """A package ref: a HubRef for `hf://…`, else a local path (existence is the caller's concern)."""
    if not is_hub_ref(text):
        return _local_path(text)
    match = _PACKAGE.fullmatch(text[len(SCHEME):])
    if match is None:
        raise PackageError(f"bad package ref {text!r}: expected {_PACKAGE_FORMS}")
    return HubRef(_repo_id(match["repo"], text), _revision(match["rev"], text))


def parse_hub_ref(text: str) -> HubRef:
    ref = parse_package_ref(text)
    if not isinstance(ref, HubRef):
        raise PackageError(f"not a Hub ref: {text!r} (expected hf://org/name[@rev])")
    return ref


def parse_draft_ref(text: str) -> HubRef | QuantRef | Path:
    """A draft ref: one Hub file, a quant pick from a Hub repo, or a path."""
    if is_hub_ref(text):
        match = _FILE.fullmatch(text[len(SCHEME):])
        if match is None or not match["path"].lower().endswith(".gguf"):
            raise PackageError(f"bad draft ref {text!r}: an hf:// draft names one file, "
                               "hf://org/repo@rev/file.gguf")
        rev = unquote(match["rev"]) if match["rev"] else None
        return HubRef(_repo_id(match["repo"], text), _revision(rev, text), _file_path(match["path"], text))
    if text.lower().endswith(".gguf"):
        return _local_path(text)
    match = _QUANT.fullmatch(text)
    if match is None:
        raise PackageError(f"bad draft ref {text!r}: expected {_DRAFT_FORMS}")
    return QuantRef(_repo_id(match["repo"], text), match["quant"])


def _local_path(text: str) -> Path:
    if "\0" in text:
        raise PackageError(f"bad path {text!r}: it contains a NUL byte")
    try:
        return Path(text).expanduser()
    except RuntimeError:  # `~name` where no user is called name: keep it literal
        return Path(text)


def _repo_id(repo: str, text: str) -> str:
    # Imported here: huggingface_hub costs a stage daemon ~20 MB of RSS it mostly never uses.
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo)
    except HFValidationError as exc:
        raise PackageError(f"bad repo id in {text!r}: {str(exc).splitlines()[0]}") from None
    return repo


def _revision(rev: str | None, text: str) -> str | None:
    if rev is None:
        return None
    if not rev or _BAD_REVISION.search(rev):
        raise PackageError(f"bad revision {rev!r} in {text!r}")
    return rev


def _file_path(path: str, text: str) -> str:
    parts = PurePosixPath(path).parts
    if path.startswith("/") or ".." in parts or "" in path.split("/"):
        raise PackageError(f"bad file path {path!r} in {text!r}: it must be relative to the repo")
    return path
