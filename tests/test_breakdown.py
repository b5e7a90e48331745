"""`mesh bench --breakdown`'s per-row figures, from /metrics counters (no server)."""

from __future__ import annotations

from types import MappingProxyType

import pytest

from bench.harness.breakdown import Counters, _per_kind, compute_per_row, row_ratios

NONE = Counters(MappingProxyType({}), MappingProxyType({}), MappingProxyType({}))


def test_a_row_costs_the_stage_compute_over_the_rows_its_decodes_ran() -> None:
    """Two verify frames of 9 rows that one decode ran together each carry that decode's time
    and its 18 rows: per row the sums still give the decode's time over its 18 rows."""
    spent = {("verify", "1", "compute"): 2 * 0.072, ("decode", "1", "compute"): 4 * 0.006}
    after = Counters(MappingProxyType({"verify": 2, "decode": 4}), MappingProxyType(spent),
                     MappingProxyType({("verify", "1"): 36, ("decode", "1"): 4}))
    per_row = compute_per_row(spent, after, NONE)
    verify = dict(_per_kind("verify", 2, spent, per_row, after, NONE))
    decode = dict(_per_kind("decode", 4, spent, per_row, after, NONE))
    assert verify["verify: stage 1 compute per row (ms)"] == pytest.approx(4.0)
    assert verify["verify: stage 1 rows per decode"] == 18
    assert decode["decode: stage 1 compute per row (ms)"] == pytest.approx(6.0)
    assert row_ratios(per_row) == [("stage 1: verify row / decode row, compute", pytest.approx(4 / 6))]


def test_no_ratio_without_plain_decodes_to_compare() -> None:
    assert row_ratios({("verify", "1"): 4.0}) == []


def test_a_tokens_time_is_told_apart_by_part_and_the_rest_is_outside_the_pipeline() -> None:
    """`mesh bench --scenarios machines`: 10 decode frames, their stamps summed per part over
    both stages; what the client saw beyond them is the coordinator's own."""
    from bench.scenarios.machines import token_parts

    seconds = {("decode", "0", "compute"): 0.055, ("decode", "1", "compute"): 0.060,
               ("decode", "1", "sample"): 0.001, ("decode", "0", "codec"): 0.0002, ("decode", "1", "codec"): 0.0003,
               ("decode", "1", "queue"): 0.001, ("decode", "links", "wire"): 0.010,
               ("prefill", "0", "compute"): 0.5}  # another kind: not a token's
    after = Counters(MappingProxyType({"decode": 10, "prefill": 1}), MappingProxyType(seconds), MappingProxyType({}))
    parts = token_parts(NONE, after, token_ms=14.0)
    assert parts["engine"] == pytest.approx(11.6)
    assert parts["codec"] == pytest.approx(0.05)
    assert parts["queue"] == pytest.approx(0.1)
    assert parts["wire"] == pytest.approx(1.0)
    assert parts["outside the pipeline"] == pytest.approx(14.0 - 12.75)
