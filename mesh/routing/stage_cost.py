"""A stage's time per decode: predicted from its Load calibration, measured from hop timings.

The planner (mesh/routing/planner.py) cuts on the prediction; `/health` and `mesh status` show both,
so a plan whose prediction drifts from what the stages measure is visible (DESIGN.md §3).
"""

from __future__ import annotations

from dataclasses import dataclass

from mesh.reports.hop_timing import HopTotals
from mesh.routing.planner import StageCost
from stage.calibration import Calibration

DECODE_KINDS = ("decode", "verify")  # the frames a steady stream sends; prefill is once per request


def cost_at(cal: Calibration, rows: float, extra_fixed_s: float = 0.0) -> StageCost:
    """The stage's cost of a decode of `rows` rows. The engine's time is interpolated in rows
    between the single-row and the batch decode and counted as work: a CPU decode costs
    about its parameters (the engine's own per-decode part was 0.3 ms of 11.4 on SmolLM2,
    DESIGN.md §3). Framing or sampling, per row, is the fixed part; `extra_fixed_s` adds
    what the stage does besides (stage 0: the coordinator's own work per decode)."""
    per_row = (cal.batch_s - cal.single_s) / max(cal.batch_rows - 1, 1)
    engine = cal.single_s + max(rows - 1.0, 0.0) * per_row
    fixed = cal.fixed_s * rows / cal.batch_rows + extra_fixed_s
    return StageCost(fixed_s=fixed, per_layer_s=engine / cal.work_layers if cal.work_layers > 0 else 0.0)


@dataclass(frozen=True)
class Measured:
    """A stage's mean time per decode frame (compute, codec and sampling; not the queue)
    and the mean rows of the decodes those frames rode in."""

    time_s: float
    rows: float


def decode_frames(hops: HopTotals) -> int:
    return sum(hops.frames.get(kind, 0) for kind in DECODE_KINDS)


def measured(hops: HopTotals, stage: int) -> Measured | None:
    """Stage `stage`'s measured time per decode from the hop sums; None before any decode.
    A frame batched with others carries its whole decode's time: the mean per frame is the
    mean decode's time."""
    frames = decode_frames(hops)
    key = str(stage)
    seen = sum(hops.batch_rows.get((kind, key), 0) for kind in DECODE_KINDS)
    if not frames or not seen:
        return None
    spent = sum(hops.seconds.get((kind, key, part), 0.0)
                for kind in DECODE_KINDS for part in ("compute", "codec", "sample"))
    return Measured(spent / frames, seen / frames)


