"""The planner covers every layer exactly once, with allowed cuts, weighted by memory."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from moe_package import DENSE, EXPERT_WEIGHTS, EXPERTS, MOE, MOE_ACTIVE, write_moe_package

from mesh.routing.planner import PlanError, StageRange, plan_ranges
from mesh.routing.route import RemoteStage, Route, RouteError, RouteSettings, _plan
from mesh.routing.stage_fit import footprint, package_sizes
from packages.manifest import load_manifest
from packages.parameters import EXPERT_TENSORS, layer_parameters, package_parameters
from proto import meshpipe_pb2 as pb
from stage.engine_choice import LLAMA

SETTINGS = RouteSettings(token=None, cache_dir=Path("/nonexistent"), lanes=2, ctx_size=64, batch=8, threads=1)


@st.composite
def problems(draw):
    layers = draw(st.integers(1, 80))
    period = draw(st.sampled_from([1, 1, 2, 6]))
    cuts = list(range(period, layers, period))
    stages = draw(st.integers(1, len(cuts) + 1))
    weights = draw(st.lists(st.floats(0.1, 64.0), min_size=stages, max_size=stages))
    return layers, cuts, weights


@given(problems())
def test_every_layer_assigned_exactly_once(problem):
    layers, cuts, weights = problem
    ranges = plan_ranges(layers, cuts, weights)
    assert len(ranges) == len(weights)
    covered = [layer for r in ranges for layer in range(r.start, r.end)]
    assert covered == list(range(layers))
    assert all(r.layers > 0 for r in ranges)
    assert all(r.start in cuts for r in ranges[1:])


def test_weights_follow_memory():
    small, big = plan_ranges(30, list(range(1, 30)), [1.0, 2.0])
    assert (small.layers, big.layers) == (10, 20)


def test_gemma_cuts_are_respected():
    ranges = plan_ranges(18, [6, 12], [1.0, 1.0])
    assert [(r.start, r.end) for r in ranges] == [(0, 6), (6, 18)] or \
        [(r.start, r.end) for r in ranges] == [(0, 12), (12, 18)]


def test_too_many_stages_is_an_error():
    with pytest.raises(PlanError, match="only 2 allowed cuts"):
        plan_ranges(18, [6, 12], [1.0] * 4)


def test_the_output_head_counts_as_work_of_the_final_stage():
    # SmolLM2-135M: 3.54M parameters a layer, a head of 28.3M (49152 x 576): 8 layers' worth
    ranges = plan_ranges(30, list(range(1, 30)), [1.0, 1.0], costs=[3.54] * 30, head=28.3)
    assert [(r.start, r.end) for r in ranges] == [(0, 19), (19, 30)]
    three = plan_ranges(30, list(range(1, 30)), [1.0] * 3, costs=[3.54] * 30, head=28.3)
    assert [r.layers for r in three] == [13, 12, 5]


def test_uneven_layer_costs_move_the_cut():
    ranges = plan_ranges(4, [1, 2, 3], [1.0, 1.0], costs=[3.0, 1.0, 1.0, 1.0])
    assert [(r.start, r.end) for r in ranges] == [(0, 1), (1, 4)]
    with pytest.raises(PlanError, match="3 layer costs for 4 layers"):
        plan_ranges(4, [1, 2, 3], [1.0, 1.0], costs=[1.0] * 3)


@given(problems())
def test_even_costs_and_no_head_plan_as_layer_counts_do(problem):
    layers, cuts, weights = problem
    assert plan_ranges(layers, cuts, weights, costs=[2.5] * layers) == plan_ranges(layers, cuts, weights)


# A mixture of experts (issue 40): a stage holds every expert, a decode multiplies the active ones.


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return write_moe_package(tmp_path_factory.mktemp("moe"))


def test_expert_layers_count_the_used_share_of_their_experts_as_active(moe, tmp_path):
    p = package_parameters(*moe)
    assert p.total == (DENSE, DENSE, MOE, MOE, MOE, MOE)
    assert p.active == (DENSE, DENSE, MOE_ACTIVE, MOE_ACTIVE, MOE_ACTIVE, MOE_ACTIVE)  # router always active
    assert layer_parameters(*moe) == (list(p.active), p.head)  # the planner's work
    per_layer = package_parameters(*write_moe_package(tmp_path, used=[0, 0, 1, 2, 4, EXPERTS]))
    assert per_layer.active[2:] == tuple(MOE - EXPERT_WEIGHTS + EXPERT_WEIGHTS * k / EXPERTS for k in (1, 2, 4, 8))
    assert {"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_up_exps", "ffn_down_chexps"} <= EXPERT_TENSORS
    assert not {"ffn_gate_inp", "ffn_up_shexp", "ffn_norm_exps"} & EXPERT_TENSORS


def test_a_dense_model_is_all_active(tiny_package):
    p = package_parameters(tiny_package, load_manifest(tiny_package)[0])
    assert p.active == p.total
    assert len(p.total) == 4


def test_the_plan_cuts_on_active_work_and_fits_on_all_the_bytes(moe):
    package_dir, manifest = moe
    stage = RemoteStage("10.0.0.2:7070", status=pb.StatusReply(mem_available_bytes=8 << 30, engine="llama"))
    route = Route(package_dir, manifest, "0" * 64, SETTINGS, stages=[stage])
    said: list[str] = []
    ranges = asyncio.run(_plan(route, [1.0, 1.0], 8 << 30, (), said.append))
    # on all parameters the MoE stage would get [4,6); on active ones it takes a layer more
    p = package_parameters(package_dir, manifest)
    assert plan_ranges(6, range(1, 6), [1.0, 1.0], p.total, p.head)[1] == StageRange(4, 6)
    assert ranges == [StageRange(0, 3), StageRange(3, 6)]
    assert said == ["plan (parameters): [0,3), [3,6)"]
    assert route.work is not None
    assert route.work.parameters(ranges[1]) == (3 * MOE + p.head, 3 * MOE_ACTIVE + p.head)
    sizes = package_sizes(package_dir, manifest)
    assert sizes.layer_weights[2:] == (4 * MOE,) * 4  # f32: every expert's bytes
    need = footprint(sizes, ranges[1], LLAMA, SETTINGS.lanes, SETTINGS.ctx_size).total
    stage.status = pb.StatusReply(mem_available_bytes=need - 1, engine="llama")  # room for the active experts only
    with pytest.raises(RouteError, match=r"stage 1 \(10.0.0.2:7070\) \[3,6\) on llama"):
        asyncio.run(_plan(route, [1.0, 1.0], 8 << 30, (), said.append))
