"""`mesh bench --scenarios hybrid` (bench/scenarios/hybrid.py): its model, its checkpoint rows on
the tiny shape of that model, and its speed rows (no server: the servers' part is the bench's)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bench.harness.client import StreamTiming
from bench.harness.hybrid_model import QWEN35_1B, TINY_HYBRID, write_hybrid_gguf
from bench.scenarios.hybrid import checkpoint_rows, speed_rows
from mesh.api.responses import SpeculativeUsage
from stage.engine import EngineConfig, Step
from stage.llama_engine import LlamaRangeEngine


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hybrid_gguf(tmp_path_factory.mktemp("hybrid") / "tiny.gguf", TINY_HYBRID)


def test_the_model_is_a_hybrid_whose_state_is_what_the_shape_says(tiny: Path) -> None:
    engine = LlamaRangeEngine(tiny, EngineConfig(first=True, final=True, lanes=1, ctx_per_lane=64, threads=1))
    try:
        assert engine.recurrent is not None  # llama.cpp takes it for a hybrid
        logits = engine.step([Step(0, 0, tokens=np.arange(1, 9, dtype=np.int32))])[0]
        assert np.isfinite(logits).all()
        header = len(engine.recurrent.save(0)) - TINY_HYBRID.state_bytes()
        assert 0 < header < 256  # llama.cpp's cell count, position and sizes besides the F32 state
    finally:
        engine.close()
    assert 19e6 < QWEN35_1B.state_bytes() < 21e6  # the bench's model: about 20 MB a lane


def test_checkpoint_rows_price_a_save_and_a_load_against_the_frame(tiny: Path) -> None:
    rows = {r.metric: r for r in checkpoint_rows(tiny)}
    ratio = rows["save + load (vs the frame's decode)"]
    assert ratio.goal == "<= 0.1"
    assert ratio.ratio is not None
    assert ratio.ratio > 0
    assert rows["state a lane (MB)"].value == pytest.approx(TINY_HYBRID.state_bytes() / 1e6, rel=0.01)


def _timing(tps: float, text: str = "same", proposed: int = 0, accepted: int = 0) -> StreamTiming:
    usage = SpeculativeUsage(windows=1, proposed=proposed, accepted=accepted, accept_rate=accepted / proposed,
                             mean_window=proposed) if proposed else None
    return StreamTiming(0.1, (0.0, 10 / tps), 11, usage, text)


def test_speed_rows_hold_the_greedy_self_draft_to_its_goal_and_catch_a_changed_reply() -> None:
    timings = {"none": [_timing(10.0)], "self": [_timing(20.0, proposed=10, accepted=10)],
               "self cost-aware": [_timing(15.0, proposed=4, accepted=4)],
               "none sampled": [_timing(10.0)], "self sampled": [_timing(8.0, "other", proposed=10, accepted=1)],
               "self cost-aware sampled": [_timing(10.0)]}
    rows = {r.metric: r for r in speed_rows("hybrid split-2 20 ms", timings, ">= 1.8")}
    assert rows["greedy: self-draft tok/s (vs none)"].ratio == pytest.approx(2.0)
    assert rows["greedy: self-draft tok/s (vs none)"].goal == ">= 1.8"
    assert rows["sampled: self-draft tok/s (vs none)"].ratio == pytest.approx(0.8)
    assert rows["sampled: self-draft tok/s (vs none)"].goal == ""
    assert rows["greedy: self-draft accept rate"].value == 1.0
    assert rows["sampled: self-draft accept rate"].value == pytest.approx(0.1)
    assert rows["greedy: self-draft, outputs identical to none (1 = yes)"].value == 1.0
    assert rows["sampled: self-draft, outputs identical to none (1 = yes)"].value == 0.0
    assert rows["greedy: self-draft, cost-aware tok/s (vs none)"].goal == ""
    assert rows["sampled: self-draft, cost-aware tok/s (vs none)"].ratio == pytest.approx(1.0)
    assert rows["sampled: self-draft, cost-aware accept rate"].value == 0.0  # it proposed nothing
