"""The planner covers every layer exactly once, with allowed cuts, weighted by memory."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mesh.planner import PlanError, plan_ranges


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
