"""HopTotals: per-kind sums of each stage's hop parts, and the wire time left in a round trip."""

from __future__ import annotations

import pytest

from mesh.reports.hop_timing import HopTotals, hop_parts
from proto import meshpipe_pb2 as pb


def _hop(stage: int, queue: int = 0, compute: int = 0, codec: int = 0, sample: int = 0, rows: int = 0) -> pb.Hop:
    return pb.Hop(stage_index=stage, queue_us=queue, compute_us=compute, codec_us=codec, sample_us=sample,
                  batch_rows=rows)


def test_hop_parts_are_seconds():
    assert hop_parts(_hop(0, 1, 2_000_000, 3, 500_000)) == {
        "queue": 1e-6, "compute": 2.0, "codec": 3e-6, "sample": 0.5}


def test_record_sums_by_kind_stage_and_part_and_charges_the_rest_to_the_wire():
    totals = HopTotals()
    own = _hop(0, queue=100, compute=1000, rows=3)
    down = [_hop(1, queue=200, compute=2000, codec=50, rows=3), _hop(2, compute=3000, sample=400, rows=3)]
    totals.record(pb.DECODE, own, down, round_trip_s=0.01)
    totals.record(pb.DECODE, own, down, round_trip_s=0.01)
    totals.record(pb.PREFILL, _hop(0, compute=7, rows=9))
    assert totals.frames == {"decode": 2, "prefill": 1}
    assert totals.seconds[("decode", "0", "compute")] == pytest.approx(2 * 1000e-6)
    assert totals.seconds[("decode", "1", "codec")] == pytest.approx(2 * 50e-6)
    assert totals.seconds[("decode", "2", "sample")] == pytest.approx(2 * 400e-6)
    # the round trip less the downstream stages' parts (stage 0's own hop is not in it)
    spent = (200 + 2000 + 50 + 3000 + 400) * 1e-6
    assert totals.seconds[("decode", "links", "wire")] == pytest.approx(2 * (0.01 - spent))
    assert totals.batch_rows == {("decode", "0"): 6, ("decode", "1"): 6, ("decode", "2"): 6, ("prefill", "0"): 9}
    assert ("prefill", "links", "wire") not in totals.seconds  # no round trip timed
    assert totals.seconds[("prefill", "0", "queue")] == 0.0


def test_wire_never_goes_negative_and_unknown_kinds_are_other():
    totals = HopTotals()
    totals.record(pb.VERIFY, _hop(0), [_hop(1, compute=5000)], round_trip_s=0.001)
    assert totals.seconds[("verify", "links", "wire")] == 0.0
    totals.record(pb.END, _hop(0, compute=1))
    assert totals.frames == {"verify": 1, "other": 1}
    assert ("other", "0", "compute") in totals.seconds
