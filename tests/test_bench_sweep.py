"""The sweep scenario's arithmetic: the best fixed setting, and the controller held to the
best of every setting and no draft (bench/scenarios/sweep.py). The servers are the bench's to run."""

from __future__ import annotations

from bench.scenarios.sweep import DEFAULT, PLAIN, _rows_at, fixed


def by_metric(rows):
    return {r.metric: r for r in rows}


def test_the_controller_is_held_to_the_best_fixed_setting():
    tok_s = {PLAIN: 16.0, DEFAULT: 30.0, fixed(1, 3): 32.0, fixed(2, 3): 28.0, fixed(1, 1): 20.0}
    rows = by_metric(_rows_at(20, tok_s, {k: [v] for k, v in tok_s.items()}))
    assert rows[f"best fixed: {fixed(1, 3)}"].value == 32.0
    held = rows["defaults ÷ the best of every fixed setting and no draft"]
    assert held.ratio == 30.0 / 32.0
    assert held.goal == ">= 0.95"
    assert rows["defaults ÷ no draft"].ratio == 30.0 / 16.0


def test_where_no_setting_beats_no_draft_the_controller_is_held_to_no_draft():
    tok_s = {PLAIN: 50.0, DEFAULT: 49.0, fixed(1, 3): 36.0, fixed(1, 1): 33.0}
    rows = by_metric(_rows_at(0, tok_s, {k: [v] for k, v in tok_s.items()}))
    assert rows["defaults ÷ the best of every fixed setting and no draft"].ratio == 49.0 / 50.0
    assert all(r.scenario == "sweep split-2, 0 ms" for r in rows.values())


def test_another_pair_is_named_in_every_row():
    """--cost-realistic sweeps peers' F32 pair: its rows must not read as the package's own."""
    tok_s = {PLAIN: 12.0, DEFAULT: 18.0, fixed(1, 3): 19.6}
    rows = _rows_at(20, tok_s, {k: [v] for k, v in tok_s.items()}, "cost-realistic pair: F32 target, Q4_0 draft")
    assert {r.scenario for r in rows} == {"sweep split-2, cost-realistic pair: F32 target, Q4_0 draft, 20 ms"}


def test_the_flag_parses_for_the_sweep():
    import argparse

    from bench.run import add_parser

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    assert parser.parse_args(["bench", "--scenarios", "sweep", "--cost-realistic"]).cost_realistic
    assert not parser.parse_args(["bench", "--scenarios", "sweep"]).cost_realistic
