"""The one WindowPolicy/DraftStrategy type: its checks, its serialized names, and the precedence merge."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
from pydantic import ValidationError

from config.settings import Config, ConfigError, ModelEntry, Speculative, parse_config
from mesh.cli.serve import _cli_speculative
from mesh.speculative.plan import resolve_plan
from packages.errors import PackageError
from packages.manifest import load_manifest
from packages.speculative import DraftStrategy, WindowPolicy, block_for, declared, parse

WHERE = "generation.speculative_decoding.strategies.s"
SHA = "ab" * 32


def _entry(**changes: object) -> dict[str, object]:
    entry: dict[str, object] = {"type": "draft-model", "draft_model": "org/draft:Q4_0",
                                "window_policy": {"default": "fixed", "initial_window": 3, "min_window": 2,
                                                  "max_window": 5}}
    return {k: v for k, v in (entry | changes).items() if v is not None}


def _declare(entry: dict[str, object]) -> DraftStrategy:
    strategy = declared({"speculative_decoding": {"default": "s", "strategies": {"s": entry}}})[1]["s"]
    assert isinstance(strategy, DraftStrategy)
    return strategy


def test_defaults_and_python_names():
    assert WindowPolicy() == WindowPolicy(policy="adaptive", initial=4, min=1, max=16)
    assert WindowPolicy(policy="fixed", initial=3, min=1, max=3).describe() == "fixed 3"
    assert WindowPolicy(policy="cost-aware", initial=4, min=1, max=8).describe() == "cost-aware 4 [1,8]"


def test_manifest_entry_reads_and_writes_the_published_names():
    entry = _entry()
    strategy = _declare(entry)
    assert strategy.name == "s"
    assert strategy.window == WindowPolicy(policy="fixed", initial=3, min=2, max=5)
    assert strategy.to_json() == entry  # the same keys a published package has, nothing added
    bundled = _declare(_entry(draft_model="draft/d.gguf", draft_sha256=SHA, draft_bytes=7))
    assert bundled.in_package
    assert bundled.to_json()["draft_sha256"] == SHA
    assert _declare(_entry(window_policy=None)).window == WindowPolicy()  # the window is optional


def test_the_types_are_frozen():
    window = WindowPolicy()
    with pytest.raises(ValidationError):
        window.initial = 8
    assert hash(window) == hash(WindowPolicy())


@pytest.mark.parametrize(("window", "message"), [
    ({"default": "greedy"}, "window policy must be one of fixed, adaptive, cost-aware, not 'greedy'"),
    ({"min_window": 0}, r"windows need 1 <= min_window \(0\)"),
    ({"min_window": 5, "initial_window": 4}, r"min_window \(5\) <= initial_window \(4\)"),
    ({"initial_window": 20}, r"initial_window \(20\) <= max_window \(16\)"),
    ({"max_window": 65}, r"max_window \(65\) <= 64"),
])
def test_each_bad_window_names_the_rule(window, message):
    with pytest.raises(ValidationError, match=message):
        parse(WindowPolicy, window)
    with pytest.raises(PackageError, match=rf"^{WHERE}\.window_policy.*: .*{message}"):
        _declare(_entry(window_policy=window))


@pytest.mark.parametrize(("entry", "message"), [
    (_entry(window_policy={"initial_window": "8"}), "window_policy.initial_window: expected int, got '8'"),
    (_entry(window_policy={"max_window": True}), "window_policy.max_window: expected int, got True"),
    (_entry(window_policy={"min_window": 1.0}), "window_policy.min_window: expected int, got 1.0"),
    (_entry(window_policy={"initial": 4}), "window_policy.initial: unknown field"),  # Python names are not keys
    (_entry(window_policy={"window_policy": "fixed"}), "window_policy.window_policy: unknown field"),
    (_entry(window_policy="fixed"), "window_policy: expected object, got 'fixed'"),
    (_entry(surprise=1), "surprise: unknown field"),
    (_entry(name="x"), "name: unknown field"),
    (_entry(window={}), "window: unknown field"),  # the Python name of window_policy is no key either
    (_entry(type="lookup"), "type: must be one of draft-model, ngram, not 'lookup'"),
    (_entry(type=None), "type: required"),
    (_entry(draft_model=""), "draft_model: must be a non-empty string"),
    (_entry(draft_model=5), "draft_model: must be a non-empty string"),
    (_entry(draft_model="../d.gguf", draft_sha256=SHA, draft_bytes=1), "draft_model: must stay inside the package"),
    (_entry(draft_model="/d.gguf", draft_sha256=SHA, draft_bytes=1), "draft_model: must stay inside the package"),
    (_entry(draft_model="draft/d.gguf"), ": a draft inside the package needs draft_sha256 and draft_bytes"),
    (_entry(draft_bytes="7"), "draft_bytes: expected int, got '7'"),
])
def test_each_bad_manifest_entry_is_a_clear_error(entry, message):
    with pytest.raises(PackageError) as caught:
        _declare(entry)
    assert str(caught.value).startswith(WHERE)
    assert str(caught.value).endswith(message)


def test_config_window_keys_are_a_partial_window_policy():
    level = Speculative(strategy="auto", draft_model="x.gguf", window_policy="fixed", initial_window=2,
                        min_window=2, max_window=2)
    assert level.window_changes() == {"default": "fixed", "initial_window": 2, "min_window": 2, "max_window": 2}
    assert WindowPolicy().overridden(level.window_changes()) == WindowPolicy(policy="fixed", initial=2, min=2, max=2)
    assert Speculative(max_window=8).window_changes() == {"max_window": 8}


@pytest.mark.parametrize(("toml", "message"), [
    ({"window_policy": 3}, "defaults.speculative.window_policy: expected str, got 3"),
    ({"initial_window": True}, "defaults.speculative.initial_window: expected int, got True"),
    ({"min_window": 1.5}, "defaults.speculative.min_window: expected int, got 1.5"),
    ({"policy": "fixed"},
     r"defaults.speculative.policy: unknown key \(allowed here: acceptance, draft_model, frames_in_flight, "
     r"initial_window"),
])
def test_config_level_type_errors_name_the_key(toml, message):
    with pytest.raises(ConfigError, match=message):
        parse_config({"defaults": {"speculative": toml}})


@pytest.fixture(scope="module")
def manifest(tiny_package):
    m, _ = load_manifest(tiny_package)
    window = WindowPolicy(policy="cost-aware", initial=3, min=2, max=6)
    strategy = DraftStrategy(name="pkg", type="draft-model", draft_model="org/d:Q4_0", window=window)
    return dataclasses.replace(m, generation=block_for(strategy))


def _window(cli: Speculative, config: Config, manifest) -> WindowPolicy:
    plan, _ = resolve_plan(cli, False, config, {"tiny"}, manifest)
    assert plan is not None
    return plan.window


def test_window_fields_merge_one_by_one(manifest):
    assert _window(Speculative(), Config(), manifest) == WindowPolicy(policy="cost-aware", initial=3, min=2, max=6)
    defaults = Speculative(window_policy="adaptive", max_window=8)
    model = Speculative(initial_window=4)
    config = Config(defaults=defaults, models=(ModelEntry("tiny", model),))
    assert _window(Speculative(), config, manifest) == WindowPolicy(policy="adaptive", initial=4, min=2, max=8)
    cli = Speculative(min_window=1, initial_window=1)
    assert _window(cli, config, manifest) == WindowPolicy(policy="adaptive", initial=1, min=1, max=8)


def test_draft_window_flag_beats_every_level(manifest):
    config = Config(defaults=Speculative(window_policy="adaptive", initial_window=2, max_window=4))
    flags = argparse.Namespace(draft=None, draft_window=5, frames_in_flight=None,
                               speculative_acceptance=None, strategy=None)
    assert _window(_cli_speculative(flags), config, manifest) == WindowPolicy(policy="fixed", initial=5, min=1,
                                                                               max=16)
    flags = argparse.Namespace(draft=None, draft_window=20, frames_in_flight=None,
                               speculative_acceptance=None, strategy=None)
    assert _window(_cli_speculative(flags), config, manifest).max == 20


def test_a_merged_window_that_breaks_the_rules_is_a_config_error(manifest):
    config = Config(defaults=Speculative(max_window=2))  # below the package's initial window of 3
    with pytest.raises(ConfigError, match=r"^speculative window: windows need .*initial_window \(3\) <= "
                                          r"max_window \(2\)"):
        _window(Speculative(), config, manifest)
    with pytest.raises(ConfigError, match=r"^speculative window: window policy must be one of"):
        _window(Speculative(window_policy="greedy"), Config(), manifest)
    flags = argparse.Namespace(draft=None, draft_window=65, frames_in_flight=None,
                               speculative_acceptance=None, strategy=None)
    with pytest.raises(ConfigError, match=r"max_window \(65\) <= 64"):
        _window(_cli_speculative(flags), Config(), manifest)
