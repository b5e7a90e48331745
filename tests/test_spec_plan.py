"""The speculative plan: CLI > [[models]] > [defaults] > package > off, field by field."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
from pydantic import ValidationError

from config.settings import Config, ConfigError, ModelEntry, Speculative, UsageError, load_config, parse_config
from mesh.cli.serve import _cli_speculative
from mesh.serving.requests import frames_in_flight
from mesh.speculative.plan import FRAMES_IN_FLIGHT, PRICED_FRAMES_IN_FLIGHT, NgramPlan, resolve_plan
from packages.errors import PackageError
from packages.manifest import load_manifest
from packages.speculative import DraftStrategy, NgramStrategy, WindowPolicy, block_for, declared, ngram_window


@pytest.fixture(scope="module")
def manifest(tiny_package):
    m, _ = load_manifest(tiny_package)
    strategy = DraftStrategy(name="pkg-draft", type="draft-model", draft_model="org/draft:Q4_0",
                             window=WindowPolicy(policy="adaptive", initial=4, min=1, max=16))
    return dataclasses.replace(m, generation=block_for(strategy))


NAMES = {"tiny"}


def test_package_default_when_nothing_else_says_with_prompt_lookup_asked_first(manifest):
    plan, _ = resolve_plan(Speculative(), False, Config(), NAMES, manifest)
    assert plan is not None
    assert plan.draft_model == "org/draft:Q4_0"
    assert plan.source == "package default"
    assert plan.describe() == ("ngram 3-5 (built-in), adaptive 2 [1,16], then draft pkg-draft (package default), "
                               "frames in flight: auto, adaptive 4 [1,16]")


def test_the_package_s_draft_strategy_named_is_the_draft_alone(manifest):
    plan, _ = resolve_plan(Speculative(strategy="pkg-draft"), False, Config(), NAMES, manifest)
    assert plan is not None
    assert (plan.draft_model, plan.ngram) == ("org/draft:Q4_0", None)
    assert plan.describe() == "draft pkg-draft (package default), frames in flight: auto, adaptive 4 [1,16]"


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


def test_frames_in_flight_take_the_highest_level_that_sets_them(manifest):
    plan, _ = resolve_plan(Speculative(), False, Config(), NAMES, manifest)
    assert plan
    assert plan.in_flight is None  # auto: the coordinator decides
    config = Config(defaults=Speculative(frames_in_flight=5))
    plan, _ = resolve_plan(Speculative(), False, config, NAMES, manifest)
    assert plan
    assert plan.in_flight == 5
    assert plan.describe().endswith("then draft pkg-draft (package default), frames in flight: 5, adaptive 4 [1,16]")
    assert plan.window == WindowPolicy(policy="adaptive", initial=4, min=1, max=16)  # not a window key
    plan, _ = resolve_plan(Speculative(frames_in_flight=1), False, config, NAMES, manifest)
    assert plan
    assert plan.in_flight == 1
    assert plan.describe().endswith("then draft pkg-draft (package default), frames in flight: 1, adaptive 4 [1,16]")
    with pytest.raises(ValidationError):
        Speculative(frames_in_flight=0)


def test_auto_frames_in_flight_are_one_where_frames_sent_ahead_overlap_nothing(manifest, tmp_path):
    auto, _ = resolve_plan(Speculative(), False, Config(), NAMES, manifest)
    lock = tmp_path / "cpu.lock"
    assert frames_in_flight(auto, downstream=True, cpu_lock=None) == FRAMES_IN_FLIGHT > 1
    assert frames_in_flight(auto, downstream=False, cpu_lock=None) == 1  # stage 0 is the whole route
    # stages take turns on the cores, but a frame on a link still overlaps the next one
    assert frames_in_flight(auto, downstream=True, cpu_lock=lock) == FRAMES_IN_FLIGHT
    assert frames_in_flight(None, downstream=True, cpu_lock=None) == 1  # no draft
    priced, _ = resolve_plan(Speculative(window_policy="cost-aware"), False, Config(), NAMES, manifest)
    assert priced
    assert priced.priced()
    assert auto
    assert not auto.priced()
    # a cost-aware window prices each depth, so it is given more to choose from
    assert frames_in_flight(priced, downstream=True, cpu_lock=None) == PRICED_FRAMES_IN_FLIGHT > FRAMES_IN_FLIGHT
    assert frames_in_flight(priced, downstream=True, cpu_lock=lock) == FRAMES_IN_FLIGHT  # no compute overlaps
    assert frames_in_flight(priced, downstream=False, cpu_lock=None) == 1
    for n in (1, 5):  # a number set anywhere is honoured, lock or not
        chosen, _ = resolve_plan(Speculative(frames_in_flight=n), False, Config(), NAMES, manifest)
        assert frames_in_flight(chosen, downstream=True, cpu_lock=lock) == n
        assert frames_in_flight(chosen, downstream=False, cpu_lock=None) == n


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


def test_ngram_is_built_in_and_loads_no_draft(manifest, tiny_package):
    bare, _ = load_manifest(tiny_package)
    for m in (manifest, bare):  # with a package draft and without any strategy
        plan, _ = resolve_plan(Speculative(strategy="ngram"), False, Config(), NAMES, m)
        assert plan is not None
        assert plan.draft_model is None  # nothing to load or download
        assert plan.ngram == NgramPlan(3, 5, ngram_window(), "built-in")
        assert plan.window == ngram_window()
        assert plan.describe() == "ngram 3-5 (built-in), adaptive 2 [1,16], frames in flight: auto"
    config = Config(defaults=Speculative(draft_model="org/other:Q8_0", ngram_max=8, max_window=32))
    plan, _ = resolve_plan(Speculative(strategy="ngram"), False, config, NAMES, manifest)
    assert plan
    assert plan.draft_model is None  # a configured draft is for draft-model strategies and ngram+draft
    assert plan.ngram is not None
    assert (plan.ngram.ngram_min, plan.ngram.ngram_max, plan.ngram.window.max) == (3, 8, 32)


def test_ngram_plus_draft_takes_the_draft_the_plan_would_otherwise_use(manifest, tiny_package):
    plan, _ = resolve_plan(Speculative(strategy="ngram+draft"), False, Config(), NAMES, manifest)
    assert plan
    assert plan.draft_model == "org/draft:Q4_0"
    assert plan.window == WindowPolicy(policy="adaptive", initial=4, min=1, max=16)  # the draft's own
    assert plan.ngram is not None
    assert plan.describe() == ("ngram 3-5 (built-in), adaptive 2 [1,16], then draft pkg-draft (package default), "
                               "frames in flight: auto, adaptive 4 [1,16]")
    config = Config(models=(ModelEntry("tiny", Speculative(strategy="ngram+draft", draft_model="/d.gguf")),))
    plan, _ = resolve_plan(Speculative(), False, config, NAMES, manifest)
    assert plan
    assert (plan.draft_model, plan.source) == ("/d.gguf", "config [[models]]")
    bare, _ = load_manifest(tiny_package)
    with pytest.raises(ConfigError, match=r"'ngram\+draft' \(CLI\) needs a draft model"):
        resolve_plan(Speculative(strategy="ngram+draft"), False, Config(), NAMES, bare)
    assert resolve_plan(Speculative(strategy="ngram+draft"), True, Config(), NAMES, manifest) == \
        (None, "off (--no-draft)")


def test_draft_is_the_draft_alone_whatever_declares_it(manifest, tiny_package):
    plan, _ = resolve_plan(Speculative(strategy="draft"), False, Config(), NAMES, manifest)
    assert plan
    assert (plan.draft_model, plan.ngram, plan.source) == ("org/draft:Q4_0", None, "package default")
    plan, _ = resolve_plan(Speculative(strategy="draft", draft_model="/d.gguf"), False, Config(), NAMES, manifest)
    assert plan
    assert (plan.draft_model, plan.ngram, plan.source) == ("/d.gguf", None, "CLI")
    bare, _ = load_manifest(tiny_package)
    with pytest.raises(ConfigError, match=r"'draft' \(CLI\) needs a draft model"):
        resolve_plan(Speculative(strategy="draft"), False, Config(), NAMES, bare)


def test_a_package_ngram_strategy_is_used_by_auto_by_name_and_by_ngram(tiny_package):
    bare, _ = load_manifest(tiny_package)
    lookup = NgramStrategy(name="lookup", type="ngram", ngram_min=2, ngram_max=6,
                           window=WindowPolicy(policy="cost-aware", initial=8, min=1, max=24))
    draft = DraftStrategy(name="pkg-draft", type="draft-model", draft_model="org/draft:Q4_0")
    m = dataclasses.replace(bare, generation=block_for(lookup, draft))
    for name in ("auto", "lookup", "ngram"):
        plan, _ = resolve_plan(Speculative(strategy=name), False, Config(), NAMES, m)
        assert plan
        assert plan.draft_model is None
        assert plan.ngram == NgramPlan(2, 6, lookup.window, "package strategy lookup")
    plan, _ = resolve_plan(Speculative(strategy="pkg-draft"), False, Config(), NAMES, m)
    assert plan
    assert (plan.draft_model, plan.ngram) == ("org/draft:Q4_0", None)
    plan, _ = resolve_plan(Speculative(strategy="ngram+draft", ngram_min=4), False, Config(), NAMES, m)
    assert plan
    assert plan.ngram == NgramPlan(4, 6, lookup.window, "package strategy lookup")
    assert plan.draft_model == "org/draft:Q4_0"


def test_bad_ngram_settings_are_clear_errors(manifest):
    with pytest.raises(ConfigError, match=r"n-gram lengths: .*ngram_min \(6\) <= ngram_max \(5\)"):
        resolve_plan(Speculative(strategy="ngram", ngram_min=6), False, Config(), NAMES, manifest)
    with pytest.raises(ConfigError, match=r"1 <= ngram_min \(0\)"):
        resolve_plan(Speculative(strategy="ngram", ngram_min=0), False, Config(), NAMES, manifest)
    with pytest.raises(ConfigError, match=r"speculative window: .*initial_window \(2\) <= max_window \(1\)"):
        resolve_plan(Speculative(strategy="ngram", max_window=1), False, Config(), NAMES, manifest)
    with pytest.raises(ConfigError, match=r"'ngram2'.*built in: auto, disabled, ngram, ngram\+draft"):
        resolve_plan(Speculative(strategy="ngram2"), False, Config(), NAMES, manifest)
    with pytest.raises(ConfigError, match=r"defaults.speculative.ngram_max: expected int, got '4'"):
        parse_config({"defaults": {"speculative": {"strategy": "ngram", "ngram_max": "4"}}})
    level = parse_config({"models": [{"model": "x", "speculative": {"strategy": "ngram", "ngram_min": 2,
                                                                     "ngram_max": 4}}]}).models[0].speculative
    assert (level.strategy, level.ngram_min, level.ngram_max) == ("ngram", 2, 4)


@pytest.mark.parametrize(("entry", "message"), [
    ({"type": "ngram", "ngram_min": 5, "ngram_max": 3}, r"s: n-gram lengths need 1 <= ngram_min \(5\) <= ngram_max"),
    ({"type": "ngram", "ngram_max": 40}, r"s: n-gram lengths need .* <= 32"),
    ({"type": "ngram", "ngram_min": "2"}, "s.ngram_min: expected int, got '2'"),
    ({"type": "ngram", "draft_model": "org/d:Q4_0"}, "s.draft_model: unknown field"),
    ({"type": "ngram", "window_policy": {"default": "greedy"}}, "s.window_policy.default: window policy must be"),
    ({"type": "lookup"}, "s.type: must be one of draft-model, ngram, not 'lookup'"),
])
def test_bad_manifest_ngram_strategies_name_the_field(entry, message):
    with pytest.raises(PackageError, match=message):
        declared({"speculative_decoding": {"default": "s", "strategies": {"s": entry}}})


def test_a_manifest_ngram_strategy_round_trips():
    body = {"type": "ngram", "ngram_min": 2, "ngram_max": 4,
            "window_policy": {"default": "fixed", "initial_window": 6, "min_window": 1, "max_window": 6}}
    default, strategies = declared({"speculative_decoding": {"default": "s", "strategies": {"s": body}}})
    assert default == "s"
    s = strategies["s"]
    assert isinstance(s, NgramStrategy)
    assert s.to_json() == body
    assert not s.in_package


def test_serve_flags_strategy_and_its_conflicts():
    flags = argparse.Namespace(draft=None, draft_window=None, frames_in_flight=None,
                               speculative_acceptance=None, strategy="ngram+draft")
    assert _cli_speculative(flags).strategy == "ngram+draft"
    for strategy in ("ngram", "disabled"):
        flags = argparse.Namespace(draft="/d.gguf", draft_window=None, frames_in_flight=None,
                               speculative_acceptance=None, strategy=strategy)
        with pytest.raises(UsageError, match=f"--draft with --strategy {strategy} loads no draft"):
            _cli_speculative(flags)


def test_the_old_name_of_frames_in_flight_still_configures_them(tmp_path, caplog):
    path = tmp_path / "config.toml"
    path.write_text("version = 1\n[defaults.speculative]\nwindows_in_flight = 2\n")
    assert load_config(path).defaults.frames_in_flight == 2
    assert "is now frames_in_flight" in caplog.text
    path.write_text("version = 1\n[defaults.speculative]\nwindows_in_flight = 2\nframes_in_flight = 3\n")
    with pytest.raises(ConfigError, match="old name of frames_in_flight"):
        load_config(path)


def _with_mtp(m):
    """`m` as if its model carried one MTP layer (the artifact is never read by the plan)."""
    return dataclasses.replace(m, mtp_layers=(dataclasses.replace(m.layers[-1], layer_index=m.layer_count),))


def test_mtp_is_a_built_in_strategy_for_a_package_with_mtp_layers(manifest):
    plan, _ = resolve_plan(Speculative(strategy="mtp"), False, Config(), NAMES, _with_mtp(manifest))
    assert plan is not None
    assert plan.mtp is not None
    assert plan.mtp.policy == "cost-aware"
    assert plan.draft_model is None
    assert plan.ngram is None
    assert plan.describe() == ("mtp (the model's 1 MTP layer(s) at the final stage), cost-aware 3 [1,8], "
                               "frames in flight: auto")
    both, _ = resolve_plan(Speculative(strategy="ngram+mtp", initial_window=2), False, Config(), NAMES,
                           _with_mtp(manifest))
    assert both is not None
    assert both.ngram is not None
    assert both.mtp is not None
    assert both.mtp.initial == 2


def test_mtp_without_mtp_layers_is_refused_by_name(manifest):
    with pytest.raises(ConfigError, match="needs MTP layers, and the package carries none"):
        resolve_plan(Speculative(strategy="mtp"), False, Config(), NAMES, manifest)


def test_auto_picks_mtp_only_where_the_package_declares_no_draft(manifest):
    bare = dataclasses.replace(_with_mtp(manifest), generation={})
    plan, _ = resolve_plan(Speculative(), False, Config(), NAMES, bare)
    assert plan is not None
    assert plan.mtp is not None
    drafted, _ = resolve_plan(Speculative(), False, Config(), NAMES, _with_mtp(manifest))
    assert drafted is not None
    assert drafted.mtp is None
    assert drafted.draft_model == "org/draft:Q4_0"
    off, note = resolve_plan(Speculative(), True, Config(), NAMES, bare)
    assert off is None
    assert note == "off (--no-draft)"
