"""A short calibration decode of a loaded range, for the planner (DESIGN.md §3, where to cut).

Run once at Load, before the stage serves: a warm-up and 5 single-row decodes on lane 0,
5 decodes of several rows (one per lane where the lanes allow, as concurrent sessions batch),
and the work a stage does per decode besides its layers (packing hidden states for the wire,
or sampling at the final stage). Every lane it used is emptied afterwards, so no KV is left
behind and later generations compute exactly as without it. It works through the engine's
own interface (step, trim), so every engine calibrates the same way.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from common.sampling import SamplingParams
from proto import meshpipe_pb2 as pb
from stage.engine import RangeEngine, Step
from stage.sampling import sample_rows
from stage.transport import encode_tensor

# decodes timed of each size (single-row after one warm-up). The fastest counts: other work on
# the machine only ever adds time, and stages calibrate one after another, at different moments
REPEATS = 5
BATCH_ROWS = 4  # rows in the one multi-row decode: eight streams on two groups batch four


@dataclass(frozen=True)
class Calibration:
    """What the stage measured, in seconds."""

    single_s: float  # one decode of one row, the fastest of REPEATS
    batch_s: float  # one decode of `batch_rows` rows, the fastest of REPEATS
    batch_rows: int
    fixed_s: float  # per decode, outside the layers: framing, or sampling at the final stage
    work_layers: float  # the range's work in layers, the head counted as the layers it is worth

    @property
    def per_layer_s(self) -> float:
        return self.single_s / self.work_layers if self.work_layers > 0 else 0.0

    def to_wire(self) -> pb.Calibration:
        return pb.Calibration(single_us=self.single_s * 1e6, batch_us=self.batch_s * 1e6,
                              batch_rows=self.batch_rows, fixed_us=self.fixed_s * 1e6,
                              per_layer_us=self.per_layer_s * 1e6)


def calibration_of(reply: pb.Calibration, work_layers: float) -> Calibration | None:
    """A stage's reported calibration; None when it sent none (an older stage)."""
    if reply.batch_rows == 0:
        return None
    return Calibration(reply.single_us / 1e6, reply.batch_us / 1e6, reply.batch_rows,
                       reply.fixed_us / 1e6, work_layers)


def calibrate(engine: RangeEngine, work_layers: float, wire_dtype: int = pb.F32) -> Calibration:
    """Time the range on scratch lanes, then empty them. Call before the stage serves:
    a lane in use would lose its KV."""
    lanes = list(range(min(engine.lanes, BATCH_ROWS)))
    per_lane = -(-BATCH_ROWS // len(lanes))  # one row a lane when there are lanes enough
    rng = np.random.default_rng(0)
    try:
        # every decode starts at position 0, trimming the one before: the smallest context will do
        single = [_timed(engine, [_step(engine, 0, 1, rng)]) for _ in range(REPEATS + 1)][1:]
        batch = [_step(engine, lane, per_lane, rng) for lane in lanes]
        batch_s = min(_timed(engine, batch) for _ in range(REPEATS))
        fixed_s = _fixed_cost(engine, engine.step(batch), wire_dtype)
    finally:
        for lane in lanes:
            engine.trim(lane, 0)
    return Calibration(min(single), batch_s, per_lane * len(lanes), fixed_s, work_layers)


def _step(engine: RangeEngine, lane: int, rows: int, rng: np.random.Generator) -> Step:
    if engine.first:
        return Step(lane, 0, tokens=np.ones(rows, dtype=np.int32))
    hidden = rng.standard_normal((rows, engine.width)).astype(np.float32)
    return Step(lane, 0, hidden=hidden)


def _timed(engine: RangeEngine, steps: list[Step]) -> float:
    began = time.perf_counter()
    engine.step(steps)
    return time.perf_counter() - began


def _fixed_cost(engine: RangeEngine, outputs: list[np.ndarray], wire_dtype: int) -> float:
    """What the stage pays per decode of these rows besides its layers: greedy sampling of
    every output row at the final stage, packing hidden states for the wire elsewhere."""
    began = time.perf_counter()
    for out in outputs:
        if engine.final:
            sample_rows(out, SamplingParams(), 0, len(out))
        else:
            encode_tensor(out, wire_dtype)
    return time.perf_counter() - began
