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
