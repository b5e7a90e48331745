"""Which draft and window the coordinator uses, and where each choice came from.

Precedence, field by field: CLI > [[models]] speculative for this model > [defaults.speculative]
> the package's declared strategy > built-in (off). `--no-draft` turns it all off and the
draft is never loaded or downloaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from config.settings import Config, ConfigError, Speculative
from packages.manifest import Manifest
from packages.speculative import DraftStrategy, WindowPolicy, declared, problem

# The bound when `windows_in_flight` is unset and stages can compute at once (the coordinator's
# `windows_in_flight`): the cost-aware controller prices depth and keeps 1 where more does not
# pay. Under a CPU lock stages take turns, so frames ahead cannot overlap: there it is 1.
WINDOWS_IN_FLIGHT = 3


@dataclass(frozen=True)
class SpecPlan:
    draft_model: str
    window: WindowPolicy
    source: str  # where the draft choice came from, for the log line and /health
    strategy: DraftStrategy | None  # the package strategy in use, if any
    in_flight: int | None = None  # verify frames a session may have out at once; None: auto

    def describe(self) -> str:
        name = self.strategy.name if self.strategy and self.strategy.draft_model == self.draft_model \
            else self.draft_model
        flight = "auto" if self.in_flight is None else self.in_flight
        return f"draft {name} ({self.source}), windows in flight: {flight}, {self.window.describe()}"


def resolve_plan(cli: Speculative, no_draft: bool, config: Config, model_names: set[str],
                 manifest: Manifest) -> tuple[SpecPlan | None, str]:
    """(the plan or None, one line saying what was decided and why)."""
    if no_draft:
        return None, "off (--no-draft)"
    entry = config.model(model_names)
    levels = [("CLI", cli), ("config [[models]]", entry.speculative if entry else Speculative()),
              ("config [defaults.speculative]", config.defaults)]
    strategy_name, where = _first(levels, "strategy") or ("auto", "built-in")
    if strategy_name == "disabled":
        return None, f"off (strategy = \"disabled\", {where})"
    default, strategies = declared(manifest.generation)
    if strategy_name != "auto" and strategy_name not in strategies:
        known = ", ".join(sorted(strategies)) or "none"
        raise ConfigError(f"speculative strategy {strategy_name!r} ({where}) is not declared by the "
                          f"package (it declares: {known})")
    key = default if strategy_name == "auto" else strategy_name
    package = strategies.get(key) if key else None
    chosen = _first(levels, "draft_model")
    if chosen is None and package is None:
        return None, "off (no draft declared by the package or configured)"
    draft, source = chosen or (package.draft_model, "package default")  # type: ignore[union-attr]
    window = _window(levels, package)
    in_flight = _first(levels, "windows_in_flight")
    return SpecPlan(draft, window, source, package, in_flight[0] if in_flight else None), ""


def _first(levels: list[tuple[str, Speculative]], name: str) -> tuple[Any, str] | None:
    for where, level in levels:
        value = getattr(level, name)
        if value is not None:
            return value, where
    return None


def _window(levels: list[tuple[str, Speculative]], package: DraftStrategy | None) -> WindowPolicy:
    changes: dict[str, object] = {}
    for _, level in reversed(levels):  # lowest first, so each level overwrites the ones below
        changes |= level.window_changes()
    try:
        return (package.window if package else WindowPolicy()).overridden(changes)
    except ValidationError as exc:
        raise ConfigError(f"speculative window: {problem(exc)[1]}") from None
