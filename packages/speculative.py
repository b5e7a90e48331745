"""The `generation.speculative_decoding` block of model-package.json (DESIGN.md §5).

A package may declare draft-model strategies; stage 0 alone uses them. A draft shipped
inside the package lives under `draft/` and is pinned by sha256 like every artifact.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packages.errors import PackageError
from packages.integrity import atomic_file, sha256_file, verify_file

_STRATEGY_KEYS = {"type", "draft_model", "draft_sha256", "draft_bytes", "window_policy"}
_WINDOW_KEYS = {"default", "initial_window", "min_window", "max_window"}
WINDOW_POLICIES = ("fixed", "adaptive", "cost-aware")


@dataclass(frozen=True)
class DraftStrategy:
    name: str
    draft_model: str  # a path inside the package, an hf:// ref, or org/repo:QUANT
    window_policy: str = "adaptive"
    initial_window: int = 4
    min_window: int = 1
    max_window: int = 16
    draft_sha256: str | None = None
    draft_bytes: int | None = None

    @property
    def in_package(self) -> bool:
        return not (self.draft_model.startswith("hf://") or ":" in self.draft_model)

    def to_json(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"type": "draft-model", "draft_model": self.draft_model,
                                 "window_policy": {"default": self.window_policy,
                                                   "initial_window": self.initial_window,
                                                   "min_window": self.min_window,
                                                   "max_window": self.max_window}}
        if self.draft_sha256:
            entry |= {"draft_sha256": self.draft_sha256, "draft_bytes": self.draft_bytes}
        return entry


def declared(generation: dict[str, Any]) -> tuple[str | None, dict[str, DraftStrategy]]:
    """(default strategy name, strategies); PackageError names the bad field."""
    block = generation.get("speculative_decoding")
    if block is None:
        return None, {}
    where = "generation.speculative_decoding"
    if not isinstance(block, dict) or set(block) - {"default", "strategies"}:
        raise PackageError(f"{where}: expected only 'default' and 'strategies'")
    raw = block.get("strategies", {})
    if not isinstance(raw, dict):
        raise PackageError(f"{where}.strategies must be an object")
    strategies = {name: _strategy(f"{where}.strategies.{name}", name, body) for name, body in raw.items()}
    default = block.get("default")
    if default is not None and default not in strategies:
        raise PackageError(f"{where}.default names {default!r}, which is not among the strategies")
    return default, strategies


def _strategy(where: str, name: str, body: Any) -> DraftStrategy:
    if not isinstance(body, dict):
        raise PackageError(f"{where} must be an object")
    unknown = sorted(set(body) - _STRATEGY_KEYS)
    if unknown:
        raise PackageError(f"{where}.{unknown[0]}: unknown field")
    if body.get("type") != "draft-model":
        raise PackageError(f"{where}.type must be 'draft-model'")
    if not isinstance(body.get("draft_model"), str) or not body["draft_model"]:
        raise PackageError(f"{where}.draft_model must be a non-empty string")
    window = body.get("window_policy", {})
    if not isinstance(window, dict) or set(window) - _WINDOW_KEYS:
        raise PackageError(f"{where}.window_policy: expected only {', '.join(sorted(_WINDOW_KEYS))}")
    strategy = DraftStrategy(
        name=name, draft_model=body["draft_model"], window_policy=window.get("default", "adaptive"),
        initial_window=window.get("initial_window", 4), min_window=window.get("min_window", 1),
        max_window=window.get("max_window", 16), draft_sha256=body.get("draft_sha256"),
        draft_bytes=body.get("draft_bytes"))
    if strategy.window_policy not in WINDOW_POLICIES:
        raise PackageError(f"{where}.window_policy.default must be one of {', '.join(WINDOW_POLICIES)}")
    sizes = (strategy.min_window, strategy.initial_window, strategy.max_window)
    if not all(isinstance(v, int) for v in sizes) or not 1 <= sizes[0] <= sizes[1] <= sizes[2] <= 64:
        raise PackageError(f"{where}.window_policy: need 1 <= min_window <= initial_window <= max_window <= 64")
    if strategy.in_package and (Path(strategy.draft_model).is_absolute() or ".." in Path(strategy.draft_model).parts):
        raise PackageError(f"{where}.draft_model must stay inside the package")
    if strategy.in_package and not (isinstance(strategy.draft_sha256, str) and isinstance(strategy.draft_bytes, int)):
        raise PackageError(f"{where}: a draft inside the package needs draft_sha256 and draft_bytes")
    return strategy


def verify_draft(package_dir: Path, strategy: DraftStrategy) -> Path:
    """The draft's path inside the package, checked against its sha256."""
    assert strategy.in_package and strategy.draft_sha256 and strategy.draft_bytes is not None
    path = package_dir / strategy.draft_model
    verify_file(path, strategy.draft_bytes, strategy.draft_sha256, strategy.draft_model)
    return path


def bundle_draft(gguf: Path, package_dir: Path, name: str, window: dict[str, Any]) -> DraftStrategy:
    """Copy a local draft GGUF into `draft/` and describe it as a strategy."""
    rel = f"draft/{gguf.name}"
    with atomic_file(package_dir / rel) as tmp:
        shutil.copyfile(gguf, tmp)
    return DraftStrategy(name=name, draft_model=rel, draft_sha256=sha256_file(package_dir / rel),
                         draft_bytes=(package_dir / rel).stat().st_size, **window)


def block_for(strategy: DraftStrategy) -> dict[str, Any]:
    return {"speculative_decoding": {"default": strategy.name, "strategies": {strategy.name: strategy.to_json()}}}
