"""Which proposers and windows the coordinator uses, and where each choice came from.

Precedence, field by field: CLI > [[models]] speculative for this model > [defaults.speculative]
> the package's declared strategy > built-in (off). `--no-draft` turns it all off and the
draft is never loaded or downloaded.

Strategies: `auto` (the package's default; where that is a draft model, prompt lookup is asked
first, as `ngram+draft` does: on the held-out corpus of issue 58 it matched or beat the draft
alone on every kind but one at 0 and 20 ms, and took copy-heavy rewrites at 20 ms from 1.01 to
2.41 of no speculation), `disabled`, a strategy the package declares by name, and three built
in, used when the package declares no strategy of that name: `ngram`, prompt lookup alone (no
draft model is loaded, even if one is configured); `ngram+draft`, prompt lookup first and,
where it finds no match, the draft model the plan would otherwise use (the configured
`draft_model`, else the package's draft-model strategy); and `draft`, that draft model alone.
Prompt lookup takes the package's n-gram strategy when it declares one, else the built-in
lengths and window (packages/speculative.py); `ngram_min`/`ngram_max` and the window keys
override them level by level. The window keys apply to every proposer in the plan.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, TypeVar

from pydantic import ValidationError

from common.sampling import AUTO
from config.settings import Config, ConfigError, Speculative
from packages.manifest import Manifest
from packages.speculative import DraftStrategy, NgramStrategy, Strategy, WindowPolicy, declared, parse, problem

# The bound when `frames_in_flight` is unset and stages can compute at once (mesh/serving/requests.py
# `frames_in_flight`). Fixed and adaptive windows keep the bound out; under a CPU lock stages
# take turns, so frames ahead cannot overlap: there it is 1.
FRAMES_IN_FLIGHT = 3
# The bound when every window is cost-aware: the controller prices each depth and keeps fewer
# where more does not pay, so it gets more to choose from. At 50 ms a bound of 5 ran 6-8%
# faster than 3 in two interleaved sweeps, the same at 20 ms, and 8 no better (DESIGN.md §6).
PRICED_FRAMES_IN_FLIGHT = 5
NGRAM, NGRAM_DRAFT, DRAFT = "ngram", "ngram+draft", "draft"  # the built-in names besides auto and disabled
MTP, NGRAM_MTP = "mtp", "ngram+mtp"  # the model's own MTP layers, at the final stage (mesh/speculative/mtp.py)
BUILT_IN = ("auto", "disabled", NGRAM, NGRAM_DRAFT, DRAFT, MTP, NGRAM_MTP)
# MTP's window unless the levels set one: llama.cpp's own MTP drafting proposes 3 a step, and the
# cost-aware controller turns drafting off where the layer agrees too rarely to pay (issue 56).
MTP_WINDOW = WindowPolicy(policy="cost-aware", initial=3, min=1, max=8)
_Kind = TypeVar("_Kind", DraftStrategy, NgramStrategy)


@dataclass(frozen=True)
class NgramPlan:
    """Prompt lookup's n-gram lengths and window, and where they came from."""

    ngram_min: int
    ngram_max: int
    window: WindowPolicy
    source: str

    def describe(self) -> str:
        return f"ngram {self.ngram_min}-{self.ngram_max} ({self.source}), {self.window.describe()}"


@dataclass(frozen=True)
class SpecPlan:
    draft_model: str | None  # None: no draft model, prompt lookup proposes alone
    window: WindowPolicy  # the draft model's window; prompt lookup's when it proposes alone
    source: str  # where the draft choice came from, for the log line and /health
    strategy: DraftStrategy | None  # the package's draft-model strategy in use, if any
    in_flight: int | None = None  # verify frames a session may have out at once; None: auto
    ngram: NgramPlan | None = None  # prompt lookup, first when there is a draft model too
    acceptance: str = AUTO  # the rule for requests that name none (common/sampling.py)
    mtp: WindowPolicy | None = None  # the final stage's MTP layers draft, with this window
    mtp_layers: int = 0  # how many the package carries

    def priced(self) -> bool:
        """Every proposer's window is cost-aware, so each prices how many frames out pay."""
        windows = [self.window, *([self.ngram.window] if self.ngram else []), *([self.mtp] if self.mtp else [])]
        return all(w.policy == "cost-aware" for w in windows)

    def describe(self) -> str:
        flight = f"frames in flight: {'auto' if self.in_flight is None else self.in_flight}"
        if self.acceptance != AUTO:
            flight += f", acceptance: {self.acceptance}"
        if self.mtp is not None:
            mtp = f"mtp (the model's {self.mtp_layers} MTP layer(s) at the final stage), {self.mtp.describe()}"
            return f"{self.ngram.describe()}, then {mtp}, {flight}" if self.ngram else f"{mtp}, {flight}"
        if self.draft_model is None:
            assert self.ngram is not None
            return f"{self.ngram.describe()}, {flight}"
        name = self.strategy.name if self.strategy and self.strategy.draft_model == self.draft_model \
            else self.draft_model
        draft = f"draft {name} ({self.source}), {flight}, {self.window.describe()}"
        return f"{self.ngram.describe()}, then {draft}" if self.ngram else draft


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
    if strategy_name in (MTP, NGRAM_MTP) and strategy_name not in strategies:
        return _mtp(strategy_name, where, levels, manifest, default, strategies), ""
    if strategy_name in (NGRAM, NGRAM_DRAFT, DRAFT) and strategy_name not in strategies:
        return _built_in(strategy_name, where, levels, default, strategies), ""
    if strategy_name != "auto" and strategy_name not in strategies:
        known = ", ".join(sorted(strategies)) or "none"
        raise ConfigError(f"speculative strategy {strategy_name!r} ({where}) is not declared by the "
                          f"package (it declares: {known}; built in: {', '.join(BUILT_IN)})")
    key = default if strategy_name == "auto" else strategy_name
    package = strategies.get(key) if key else None
    if isinstance(package, NgramStrategy):
        ngram = _ngram(levels, package)
        return SpecPlan(None, ngram.window, ngram.source, None, _in_flight(levels), ngram, _acceptance(levels)), ""
    plan = _draft(levels, package)
    if plan is None and strategy_name == "auto" and mtp_layers(manifest):  # the model drafts for itself
        return _mtp(MTP, where, levels, manifest, default, strategies), ""
    if plan is None:
        return None, "off (no draft declared by the package or configured)"
    if strategy_name == "auto":  # prompt lookup first: it costs nothing where it finds no match
        return replace(plan, ngram=_ngram(levels, _of_type(NgramStrategy, default, strategies))), ""
    return plan, ""


