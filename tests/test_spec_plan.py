"""The speculative plan: CLI > [[models]] > [defaults] > package > off, field by field."""

from __future__ import annotations

import dataclasses

import pytest
from pydantic import ValidationError

from config.settings import Config, ConfigError, ModelEntry, Speculative, parse_config
from mesh.coordinator import windows_in_flight
from mesh.speculative.plan import WINDOWS_IN_FLIGHT, resolve_plan
from packages.manifest import load_manifest
from packages.speculative import DraftStrategy, WindowPolicy, block_for


@pytest.fixture(scope="module")
def manifest(tiny_package):
    m, _ = load_manifest(tiny_package)
    strategy = DraftStrategy(name="pkg-draft", type="draft-model", draft_model="org/draft:Q4_0",
                             window=WindowPolicy(policy="adaptive", initial=4, min=1, max=16))
    return dataclasses.replace(m, generation=block_for(strategy))


NAMES = {"tiny"}


def test_package_default_when_nothing_else_says(manifest):
    plan, _ = resolve_plan(Speculative(), False, Config(), NAMES, manifest)
    assert plan is not None
    assert plan.draft_model == "org/draft:Q4_0"
    assert plan.source == "package default"
    assert plan.describe() == "draft pkg-draft (package default), windows in flight: auto, adaptive 4 [1,16]"


def test_each_level_overrides_the_ones_below(manifest):
    defaults = Speculative(window_policy="fixed", initial_window=2, max_window=2)
    model = Speculative(draft_model="org/other:Q8_0", initial_window=3, max_window=3)
    config = Config(defaults=defaults, models=(ModelEntry("tiny", model),))
    plan, _ = resolve_plan(Speculative(), False, config, NAMES, manifest)
    assert plan
    assert plan.draft_model == "org/other:Q8_0"
    assert plan.source == "config [[models]]"
    assert plan.window.policy == "fixed"
    assert plan.window.initial == 3
    cli = Speculative(draft_model="/x/d.gguf", initial_window=5, max_window=5)
    plan, _ = resolve_plan(cli, False, config, NAMES, manifest)
    assert plan
    assert plan.draft_model == "/x/d.gguf"
    assert plan.source == "CLI"
    assert plan.window.initial == 5
    other_model = Config(defaults=defaults, models=(ModelEntry("something-else", model),))
    plan, _ = resolve_plan(Speculative(), False, other_model, NAMES, manifest)
    assert plan
    assert plan.draft_model == "org/draft:Q4_0"
    assert plan.window.initial == 2


def test_windows_in_flight_take_the_highest_level_that_sets_them(manifest):
    plan, _ = resolve_plan(Speculative(), False, Config(), NAMES, manifest)
    assert plan
    assert plan.in_flight is None  # auto: the coordinator decides
    config = Config(defaults=Speculative(windows_in_flight=5))
    plan, _ = resolve_plan(Speculative(), False, config, NAMES, manifest)
    assert plan
    assert plan.in_flight == 5
    assert plan.describe() == "draft pkg-draft (package default), windows in flight: 5, adaptive 4 [1,16]"
    assert plan.window == WindowPolicy(policy="adaptive", initial=4, min=1, max=16)  # not a window key
    plan, _ = resolve_plan(Speculative(windows_in_flight=1), False, config, NAMES, manifest)
    assert plan
    assert plan.in_flight == 1
    assert plan.describe() == "draft pkg-draft (package default), windows in flight: 1, adaptive 4 [1,16]"
    with pytest.raises(ValidationError):
        Speculative(windows_in_flight=0)


def test_auto_windows_in_flight_are_one_where_frames_sent_ahead_cannot_overlap(manifest, tmp_path):
    auto, _ = resolve_plan(Speculative(), False, Config(), NAMES, manifest)
    lock = tmp_path / "cpu.lock"
    assert windows_in_flight(auto, downstream=True, cpu_lock=None) == WINDOWS_IN_FLIGHT > 1
    assert windows_in_flight(auto, downstream=False, cpu_lock=None) == 1  # stage 0 is the whole route
    assert windows_in_flight(auto, downstream=True, cpu_lock=lock) == 1  # stages take turns on the cores
    assert windows_in_flight(None, downstream=True, cpu_lock=None) == 1  # no draft
    for n in (1, 5):  # a number set anywhere is honoured, lock or not
        chosen, _ = resolve_plan(Speculative(windows_in_flight=n), False, Config(), NAMES, manifest)
        assert windows_in_flight(chosen, downstream=True, cpu_lock=lock) == n
        assert windows_in_flight(chosen, downstream=False, cpu_lock=None) == n


def test_off_switches(manifest, tiny_package):
    off = resolve_plan(Speculative(draft_model="/x.gguf"), True, Config(), NAMES, manifest)
    assert off == (None, "off (--no-draft)")
    disabled = Config(defaults=Speculative(strategy="disabled"))
    plan, note = resolve_plan(Speculative(), False, disabled, NAMES, manifest)
    assert plan is None
    assert "disabled" in note
    bare, _ = load_manifest(tiny_package)
    plan, note = resolve_plan(Speculative(), False, Config(), NAMES, bare)
    assert plan is None
    assert note.startswith("off (no draft declared")


def test_bad_settings_are_clear_errors(manifest):
    with pytest.raises(ConfigError, match=r"'nope'.*declares: pkg-draft"):
        resolve_plan(Speculative(strategy="nope"), False, Config(), NAMES, manifest)
    with pytest.raises(ConfigError, match="min"):
        resolve_plan(Speculative(min_window=9), False, Config(), NAMES, manifest)


@pytest.mark.parametrize(("toml", "message"), [
    ({"mesh": {"peer": []}}, "mesh.peer: unknown key"),
    ({"mesh": {"spares": "10.0.0.4:7070"}}, "mesh.spares: expected a list"),
    ({"defaults": {"speculative": {"max_window": "8"}}}, "defaults.speculative.max_window: expected int"),
    ({"models": [{"speculative": {}}]}, "models[0].model: required"),
    ({"version": 2}, "version"),
    ({"extra": 1}, "extra: unknown key"),
])
def test_config_errors_name_the_key_path(toml, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_config(toml)


def test_config_parses_the_documented_example():
    config = parse_config({"version": 1, "mesh": {"listen": "0.0.0.0:9337", "peers": ["10.0.0.2:7070"],
                                                  "spares": ["10.0.0.4:7070"]},
                           "defaults": {"speculative": {"strategy": "auto", "max_window": 8}},
                           "models": [{"model": "hf://org/m@abc", "speculative": {"initial_window": 4}}]})
    assert config.mesh.peers == ("10.0.0.2:7070",)
    assert config.mesh.spares == ("10.0.0.4:7070",)
    assert config.defaults.max_window == 8
    assert config.model({"hf://org/m@abc"}) is not None
    assert config.model({"x"}) is None
