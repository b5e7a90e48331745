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