def mtp_layers(manifest: Manifest) -> int:
    """The MTP layers the package carries (packages/manifest.py)."""
    return len(getattr(manifest, "mtp_layers", ()))


def _mtp(name: str, where: str, levels: list[tuple[str, Speculative]], manifest: Manifest, default: str | None,
         strategies: dict[str, Strategy]) -> SpecPlan:
    """`mtp` or `ngram+mtp`: the final stage's MTP layers draft, prompt lookup first in the second."""
    layers = mtp_layers(manifest)
    if not layers:
        raise ConfigError(f"speculative strategy {name!r} ({where}) needs MTP layers, and the package carries "
                          f"none (a model with nextn layers, packaged by this meshpipe, does)")
    ngram = _ngram(levels, _of_type(NgramStrategy, default, strategies)) if name == NGRAM_MTP else None
    window = _window(levels, MTP_WINDOW)
    return SpecPlan(None, window, "the model's MTP layers", None, _in_flight(levels), ngram, _acceptance(levels),
                    mtp=window, mtp_layers=layers)


def _built_in(name: str, where: str, levels: list[tuple[str, Speculative]], default: str | None,
              strategies: dict[str, Strategy]) -> SpecPlan:
    """`ngram`, `ngram+draft` or `draft`, with the package's n-gram and draft strategies where it declares them."""
    ngram = _ngram(levels, _of_type(NgramStrategy, default, strategies))
    if name == NGRAM:
        return SpecPlan(None, ngram.window, ngram.source, None, _in_flight(levels), ngram, _acceptance(levels))
    plan = _draft(levels, _of_type(DraftStrategy, default, strategies))
    if plan is None:
        raise ConfigError(f"speculative strategy {name!r} ({where}) needs a draft model: set "
                          f"draft_model (--draft), or serve a package that declares a draft-model strategy")
    return plan if name == DRAFT else replace(plan, ngram=ngram)


def _of_type(kind: type[_Kind], default: str | None, strategies: dict[str, Strategy]) -> _Kind | None:
    """The package's default strategy if it is of this type, else its first of this type."""
    ordered: list[Strategy] = [strategies[default]] if default else []
    return next((s for s in [*ordered, *strategies.values()] if isinstance(s, kind)), None)


def _draft(levels: list[tuple[str, Speculative]], package: Strategy | None) -> SpecPlan | None:
    """The draft-model plan: the configured draft_model, else the package strategy's."""
    strategy = package if isinstance(package, DraftStrategy) else None
    chosen = _first(levels, "draft_model")
    if chosen is None and strategy is None:
        return None
    draft, source = chosen or (strategy.draft_model, "package default")  # type: ignore[union-attr]
    window = _window(levels, strategy.window if strategy else WindowPolicy())
    return SpecPlan(draft, window, source, strategy, _in_flight(levels), acceptance=_acceptance(levels))


def _ngram(levels: list[tuple[str, Speculative]], package: NgramStrategy | None) -> NgramPlan:
    """Prompt lookup's lengths and window: the levels over the package's strategy over the built-in."""
    base = package or NgramStrategy(name=NGRAM, type="ngram")
    data = base.to_json() | {"name": base.name, "window_policy": _window(levels, base.window).model_dump(by_alias=True)}
    for name in ("ngram_min", "ngram_max"):
        found = _first(levels, name)
        data[name] = found[0] if found else getattr(base, name)
    try:  # the strategy's own validator checks the merged lengths, once
        checked = parse(NgramStrategy, data)
    except ValidationError as exc:
        raise ConfigError(f"speculative n-gram lengths: {problem(exc)[1]}") from None
    source = f"package strategy {package.name}" if package else "built-in"
    return NgramPlan(checked.ngram_min, checked.ngram_max, checked.window, source)


def _in_flight(levels: list[tuple[str, Speculative]]) -> int | None:
    found = _first(levels, "frames_in_flight")
    return found[0] if found else None


def _acceptance(levels: list[tuple[str, Speculative]]) -> str:
    found = _first(levels, "acceptance")
    return found[0] if found else AUTO


def _first(levels: list[tuple[str, Speculative]], name: str) -> tuple[Any, str] | None:
    for where, level in levels:
        value = getattr(level, name)
        if value is not None:
            return value, where
    return None


def _window(levels: list[tuple[str, Speculative]], base: WindowPolicy) -> WindowPolicy:
    changes: dict[str, object] = {}
    for _, level in reversed(levels):  # lowest first, so each level overwrites the ones below
        changes |= level.window_changes()
    try:
        return base.overridden(changes)
    except ValidationError as exc:
        raise ConfigError(f"speculative window: {problem(exc)[1]}") from None
