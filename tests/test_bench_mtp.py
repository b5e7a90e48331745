"""`mesh bench --scenarios mtp` (bench/scenarios/mtp.py): its models on the tiny shape of the
bench's, its step measure and its rows (no server: the servers' part is the bench's)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from bench.harness.client import StreamTiming
from bench.harness.hybrid_model import TINY_HYBRID, write_hybrid_gguf
from bench.scenarios.mtp import ALONE, AUTO, FIXED, MTP, SHAPE, controller_table, speed_rows, step_rows
from common.sampling import Proposed
from mesh.api.responses import SpeculativeUsage
from stage.engine import EngineConfig, Step
from stage.llama_engine import LlamaRangeEngine

TINY_MTP = replace(TINY_HYBRID, name="tiny-hybrid-mtp", nextn=1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, Path]:
    root = tmp_path_factory.mktemp("mtp")
    return {agreeing: write_hybrid_gguf(root / f"tiny-{agreeing}.gguf", TINY_MTP, agreeing=agreeing)
            for agreeing in (False, True)}


def _greedy(logits: np.ndarray, _: int) -> Proposed:
    return Proposed(int(np.argmax(logits)))


def _drafts(gguf: Path) -> tuple[int, list[int]]:
    """The target's greedy token after a short prompt, and three MTP drafts after it."""
    cfg = EngineConfig(first=True, final=True, lanes=1, ctx_per_lane=64, threads=1, mtp=True)
    engine = LlamaRangeEngine(gguf, cfg)
    try:
        assert engine.mtp is not None
        assert engine.mtp.layers == 1
        logits = engine.step([Step(0, 0, tokens=np.arange(3, 19, dtype=np.int32))])[0]
        token = int(np.argmax(logits))
        return token, [d.token for d in engine.mtp_draft(0, 16, token, 3, _greedy)]
    finally:
        engine.close()


def test_the_writer_adds_an_mtp_block_that_llama_cpp_loads_and_drafts_with(tiny: dict[bool, Path]) -> None:
    assert len(_drafts(tiny[False])[1]) == 3
    assert SHAPE.blocks == SHAPE.layers + 1


def test_the_agreeing_model_and_its_mtp_layer_both_name_token_0_a_plain_piece(tiny: dict[bool, Path]) -> None:
    assert _drafts(tiny[True]) == (0, [0, 0, 0])
    reader = GGUFReader(tiny[True])
    tokens = reader.fields["tokenizer.ggml.tokens"]
    first = bytes(tokens.parts[tokens.data[0]]).decode()
    assert first == "<t0>"  # it streams text, where <unk> would stream nothing
    unk = reader.fields["tokenizer.ggml.unknown_token_id"]
    assert int(unk.parts[unk.data[0]][0]) == TINY_MTP.vocab - 1


def test_step_rows_price_an_mtp_step_against_a_decode(tiny: dict[bool, Path]) -> None:
    rows = {r.metric: r for r in step_rows(tiny[False])}
    for ratio in (rows["MTP step (vs the decode, MTP layer fed)"], rows["decode with the MTP layer fed (vs without)"]):
        assert ratio.ratio is not None
        assert ratio.ratio > 0
    plain, fed = rows["decode, 1 row, no MTP context (ms)"], rows["decode, 1 row, MTP layer fed (ms)"]
    assert len(plain.samples) == len(fed.samples) == 8


def _timing(tps: float, text: str = "same", proposed: int = 0, accepted: int = 0,
            controller: dict[str, object] | None = None) -> StreamTiming:
    usage = SpeculativeUsage(windows=1, proposed=proposed, accepted=accepted, accept_rate=accepted / proposed,
                             mean_window=proposed) if proposed else None
    raw = {"speculative": {"controller": {"mtp": controller}}} if controller else {}
    return StreamTiming(0.1, (0.0, 10 / tps), 11, usage, text, raw)


def test_the_ceiling_is_held_to_its_goal_from_20_ms_and_the_floor_s_default_at_every_delay() -> None:
    ceiling = {"none": [_timing(10.0)], MTP: [_timing(30.0, proposed=9, accepted=9)],
               FIXED: [_timing(20.0, proposed=9, accepted=9)], ALONE: [_timing(15.0, proposed=9, accepted=9)]}
    rows = {r.metric: r for r in speed_rows("c", "ceiling", 20, ceiling)}
    assert rows[f"{MTP} tok/s (vs none)"].ratio == pytest.approx(3.0)
    assert {rows[f"{m} tok/s (vs none)"].goal for m in (MTP, FIXED, ALONE)} == {">= 2.5"}
    assert rows[f"{MTP} accept rate"].value == 1.0
    assert {r.goal for r in speed_rows("c", "ceiling", 0, ceiling) if r.metric.endswith("(vs none)")} == {""}
    floor = {"none": [_timing(10.0)], MTP: [_timing(9.0, proposed=4)], AUTO: [_timing(9.9, "other")]}
    for delay in (0, 20):
        rows = {r.metric: r for r in speed_rows("f", "floor", delay, floor)}
        assert rows[f"{AUTO} tok/s (vs none)"].goal == ">= 0.98"
        assert rows[f"{MTP} tok/s (vs none)"].goal == ""
        assert rows[f"{MTP} accept rate"].value == 0.0
        assert rows[f"{AUTO}, outputs identical to none (1 = yes)"].value == 0.0


def test_the_controller_table_says_what_each_cost_aware_server_chose_last() -> None:
    off = {"window": 0, "frames_in_flight": 1, "predicted_tok_s": 9.0, "plain_tok_s": 9.0, "why": "off: no window"}
    table = controller_table([("f", AUTO, [_timing(10.0), _timing(10.0, controller=off)]),
                              ("c", FIXED, [_timing(20.0, proposed=9, accepted=9)])])
    lines = table.splitlines()
    assert lines[2].startswith(f"| f | {AUTO} (mtp) | 0 | 0.00 | 0 | 1 | 9.0 | 9.0 | off: no window |")
    assert lines[3] == f"| c | {FIXED} | 1 | 9.00 | (fixed) | | | | |"
