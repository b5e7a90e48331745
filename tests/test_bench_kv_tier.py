"""`mesh bench --scenarios kvtier`: its sessions, its order and its row maths, without a server."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from bench.harness.harness import Row
from bench.harness.llama_cpp import SERVER, Binaries
from bench.run import add_parser, fill_defaults
from bench.scenarios import kv_tier
from bench.scenarios.kv_tier import (
    LANES2,
    LLAMA1,
    MESH1,
    SESSIONS,
    TIER2,
    TURNS,
    Record,
    Reply,
    differing,
    kv_ctx,
    kv_rows,
    kv_table,
    ledger,
    llama_binaries,
    met,
    openings,
    question,
    restart_ratios,
    rotated,
    round_robin,
    shared_prefix,
    tier_counts,
)


def _words(text: str) -> int:
    return len(text.split())


def _by(rows: list[Row], start: str) -> Row:
    return next(r for r in rows if r.metric.startswith(start))


def test_each_session_opens_with_its_own_ledger_of_the_size_asked_the_same_every_run():
    first = openings(0, _words)
    assert len(first) == SESSIONS
    systems = [o[0]["content"] for o in first]
    assert all(o[0]["role"] == "system" and len(o) == 1 for o in first)
    assert all(_words(text) >= kv_tier.SYSTEM_TOKENS for text in systems)
    assert len({text.split()[0] for text in systems}) == SESSIONS  # they differ from the first word
    assert openings(0, _words) == first
    assert {o[0]["content"] for o in openings(1, _words)}.isdisjoint(systems)  # a repeat starts afresh
    assert _words(ledger(0, 0, _words, 100)) < 100 + 40  # stops at the first line past the size


def test_turns_go_round_robin_and_every_server_goes_first_in_turn():
    order = round_robin(3, range(2))
    assert order == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert [rotated("abc", k)[0] for k in range(4)] == ["a", "b", "c", "a"]
    assert sorted(rotated("abc", 5)) == ["a", "b", "c"]
    assert question(0)["role"] == "user"
    assert question(TURNS)["content"] != question(0)["content"]


def test_the_context_holds_five_turns_and_the_ledger():
    assert kv_ctx(16) == 2048
    assert kv_ctx(300) >= kv_tier.SYSTEM_TOKENS + (TURNS + 1) * 300
    assert kv_ctx(300) % 256 == 0


def test_shared_prefix_is_the_longest_any_two_share():
    assert shared_prefix([[1, 2, 3], [1, 2, 4], [1, 5]]) == 2
    assert shared_prefix([[1, 2], [1, 2, 3]]) == 2
    assert shared_prefix([[1]]) == 0


def _record() -> Record:
    """Two sessions: the tier's later turns a fifth of its first, lanes only's equal to its first,
    one tier reply different at turn 3; turn 5 after the restart at 0.3 and 0.4 of turn 1."""
    record = Record()
    for s in range(2):
        for t in range(TURNS):
            record.replies[TIER2][(0, s, t)] = Reply(1.0 if t == 0 else 0.2, "x" if (s, t) == (1, 2) else "a", 40)
            record.replies[LANES2][(0, s, t)] = Reply(1.0, "a", 3)
            record.replies[MESH1][(0, s, t)] = Reply(0.5 if t == 0 else 0.11, "a")
            record.replies[LLAMA1][(0, s, t)] = Reply(0.5 if t == 0 else 0.10, "b")
        record.replies[TIER2][(0, s, TURNS)] = Reply(0.3 + 0.1 * s, "a", 50)
        record.replies[LANES2][(0, s, TURNS)] = Reply(1.0, "a", 3)
    record.counters["before"].append({"hits ram": 12.0, "misses": 0.0})
    record.counters["after"].append({"hits disk": 4.0})
    return record


def test_ratios_differences_and_goals():
    record = _record()
    assert restart_ratios(record, TIER2) == pytest.approx([0.3, 0.4])
    assert differing(record, TIER2, LANES2, range(TURNS)) == (1, 8)
    assert differing(record, TIER2, LANES2, [TURNS]) == (0, 2)
    rows = kv_rows(record)
    later = _by(rows, f"turns 2-{TURNS} TTFT, {TIER2}")
    assert later.ratio == pytest.approx(0.2)
    assert later.goal == "<= 0.25"
    assert _by(rows, f"turns 2-{TURNS} TTFT, {LANES2}").ratio == pytest.approx(1.0)
    assert _by(rows, "replies differing, tier vs lanes only").value == 1
    assert _by(rows, f"turn {TURNS + 1} ÷ its session's turn 1, {TIER2} (mean").value == pytest.approx(0.35)
    assert _by(rows, f"turn {TURNS + 1} ÷ its session's turn 1, {TIER2} (worst").value == pytest.approx(0.4)
    assert _by(rows, f"turns 2-{TURNS} TTFT, {MESH1}").ratio == pytest.approx(1.1)
    assert _by(rows, "tier hits disk").value == 4
    table = kv_table(record, rows)
    assert "| 1.000 | 0.200 | 0.200 | 0.200 | 0.350 |" in table  # the tier's mean TTFT by turn
    assert "| 0.200 | met |" in table
    assert "| 1.000 | not met |" in table


def test_without_llama_server_the_one_node_rows_are_meshpipes_alone():
    record = _record()
    record.replies[LLAMA1].clear()
    rows = kv_rows(record)
    mesh = _by(rows, f"turns 2-{TURNS} TTFT, {MESH1}")
    assert mesh.baseline is None
    assert mesh.goal == ""
    assert not [r for r in rows if LLAMA1 in r.metric]


def test_goals_parse():
    assert met("<= 0.25", 0.25)
    assert not met("<= 0.25", 0.3)
    assert met(">= 1", 2.0)
    assert met("== 0", 0.0)
    assert not met("== 0", 1.0)
    assert met("", 1.0) is None


def test_tier_counters_are_summed_over_stages():
    text = "\n".join([
        "# TYPE meshpipe_kv_tier_hits_total counter",
        'meshpipe_kv_tier_hits_total{stage="0",tier="ram"} 3.0',
        'meshpipe_kv_tier_hits_total{stage="1",tier="ram"} 3.0',
        'meshpipe_kv_tier_hits_total{stage="0",tier="disk"} 1.0',
        "# TYPE meshpipe_kv_tier_refills_total counter",
        "meshpipe_kv_tier_refills_total 2.0",
        "# TYPE meshpipe_kv_tier_restore_seconds_total counter",
        'meshpipe_kv_tier_restore_seconds_total{stage="0"} 0.25',
        'meshpipe_kv_tier_restore_seconds_total{stage="1"} 0.5',
        "# TYPE meshpipe_other_total counter",
        "meshpipe_other_total 9.0", ""])
    assert tier_counts(text) == {"hits ram": 6.0, "hits disk": 1.0, "refills": 2.0, "restore seconds": 0.75}


def test_llama_server_is_skipped_naming_what_is_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("MESH_LLAMA_CPP_BIN", raising=False)
    assert llama_binaries(None)[0] is None
    assert "no --llama-cpp-bin" in llama_binaries(None)[1]
    bins, why = llama_binaries(Binaries(tmp_path))
    assert bins is None
    assert str(tmp_path / SERVER) in why
    (tmp_path / SERVER).write_text("")
    monkeypatch.setenv("MESH_LLAMA_CPP_BIN", str(tmp_path))
    assert llama_binaries(None) == (Binaries(tmp_path), "")


def test_alone_it_defaults_to_short_replies():
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["bench", "--scenarios", "kvtier"])
    fill_defaults(args, {"kvtier"})
    assert args.tokens == 16
