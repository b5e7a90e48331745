"""`mesh bench --scenarios shapes` without a server: the model it writes has the shape asked
for, and what it generates is deleted however the run ends."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader

from bench.harness.harness import Row
from bench.harness.hybrid_model import QWEN35_MOE_35B_8, TINY_MOE
from bench.harness.machines import Machines
from bench.harness.shape_model import LLAMA_3_1_8B, Q4_0_BYTES, TINY, Shape, q4_0_bytes, write_shape_gguf
from bench.scenarios import shapes

SMALL = Shape("small", layers=3, width=128, ffn=320, heads=8, kv_heads=2, vocab=300)


def _field(reader: GGUFReader, key: str) -> object:
    return reader.fields[key].contents()


@pytest.mark.parametrize("shape", [TINY, SMALL])
def test_the_model_has_the_shape_asked_for(tmp_path: Path, shape: Shape) -> None:
    reader = GGUFReader(write_shape_gguf(tmp_path / "m.gguf", shape))
    assert _field(reader, "general.architecture") == "llama"
    assert _field(reader, "llama.block_count") == shape.layers
    assert _field(reader, "llama.embedding_length") == shape.width
    assert _field(reader, "llama.feed_forward_length") == shape.ffn
    assert _field(reader, "llama.attention.head_count") == shape.heads
    assert _field(reader, "llama.attention.head_count_kv") == shape.kv_heads
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == shape.vocab
    tensors = {t.name: t for t in reader.tensors}
    assert len(tensors) == 9 * shape.layers + 3
    for name, rows, cols in shape.matrices():
        assert tensors[name].tensor_type == GGMLQuantizationType.Q4_0
        assert list(tensors[name].shape) == [cols, rows]  # GGUF lists the row length first
    assert tensors["blk.0.attn_k.weight"].shape.tolist() == [shape.width, shape.kv_heads * shape.head_dim]
    assert tensors["output_norm.weight"].tensor_type == GGMLQuantizationType.F32
    assert sum(int(t.n_bytes) for t in reader.tensors) == shape.weight_bytes()


def test_the_8b_shape_is_llama_3_1_8b_at_about_4_6_gb() -> None:
    s = LLAMA_3_1_8B
    assert (s.layers, s.width, s.ffn, s.heads, s.kv_heads, s.head_dim, s.vocab) == (32, 4096, 14336, 32, 8, 128, 128256)
    assert 4.4e9 < s.weight_bytes() < 4.7e9


def test_blocks_are_random_with_a_small_f16_scale() -> None:
    data = q4_0_bytes(4, 64, np.random.default_rng(0))
    blocks = data.reshape(-1, Q4_0_BYTES)
    assert data.shape == (4, 2 * Q4_0_BYTES)
    scales = blocks[:, :2].copy().view(np.float16).ravel()
    assert np.all(scales == np.float16(1 / (4.6 * 8)))
    assert len(np.unique(blocks[:, 2:])) > 16  # the nibbles are random, not a pattern
    with pytest.raises(ValueError, match="multiple of 32"):
        q4_0_bytes(1, 48, np.random.default_rng(0))


def _plan(parent: Path) -> shapes.Plan:
    return shapes.Plan(TINY, Machines(("0", "1")), tokens=2, repeats=1, delays=[0.0], bins=None, parent=parent,
                       say=lambda _: None)


@pytest.mark.parametrize("error", [RuntimeError("a step failed"), KeyboardInterrupt()])
def test_a_failed_or_interrupted_run_deletes_what_it_wrote(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            error: BaseException) -> None:
    seen: list[Path] = []

    def fail(root: Path, gguf: Path, cpus: str) -> list[Row]:
        seen.append(gguf)
        assert gguf.stat().st_size > TINY.weight_bytes()  # the model was written before the failure
        raise error

    monkeypatch.setattr(shapes, "_package_rows", fail)
    with pytest.raises(type(error)):
        shapes.shapes_rows(_plan(tmp_path))
    assert seen
    assert list(tmp_path.iterdir()) == []


def test_the_generated_directory_goes_when_the_run_ends(tmp_path: Path) -> None:
    with shapes.generated_dir(tmp_path) as root:
        (root / "model.gguf").write_bytes(b"x")
    assert list(tmp_path.iterdir()) == []


def test_the_goals_table_says_which_goals_are_met() -> None:
    rows = [Row("shapes package", "write (GB/s, vs cp)", 0.6, 1.0, ">= 0.5"),
            Row("shapes memory stage 0", "peak RSS", 2.5, 2.0, "<= 1.15"),
            Row("shapes decode 0 ms", "meshpipe split-2 decode tok/s", 3.0)]
    table = shapes.goals_table(rows)
    assert "| shapes package: write (GB/s, vs cp) | 0.60 | 1.00 | 0.60 | >= 0.5 | yes |" in table
    assert "| 1.25 | <= 1.15 | NO |" in table
    assert "decode tok/s" not in table


def test_without_llama_cpp_the_rpc_column_says_why() -> None:
    assert "no --llama-cpp-bin" in shapes.skipped(None)


def test_shapes_runs_alone() -> None:
    import argparse

    from bench import run

    with pytest.raises(SystemExit, match="shapes runs alone"):
        run._shapes(argparse.Namespace(), {"shapes", "split"}, None)


def test_the_frontier_moe_shape_is_qwen35_moe_layers_with_a_random_router(tmp_path: Path) -> None:
    """`--shape qwen3.5-moe-35b-a3b-8-layers`: Qwen3.5-35B-A3B's layers, the experts one 3-D Q4_0
    tensor each, and an F32 router that is not constant (a constant one ties every expert)."""
    big = QWEN35_MOE_35B_8
    assert (big.width, big.experts, big.experts_used, big.ffn, big.shared_ffn, big.vocab) == (2048, 256, 8, 512,
                                                                                              512, 248320)
    assert shapes.SHAPES[big.name] is big
    reader = GGUFReader(TINY_MOE.write(tmp_path / "moe.gguf"))
    assert _field(reader, "general.architecture") == "qwen35moe"
    assert _field(reader, "qwen35moe.expert_count") == TINY_MOE.experts
    tensors = {t.name: t for t in reader.tensors}
    up = tensors["blk.0.ffn_up_exps.weight"]
    assert up.tensor_type == GGMLQuantizationType.Q4_0
    assert list(up.shape) == [TINY_MOE.width, TINY_MOE.ffn, TINY_MOE.experts]
    router = tensors["blk.0.ffn_gate_inp.weight"]
    assert router.tensor_type == GGMLQuantizationType.F32
    assert np.std(router.data) > 0.01


@pytest.mark.mesh
def test_the_row_cost_step_times_a_decode_and_a_verify_window(tmp_path: Path) -> None:
    """The row-cost step on the tiny MoE, as the scenario runs it: its own pinned process."""
    gguf = TINY_MOE.write(tmp_path / "moe.gguf")
    (decode, verify, per_row) = shapes.row_cost_rows(gguf, TINY_MOE.vocab, "0")
    assert decode.value > 0
    assert verify.value > 0
    assert "verify of 5 rows" in verify.metric
    assert per_row.baseline == decode.value
    assert per_row.value == pytest.approx(verify.value / 5)
