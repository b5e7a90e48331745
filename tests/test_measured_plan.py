"""The planner on measured cost: cuts that balance measured time per decode, each stage's
fixed cost included, and the calibration that measures it (pure functions, a toy engine)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from toy_engine import ToyEngine

from mesh.reports.hop_timing import HopTotals
from mesh.reports.own_work import WorkMark, other_per_frame
from mesh.routing.planner import (
    LayerWork,
    PlanError,
    StageCost,
    StageRange,
    plan_measured,
    predicted_times,
    worth_recut,
)
from mesh.routing.stage_cost import cost_at, measured
from proto import meshpipe_pb2 as pb
from stage.calibration import BATCH_ROWS, Calibration, calibrate, calibration_of

# SmolLM2-135M: 30 layers of 3.54M parameters, the tied head 28.3M (8 layers' worth)
SMOL = LayerWork(tuple([3.54e6] * 30), 28.3e6)
EVERY = list(range(1, 30))


def _bounds(ranges: list[StageRange]) -> list[tuple[int, int]]:
    return [(r.start, r.end) for r in ranges]


def test_equal_costs_cut_where_parameters_do():
    ranges = plan_measured(EVERY, SMOL, [StageCost(0.0, 1e-3)] * 2)
    assert _bounds(ranges) == [(0, 19), (19, 30)]  # 19 layers against 11 and the head's 8


def test_measured_time_counts_the_active_experts_only():
    # the last 15 layers a mixture of experts with four times the parameters it multiplies
    moe = LayerWork(SMOL.costs, SMOL.head, total=SMOL.costs[:15] + tuple(c * 4 for c in SMOL.costs[15:]))
    stages = [StageCost(0.0, 1e-3)] * 2
    assert plan_measured(EVERY, moe, stages) == plan_measured(EVERY, SMOL, stages)
    assert moe.parameters(StageRange(19, 30)) == (pytest.approx(11 * 4 * 3.54e6 + 28.3e6),
                                                  pytest.approx(11 * 3.54e6 + 28.3e6))
    assert SMOL.parameters(StageRange(0, 19)) == (pytest.approx(19 * 3.54e6),) * 2  # dense: all active


def test_a_fixed_cost_moves_layers_off_that_stage():
    # stage 0 pays 2 ms a decode besides its layers (the coordinator's own work)
    ranges = plan_measured(EVERY, SMOL, [StageCost(2e-3, 1e-3), StageCost(0.0, 1e-3)])
    assert _bounds(ranges) == [(0, 18), (18, 30)]
    times = predicted_times(ranges, SMOL, [StageCost(2e-3, 1e-3), StageCost(0.0, 1e-3)])
    assert times == pytest.approx([20e-3, 20e-3], abs=0.1e-3)


def test_a_slower_stage_gets_fewer_layers():
    # stage 1's layers measured twice as slow: its machine is slower
    ranges = plan_measured(EVERY, SMOL, [StageCost(0.0, 1e-3), StageCost(0.0, 2e-3)])
    assert _bounds(ranges) == [(0, 25), (25, 30)]  # 25 ms against (5 + 8) x 2 = 26 ms


def test_the_cut_keeps_to_allowed_cuts():
    ranges = plan_measured([6, 12, 18, 24], SMOL, [StageCost(0.0, 1e-3)] * 2)
    assert _bounds(ranges) == [(0, 18), (18, 30)]
    with pytest.raises(PlanError):
        plan_measured([6], SMOL, [StageCost(0.0, 1e-3)] * 3)


@given(st.lists(st.tuples(st.floats(0.0, 5e-3), st.floats(1e-4, 5e-3)), min_size=1, max_size=4),
       st.sampled_from([1, 2, 3]))
def test_no_plan_at_the_cuts_has_a_lower_bottleneck(stages, period):
    """Against every split into contiguous ranges, for up to 4 stages: the DP is exact."""
    costs = [StageCost(f, k) for f, k in stages]
    work = LayerWork(tuple(float(1 + i % 3) for i in range(12)), 5.0)
    cuts = list(range(period, 12, period))
    if len(costs) - 1 > len(cuts):
        return
    best = max(predicted_times(plan_measured(cuts, work, costs), work, costs))
    assert best <= min(max(predicted_times(r, work, costs)) for r in _splits(cuts, len(costs))) + 1e-12


def _splits(cuts: list[int], n: int, start: int = 0) -> list[list[StageRange]]:
    if n == 1:
        return [[StageRange(start, 12)]]
    return [[StageRange(start, c), *rest] for c in cuts if c > start for rest in _splits(cuts, n - 1, c)]


def test_a_recut_needs_a_clearly_lower_bottleneck():
    assert worth_recut([10.0, 6.0], [7.5, 7.0])
    assert not worth_recut([10.0, 6.0], [8.5, 8.0])  # 15%: within a fresh engine's calibration noise


def test_cost_at_interpolates_rows_and_counts_the_engine_as_work():
    cal = Calibration(single_s=10e-3, batch_s=16e-3, batch_rows=4, fixed_s=2e-3, work_layers=20.0)
    assert cost_at(cal, 4).time(20.0) == pytest.approx(18e-3)  # the batch decode and its sampling
    assert cost_at(cal, 1).time(20.0) == pytest.approx(10.5e-3)
    assert cost_at(cal, 4).time(10.0) == pytest.approx(10e-3)  # half the work: half the engine time


def test_measured_time_per_decode_from_hops():
    hops = HopTotals()
    for _ in range(4):
        hops.record(pb.DECODE, pb.Hop(stage_index=0, compute_us=5000, queue_us=9000, batch_rows=4),
                    [pb.Hop(stage_index=1, compute_us=6000, sample_us=1000, batch_rows=4)], round_trip_s=0.02)
    own, final = measured(hops, 0), measured(hops, 1)
    assert own is not None
    assert final is not None
    assert own.time_s == pytest.approx(5e-3)  # the queue is not the stage's time
    assert final.time_s == pytest.approx(7e-3)
    assert final.rows == 4
    assert measured(hops, 2) is None


@pytest.mark.parametrize(("first", "final"), [(True, False), (False, True)])
def test_calibration_times_the_range_and_leaves_no_kv(first, final):
    engine = ToyEngine(first=first, final=final)
    cal = calibrate(engine, work_layers=15.0)
    assert engine.positions == [0, 0]  # every scratch lane emptied
    assert cal.single_s > 0
    assert cal.batch_s > 0
    assert cal.fixed_s > 0
    assert cal.batch_rows == BATCH_ROWS  # two lanes: two rows each
    back = calibration_of(cal.to_wire(), 15.0)
    assert back is not None
    assert back.single_s == pytest.approx(cal.single_s)
    assert back.per_layer_s == pytest.approx(cal.single_s / 15)
    assert calibration_of(pb.Calibration(), 15.0) is None  # a stage that did not calibrate


def test_stage_0s_own_work_is_cpu_beyond_its_engines_per_frame():
    before, after = WorkMark(10.0, 4.0, 100), WorkMark(13.0, 6.0, 300)
    assert other_per_frame(before, after) == pytest.approx(1.0 / 200)  # 3 s of CPU, 2 in the engines
    assert other_per_frame(before, WorkMark(11.0, 6.0, 300)) == 0.0  # decodes that waited on a CPU lock
    assert other_per_frame(before, WorkMark(12.0, 4.0, 100)) is None  # no frames: nothing to divide by
    # as stage 0's fixed cost, it moves layers to the other stage
    cal = Calibration(single_s=10e-3, batch_s=16e-3, batch_rows=4, fixed_s=0.0, work_layers=19.0)
    plain = plan_measured(EVERY, SMOL, [cost_at(cal, 4), cost_at(cal, 4)])
    loaded = plan_measured(EVERY, SMOL, [cost_at(cal, 4, 4 * 0.5e-3), cost_at(cal, 4)])
    assert loaded[0].end < plain[0].end


def test_calibration_on_one_lane_puts_the_batch_rows_on_it():
    engine = ToyEngine(first=True, final=True)
    engine.lanes, engine.positions = 1, [0]
    cal = calibrate(engine, work_layers=30.0)
    assert cal.batch_rows == BATCH_ROWS
    assert engine.positions == [0]
