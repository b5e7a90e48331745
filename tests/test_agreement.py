"""mesh bench --scenarios agreement: a teacher-forced target, its drafts and its own early exits."""

from __future__ import annotations

from pathlib import Path

import pytest
from models import write_tiny_llama

from mesh.bench import agreement

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
