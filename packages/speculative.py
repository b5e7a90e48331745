"""The speculative-decoding types, defined once: `WindowPolicy`, `DraftStrategy` and
`NgramStrategy` (DESIGN.md §5, §6).

The package manifest (`generation.speculative_decoding`), the TOML config (whose
`[models.speculative]` keys are a partial `WindowPolicy`, config/settings.py) and the
coordinator's window controllers (mesh/speculative/window.py) all use these types, so their
validators are the only checks. Python names are the ones the code reads; the serialized
names are pydantic aliases, so published packages keep loading. A draft shipped inside the
package lives under `draft/` and is pinned by sha256 like every artifact.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Self, TypeAlias, TypeVar, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from config.validation import problem
from packages.errors import PackageError
from packages.integrity import atomic_file, sha256_file, verify_file

Policy = Literal["fixed", "adaptive", "cost-aware"]
WINDOW_POLICIES: tuple[str, ...] = get_args(Policy)
MAX_WINDOW = 64  # the largest window any policy may propose
MAX_NGRAM = 32  # the longest suffix prompt lookup may match

# Frozen and strict (no "8" for 8), unknown keys refused. Both names construct from code;
# parse() reads serialized documents by their aliases alone.
_STRICT = ConfigDict(frozen=True, strict=True, extra="forbid", validate_by_name=True, validate_by_alias=True)
_Model = TypeVar("_Model", bound=BaseModel)


class WindowPolicy(BaseModel):
    """How many draft tokens a window proposes: `policy` and its window sizes (DESIGN.md §6).

    The aliases are the keys of a manifest's `window_policy` object; config.settings.Speculative
    dumps its TOML keys to the same aliases, so a level of the config merges without a table.
    """

    model_config = _STRICT

    policy: Policy = Field(default="adaptive", validation_alias="default", serialization_alias="default")
    initial: int = Field(default=4, validation_alias="initial_window", serialization_alias="initial_window")
    min: int = Field(default=1, validation_alias="min_window", serialization_alias="min_window")
    max: int = Field(default=16, validation_alias="max_window", serialization_alias="max_window")

    @field_validator("policy", mode="before")
    @classmethod
    def _known(cls, value: object) -> object:
        # before the Literal check, so the message lists the choices as users write them
        if value not in WINDOW_POLICIES:
            raise ValueError(f"window policy must be one of {', '.join(WINDOW_POLICIES)}, not {value!r}")
        return value

    @model_validator(mode="after")
    def _ordered(self) -> Self:
        if not 1 <= self.min <= self.initial <= self.max <= MAX_WINDOW:
            raise ValueError(f"windows need 1 <= min_window ({self.min}) <= initial_window ({self.initial}) "
                             f"<= max_window ({self.max}) <= {MAX_WINDOW}")
        return self

    def describe(self) -> str:
        if self.policy == "fixed":
            return f"fixed {self.initial}"
        return f"{self.policy} {self.initial} [{self.min},{self.max}]"

    def overridden(self, changes: Mapping[str, object]) -> WindowPolicy:
        """This policy with `changes` (keyed by the aliases) applied; the result is checked again."""
        return parse(WindowPolicy, self.model_dump(by_alias=True) | dict(changes))


def ref_in_package(ref: str) -> bool:
    """Whether a draft ref names a file inside the package (not hf://… nor org/repo:QUANT)."""
    return not (ref.startswith("hf://") or ":" in ref)


class DraftStrategy(BaseModel):
    """A draft model and its window policy, as a package declares it (DESIGN.md §5)."""

    model_config = _STRICT

    name: str = Field(exclude=True)  # its key under `strategies`, not a field of the entry
    type: Literal["draft-model"]  # required: it tells the strategy types apart
    draft_model: str  # a path inside the package, an hf:// ref, or org/repo:QUANT
    window: WindowPolicy = Field(default_factory=WindowPolicy, validation_alias="window_policy",
                                 serialization_alias="window_policy")
    draft_sha256: str | None = None
    draft_bytes: int | None = None

    @field_validator("type", mode="before")
    @classmethod
    def _draft_model_type(cls, value: object) -> object:
        if value != "draft-model":
            raise ValueError("must be 'draft-model'")
        return value

    @field_validator("draft_model", mode="before")
    @classmethod
    def _safe_ref(cls, value: object) -> object:
        if not isinstance(value, str) or not value:
            raise ValueError("must be a non-empty string")
        if ref_in_package(value) and (Path(value).is_absolute() or ".." in Path(value).parts):
            raise ValueError("must stay inside the package")
        return value

    @model_validator(mode="after")
    def _pinned(self) -> Self:
        if self.in_package and not (isinstance(self.draft_sha256, str) and isinstance(self.draft_bytes, int)):
            raise ValueError("a draft inside the package needs draft_sha256 and draft_bytes")
        return self

    @property
    def in_package(self) -> bool:
        return ref_in_package(self.draft_model)

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True)


