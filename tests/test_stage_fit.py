"""A plan is checked against each stage's engine and memory before any stage prepares (issue 17).

The sizes are read from real packages: SmolLM2 Q4_1 (its KV width checked against the
model's 3 KV heads of 64) and Gemma-3 Q4_K_M, whose K-quant tensors MLX cannot read.
"""

from __future__ import annotations

import subprocess
import sys

import psutil
import pytest

from mesh.routing.planner import StageRange
from mesh.routing.stage_fit import StageNeed, footprint, misfits, package_sizes
from packages.manifest import load_manifest
from stage.engine_choice import LLAMA, MLX

pytestmark = pytest.mark.mesh  # the packages are built from real GGUFs
MIB = 1 << 20


@pytest.fixture(scope="module")
def smol(smollm2_package):
    return package_sizes(smollm2_package, load_manifest(smollm2_package)[0])


def test_sizes_are_read_from_the_package(smol):
    assert len(smol.layer_weights) == 30
    assert set(smol.layer_kv) == {2 * 3 * 64}  # keys and values, 3 KV heads of 64
    assert smol.tied
    assert smol.embeddings > 20 * MIB


def test_the_engine_sets_the_kv_bytes_and_the_ends_hold_the_embeddings(smol):
    middle, first, last = StageRange(10, 20), StageRange(0, 10), StageRange(20, 30)
    llama, mlx = (footprint(smol, middle, e, lanes=4, ctx=2048) for e in (LLAMA, MLX))
    assert llama.kv == 4 * 2048 * 2 * 10 * 384
    assert mlx.kv == 2 * llama.kv
    assert llama.weights == mlx.weights == sum(smol.layer_weights[10:20])
    assert (llama.overhead, mlx.overhead) == (LLAMA.overhead, MLX.overhead)
    for ends in (first, last):
        assert footprint(smol, ends, LLAMA, 4, 2048).weights >= sum(smol.layer_weights[ends.start:ends.end]) \
            + smol.embeddings
    assert (LLAMA.kv_bytes, MLX.kv_bytes) == (2, 4)


def test_a_plan_that_fits_has_no_misfits(smol):
    needs = [StageNeed("stage 0", StageRange(0, 19), LLAMA, 8 << 30, "a"),
             StageNeed("stage 1", StageRange(19, 30), MLX, 8 << 30, "b")]
    assert misfits(smol, needs, 4, 2048) == []


def test_a_short_machine_is_named_with_what_each_stage_needs(smol):
    need = footprint(smol, StageRange(19, 30), MLX, 4, 2048).total
    needs = [StageNeed("stage 0", StageRange(0, 19), LLAMA, 8 << 30, "a"),
             StageNeed("stage 1 (10.0.0.2:7070)", StageRange(19, 30), MLX, need - 1, "b")]
    [problem] = misfits(smol, needs, 4, 2048)
    assert problem.startswith("stage 1 (10.0.0.2:7070) [19,30) on mlx: ")
    assert "at 4 lanes of 2048 tokens" in problem
    assert "lower --lanes or --ctx-size" in problem
    needs[1] = StageNeed("stage 1", StageRange(19, 30), MLX, need, "b")
    assert misfits(smol, needs, 4, 2048) == []


def test_stages_on_one_machine_share_its_memory(smol):
    both = sum(footprint(smol, r, LLAMA, 4, 2048).total for r in (StageRange(0, 19), StageRange(19, 30)))
    needs = [StageNeed("stage 0", StageRange(0, 19), LLAMA, both - 1, "here"),
             StageNeed("stage 1", StageRange(19, 30), LLAMA, both - 1, "here")]
    [problem] = misfits(smol, needs, 4, 2048)
    assert "stage 0 [0,19)" in problem
    assert "stage 1 [19,30)" in problem


def test_mlx_is_refused_a_k_quant_range_by_tensor_and_type(gemma3_package):
    sizes = package_sizes(gemma3_package, load_manifest(gemma3_package)[0])
    layers = len(sizes.layer_weights)
    needs = [StageNeed("stage 0", StageRange(0, 6), LLAMA, 64 << 30, "a"),
             StageNeed("stage 1 (mac:7070)", StageRange(6, layers), MLX, 64 << 30, "b")]
    [problem] = misfits(sizes, needs, 1, 512)
    assert problem.startswith("stage 1 (mac:7070) runs MLX, which cannot read tensor blk.6.")
    assert " of type Q" in problem
    assert "run that stage with --engine llama" in problem
    assert misfits(sizes, [StageNeed("stage 0", StageRange(0, layers), LLAMA, 64 << 30, "a")], 1, 512) == []


def test_serve_refuses_a_plan_the_machine_cannot_hold_before_loading(tmp_path):
    """SmolLM2's KV is 23 KiB a token on llama.cpp: contexts for twice this machine's free memory."""
    ctx = 1 << 20
    lanes = min(256, -(-2 * psutil.virtual_memory().available // (30 * 384 * 2 * ctx)))
    run = subprocess.run([sys.executable, "-m", "mesh.cli", "serve", "--local-stages", "2", "--lanes", str(lanes),
                          "--ctx-size", str(ctx), "--port", "0", "--threads", "1"],
                         capture_output=True, text=True, timeout=120, env={"MESHPIPE_CACHE": str(tmp_path),
                                                                           "PATH": "/usr/bin:/bin"})
    assert run.returncode != 0
    assert "the plan does not fit: stage 0 (this process) [0," in run.stderr
    assert f"at {lanes} lanes of {ctx} tokens and the machine has" in run.stderr
