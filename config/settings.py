"""The TOML config (DESIGN.md §7): typed, frozen, and strict about unknown keys.

`--config FILE`, default ~/.config/meshpipe/config.toml (absent is fine). Every unknown
key is an error naming its full path, e.g. `models[0].speculative.max_windw`.
"""

from __future__ import annotations

import logging
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from config.errors import MeshpipeError
from config.validation import problem

CONFIG_VERSION = 1
OLD_FRAMES_KEY = "windows_in_flight"  # accepted for frames_in_flight, with a warning
log = logging.getLogger("meshpipe.config")


class ConfigError(MeshpipeError, ValueError):
    pass


class UsageError(ConfigError):
    """A command-line flag is malformed or conflicts with another; `mesh` prints it as one line."""


class Speculative(BaseModel):
    """One level of the precedence chain; None means "not set here".

    The window keys are a partial packages.speculative.WindowPolicy: each dumps to that type's
    alias (window_changes). A level checks only their types; WindowPolicy checks the values,
    once, when mesh/speculative/plan.py has merged the levels.
    """

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    # auto | disabled | ngram | ngram+draft | draft | mtp | ngram+mtp | a package strategy name
    strategy: str | None = None
    draft_model: str | None = None
    # prompt lookup's n-gram lengths (checked once merged, as packages.speculative.NgramStrategy)
    ngram_min: int | None = None
    ngram_max: int | None = None
    # fixed | adaptive | cost-aware; a manifest's window_policy object calls it "default"
    window_policy: str | None = Field(default=None, serialization_alias="default")
    initial_window: int | None = None
    min_window: int | None = None
    max_window: int | None = None
    # verify frames a session may have in flight at once (DESIGN.md §6); 1 waits for each reply
    frames_in_flight: int | None = Field(default=None, ge=1, le=16)
    # how drafts of a sampled request are accepted when it names no rule (DESIGN.md §6)
    acceptance: Literal["auto", "exact", "rejection"] | None = None

    def window_changes(self) -> dict[str, object]:
        """The window keys set at this level, named as WindowPolicy.overridden wants them."""
        return self.model_dump(by_alias=True, exclude_none=True,
                               exclude={"strategy", "draft_model", "frames_in_flight", "ngram_min", "ngram_max",
                                        "acceptance"})


@dataclass(frozen=True)
class ModelEntry:
    model: str
    speculative: Speculative = field(default_factory=Speculative)


@dataclass(frozen=True)
class MeshSection:
    listen: str | None = None
    peers: tuple[str, ...] = ()
    spares: tuple[str, ...] = ()  # standby stages that take over a peer that stops answering
    api_keys: tuple[str, ...] = ()  # keys the HTTP API asks for (mesh serve --api-key)


@dataclass(frozen=True)
class Config:
    version: int = CONFIG_VERSION
    mesh: MeshSection = field(default_factory=MeshSection)
    defaults: Speculative = field(default_factory=Speculative)
    models: tuple[ModelEntry, ...] = ()

    def model(self, names: set[str]) -> ModelEntry | None:
        """The [[models]] entry whose `model` is one of the served model's names."""
        return next((m for m in self.models if m.model in names), None)


def default_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "meshpipe" / "config.toml"


def load_config(path: Path | None) -> Config:
    """Read `path` (or the default location, which may be absent)."""
    explicit = path is not None
    path = path or default_path()
    if not path.is_file():
        if explicit:
            raise ConfigError(f"config file not found: {path}")
        return Config()
    try:
        data = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    try:
        return parse_config(data)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def parse_config(data: dict[str, Any]) -> Config:
    _only(data, {"version", "mesh", "defaults", "models"}, "")
    version = data.get("version", CONFIG_VERSION)
    if version != CONFIG_VERSION:
        raise ConfigError(f"version: this meshpipe reads config version {CONFIG_VERSION}, not {version!r}")
    mesh = _table(data.get("mesh", {}), "mesh")
    _only(mesh, {"listen", "peers", "spares", "api_keys"}, "mesh")
    peers, spares = mesh.get("peers", []), mesh.get("spares", [])
    for name, value in (("peers", peers), ("spares", spares)):
        if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
            raise ConfigError(f"mesh.{name}: expected a list of \"HOST:PORT\" strings")
    keys = mesh.get("api_keys", [])
    if not isinstance(keys, list) or not all(isinstance(k, str) and k.strip() == k != "" for k in keys):
        raise ConfigError("mesh.api_keys: expected a list of keys, non-empty strings without surrounding spaces")
    defaults = _table(data.get("defaults", {}), "defaults")
    _only(defaults, {"speculative"}, "defaults")
    models = data.get("models", [])
    if not isinstance(models, list):
        raise ConfigError("models: expected [[models]] tables")
    return Config(version=version,
                  mesh=MeshSection(_opt_str(mesh, "listen", "mesh"), tuple(peers), tuple(spares), tuple(keys)),
                  defaults=_speculative(defaults.get("speculative", {}), "defaults.speculative"),
                  models=tuple(_model(m, f"models[{i}]") for i, m in enumerate(models)))


def _model(raw: Any, where: str) -> ModelEntry:
    table = _table(raw, where)
    _only(table, {"model", "speculative"}, where)
    if not isinstance(table.get("model"), str):
        raise ConfigError(f"{where}.model: required, a model ref or id")
    return ModelEntry(table["model"], _speculative(table.get("speculative", {}), f"{where}.speculative"))


def _speculative(raw: Any, where: str) -> Speculative:
    table = _table(raw, where)
    if OLD_FRAMES_KEY in table:  # its name before a window meant only the number of drafts
        if "frames_in_flight" in table:
            raise ConfigError(f"{where}.{OLD_FRAMES_KEY}: the old name of frames_in_flight; set only that")
        log.warning("%s.%s is now frames_in_flight; the old name still works", where, OLD_FRAMES_KEY)
        table = {("frames_in_flight" if k == OLD_FRAMES_KEY else k): v for k, v in table.items()}
    _only(table, set(Speculative.model_fields), where)
    try:
        return Speculative.model_validate(table)
    except ValidationError as exc:
        key, message = problem(exc)
        raise ConfigError(f"{where}.{key}: {message}") from None


def _table(raw: Any, where: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a table")
    return raw


def _only(table: dict[str, Any], allowed: set[str], where: str) -> None:
    for key in table:
        if key not in allowed:
            path = f"{where}.{key}" if where else key
            raise ConfigError(f"{path}: unknown key (allowed here: {', '.join(sorted(allowed))})")


def _opt_str(table: dict[str, Any], key: str, where: str) -> str | None:
    value = table.get(key)
    if value is not None and not isinstance(value, str):
        raise ConfigError(f"{where}.{key}: expected a string")
    return value