def ngram_window() -> WindowPolicy:
    """Prompt lookup's default window: adaptive from 2, up to 16. Its matches are right
    whole or not at all: a copy grows the window by one per full accept, a spurious match
    shrinks it, and a round with no match is a plain decode. Chosen by replaying greedy
    SmolLM2 output through the matcher with this CPU's verify costs (DESIGN.md §6)."""
    return WindowPolicy(policy="adaptive", initial=2, min=1, max=16)


class NgramStrategy(BaseModel):
    """Prompt lookup (DESIGN.md §6): the tokens that followed the most recent earlier
    occurrence of the sequence's last n tokens, n from ngram_max down to ngram_min."""

    model_config = _STRICT

    name: str = Field(exclude=True)
    type: Literal["ngram"]
    # 3..5: in replayed SmolLM2 output, 2-token matches were wrong often enough to cost
    # novel text time, and 3 kept nearly every copy (DESIGN.md §6)
    ngram_min: int = 3
    ngram_max: int = 5
    window: WindowPolicy = Field(default_factory=ngram_window, validation_alias="window_policy",
                                 serialization_alias="window_policy")

    @model_validator(mode="after")
    def _lengths(self) -> Self:
        if not 1 <= self.ngram_min <= self.ngram_max <= MAX_NGRAM:
            raise ValueError(f"n-gram lengths need 1 <= ngram_min ({self.ngram_min}) <= ngram_max "
                             f"({self.ngram_max}) <= {MAX_NGRAM}")
        return self

    @property
    def in_package(self) -> bool:
        return False  # no model file: nothing inside the package to verify or publish

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True)


Strategy: TypeAlias = DraftStrategy | NgramStrategy
STRATEGY_TYPES = ("draft-model", "ngram")


def parse(model: type[_Model], data: object) -> _Model:
    """`data` read by its serialized names alone, as a manifest or a config level is."""
    return model.model_validate(data, by_alias=True, by_name=False)


def declared(generation: Mapping[str, Any]) -> tuple[str | None, dict[str, Strategy]]:
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


def _strategy(where: str, name: str, body: Any) -> Strategy:
    if not isinstance(body, dict):
        raise PackageError(f"{where} must be an object")
    if "name" in body:  # the name is the entry's key; a field of that name is not in the schema
        raise PackageError(f"{where}.name: unknown field")
    kind = body.get("type")
    if "type" not in body:
        raise PackageError(f"{where}.type: required")
    if kind not in STRATEGY_TYPES:  # before the fields: each type has its own
        raise PackageError(f"{where}.type: must be one of {', '.join(STRATEGY_TYPES)}, not {kind!r}")
    try:
        if kind == "ngram":
            return parse(NgramStrategy, body | {"name": name})
        return parse(DraftStrategy, body | {"name": name})
    except ValidationError as exc:
        path, message = problem(exc)
        raise PackageError(f"{where}{'.' if path else ''}{path}: {message}") from None


def verify_draft(package_dir: Path, strategy: Strategy) -> Path:
    """The draft's path inside the package, checked against its sha256."""
    if not isinstance(strategy, DraftStrategy):
        raise PackageError(f"strategy {strategy.name!r} has no draft model inside the package")
    assert strategy.in_package
    assert strategy.draft_sha256
    assert strategy.draft_bytes is not None
    path = package_dir / strategy.draft_model
    verify_file(path, strategy.draft_bytes, strategy.draft_sha256, strategy.draft_model)
    return path


def bundle_draft(gguf: Path, package_dir: Path, name: str, window: WindowPolicy) -> DraftStrategy:
    """Copy a local draft GGUF into `draft/` and describe it as a strategy."""
    rel = f"draft/{gguf.name}"
    with atomic_file(package_dir / rel) as tmp:
        shutil.copyfile(gguf, tmp)
    return DraftStrategy(name=name, type="draft-model", draft_model=rel, window=window,
                         draft_sha256=sha256_file(package_dir / rel), draft_bytes=(package_dir / rel).stat().st_size)


def block_for(strategy: Strategy, *more: Strategy) -> dict[str, Any]:
    """The manifest's `generation` block declaring these strategies, the first the default."""
    strategies = {s.name: s.to_json() for s in (strategy, *more)}
    return {"speculative_decoding": {"default": strategy.name, "strategies": strategies}}
