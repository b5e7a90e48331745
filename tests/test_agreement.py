"""mesh bench --scenarios agreement: a teacher-forced target, its drafts and its own early exits."""

from __future__ import annotations

from pathlib import Path

import pytest
from models import write_tiny_llama

from bench.scenarios import agreement

PROMPTS = [[1, 5, 6, 7], [1, 9, 10, 11, 12]]


@pytest.mark.parametrize("output", [True, False], ids=["own head", "tied to the embedding"])
def test_an_exit_after_every_layer_is_the_target(tmp_path: Path, output: bool) -> None:
    """The captured last residual through numpy's norm and head names the target's token: the
    capture and the head are what llama.cpp computes. Earlier exits do worse on random weights."""
    target = write_tiny_llama(tmp_path / "t.gguf", layers=4, output=output)
    a = agreement.measure(target, {}, PROMPTS, 12, threads=1)
    assert a.positions == 24
    assert a.exits[4] == agreement.Rates(1.0, 1.0)
    assert sorted(a.exits) == [1, 2, 3, 4]
    assert a.exits[1].top1 < 0.5


def test_drafts_are_fed_the_targets_tokens(tmp_path: Path) -> None:
    """The target as its own draft always agrees; a model with other weights does not."""
    target = write_tiny_llama(tmp_path / "t.gguf", layers=4)
    other = write_tiny_llama(tmp_path / "o.gguf", layers=4, seed=2)
    a = agreement.measure(target, {"self": target, "other": other}, PROMPTS, 12, threads=1)
    assert a.drafts["self"] == agreement.Rates(1.0, 1.0)
    assert a.drafts["other"].top1 < 0.5


def test_an_exits_cost_counts_its_layers_and_the_head(tmp_path: Path) -> None:
    """4 layers of 4·64² + 3·64·128 weights (q, k and v at half width for 2 of 4 kv heads)
    and a 64 x 64 head."""
    target = write_tiny_llama(tmp_path / "t.gguf", layers=4)
    a = agreement.measure(target, {}, PROMPTS[:1], 1, threads=1)
    layer = 2 * 64 * 64 + 2 * 32 * 64 + 3 * 64 * 128
    head = 64 * 64
    assert a.exit_cost[1] == pytest.approx((layer + head) / (4 * layer + head))
    assert a.exit_cost[4] == pytest.approx(1.0)


def test_the_table_names_each_draft_and_a_few_exits(tmp_path: Path) -> None:
    """A 4-layer target: exits after 1, 2, 3 and 4 layers (never after 0), the last marked as
    the check; a top-2 rate is counted among the positions the top-1 missed."""
    target = write_tiny_llama(tmp_path / "t.gguf", layers=4)
    other = write_tiny_llama(tmp_path / "o.gguf", layers=4, seed=2)
    a = agreement.measure(target, {"other": other}, PROMPTS, 12, threads=1)
    rows = agreement.rows_of(a)
    scenarios = [r.scenario for r in rows if r.metric == "top-1 is the target's token"]
    assert scenarios[0] == "agreement draft other"
    assert [s.split(" layers")[0].removeprefix("agreement exit after ") for s in scenarios[1:]] == ["1", "2", "3", "4"]
    assert scenarios[-1].endswith("(all layers: the method's check)")
    second = next(r for r in rows if r.scenario == scenarios[2] and r.metric.startswith("top-2"))
    r2 = a.exits[2]
    assert second.value == pytest.approx((r2.top2 - r2.top1) / (1 - r2.top1))
    assert rows[-1].value == 24


def test_smollm2s_thirty_layers_show_seven_exits() -> None:
    """Every fifth layer, the last but one and all: what DESIGN.md §6's table reports, and
    the only exits `measure` puts through the head."""
    assert agreement.shown_exits(30) == [5, 10, 15, 20, 25, 29, 30]
    assert agreement.shown_exits(2) == [1, 2]
