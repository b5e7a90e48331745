"""`mesh bench --scenarios guard`: its figures come from BENCHMARKS.md's table, and a ratio more
than 15% worse than its figure fails the run, in the direction each check counts as worse."""

from __future__ import annotations

from bench.scenarios import guard

TABLE = f"""# Benchmarks

## Something else

| {guard.LOOKUP} | 9.99 | not the guard's table |

{guard.HEADING}

| check | figure | recorded |
|---|---|---|
| {guard.LOOKUP} | 2.40 | 2026-11-27 |
| {guard.VERIFY} | 0.62 | 2026-11-27 |

## Later
| {guard.SPLIT} | 1.5 | after the table |
"""


def test_the_figures_are_read_from_the_guard_table_alone():
    assert guard.recorded(TABLE) == {guard.LOOKUP: 2.40, guard.VERIFY: 0.62}
    assert guard.recorded("# Benchmarks\n") == {}


def test_the_checked_in_benchmarks_hold_a_figure_for_every_check():
    figures = guard.recorded(guard.FIGURES.read_text())
    assert set(figures) == {guard.LOOKUP, guard.SPLIT, guard.CONSTRAINED, guard.VERIFY, guard.WORST}


def test_a_ratio_falls_only_past_fifteen_percent_worse_than_its_figure():
    assert guard.verdict(guard.LOOKUP, 2.05, 2.40) == "ok"  # 14.6% below
    assert guard.verdict(guard.LOOKUP, 2.03, 2.40) == "FELL"
    assert guard.verdict(guard.LOOKUP, 3.0, 2.40) == "ok"  # better is never a fall
    assert guard.verdict(guard.VERIFY, 0.71, 0.62) == "ok"  # less is better: 14.5% above
    assert guard.verdict(guard.VERIFY, 0.72, 0.62) == "FELL"
    assert guard.verdict(guard.VERIFY, 0.40, 0.62) == "ok"
    assert guard.verdict(guard.SPLIT, 0.5, None) == "no figure"
