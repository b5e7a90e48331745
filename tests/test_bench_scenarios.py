"""`mesh bench`'s chat, ngram, prompt_lookup and engines scenarios: their prompts and their row maths,
without a server."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from bench import scenarios
from bench.harness.client import StreamTiming
from bench.harness.harness import Row
from bench.harness.report import proposer_totals
from bench.harness.workloads import COPY_FUNCTION, COPY_PROMPT, RENAME
from bench.run import ALONE_DELAYS, SCENARIOS, add_parser, fill_defaults
from bench.scenarios import chat, prompt_lookup
from bench.scenarios.chat import (
    ChatRecord,
    chat_ctx,
    chat_table,
    first_difference,
    opening,
    question,
    weather_log,
)
from bench.scenarios.engines import SKIPPED, Measured, engine_table, first_parting, parting_token, runnable, verdict
from bench.scenarios.ngram import (
    WORKLOADS,
    LookupRecord,
    copied_lines,
    lookup_share,
    lookup_table,
    ngram_goal,
)
from mesh.api.responses import Usage


def _words(text: str) -> int:
    return len(text.split())


def _by(rows: list[Row], metric: str) -> Row:
    return next(r for r in rows if r.metric == metric)


# -- chat ---------------------------------------------------------------------------------------

def test_the_log_reaches_its_size_and_is_the_same_every_time():
    log = weather_log(_words, 300)
    assert _words(log) >= 300
    assert _words(log) < 300 + 40  # stops at the first line past the size
    assert log == weather_log(_words, 300)


def test_only_the_first_turn_carries_the_document_and_each_repeat_opens_its_own_conversation():
    assert "DOC" in question(0, "DOC")["content"]
    assert all("DOC" not in question(t, "DOC")["content"] for t in range(1, chat.TURNS))
    assert opening(0) != opening(1)


def test_the_chat_context_holds_the_last_turn_and_is_never_below_the_default():
    assert chat_ctx(128) == 2048
    big = chat_ctx(512)
    assert big % 256 == 0
    assert big >= chat.DOCUMENT_TOKENS + chat.TURNS * 512


def _chat_record(cached: bool) -> ChatRecord:
    record = ChatRecord()
    for turn in range(chat.TURNS):
        record.ttft["no cache"][turn] += [1.0 + turn, 3.0 + turn]
        record.ttft["cache"][turn] += [0.1, 0.3]
        record.prompt_tokens[turn] += [1000 + 50 * turn] * 2
        if cached:
            record.cached[turn] += [990, 990]
    record.replies = {"cache": ["a", "b"], "no cache": ["a", "b"]}
    return record


def test_chat_rows_hold_turn_four_to_the_goal_and_say_whether_replies_matched():
    rows = chat_table("chat", _chat_record(cached=False))
    last = _by(rows, "turn 4 TTFT, prefix cache (s) (vs none)")
    assert (last.value, last.baseline, last.goal) == (pytest.approx(0.2), 5.0, "<= 0.15")
    assert last.ratio == pytest.approx(0.04)
    assert _by(rows, "turn 1 TTFT, prefix cache (s) (vs none)").goal == ""
    assert _by(rows, "turn 4 prompt tokens").value == 1150
    assert not [r for r in rows if "cached tokens" in r.metric]  # not reported: no row
    assert _by(rows, "greedy outputs identical, cache vs none (1 = yes)").value == 1.0


def test_chat_rows_report_cached_tokens_when_the_server_does_and_catch_a_changed_reply():
    record = _chat_record(cached=True)
    record.replies["cache"][1] = "c"
    rows = chat_table("chat", record)
    assert _by(rows, "turn 2 cached tokens").value == 990
    assert _by(rows, "greedy outputs identical, cache vs none (1 = yes)").value == 0.0
    assert _by(rows, "first turn whose reply differs (0: none)").value == 2


def test_the_first_difference_is_the_earliest_turn_in_any_repeat():
    same = ["a"] * (2 * chat.TURNS)
    assert first_difference({"cache": same, "no cache": same}) == 0
    changed = [*same]
    changed[chat.TURNS + 2] = "b"  # repeat 2, turn 3
    changed[3] = "b"  # repeat 1, turn 4
    assert first_difference({"cache": changed, "no cache": same}) == 3


# -- ngram --------------------------------------------------------------------------------------

def test_lookup_share_counts_the_tokens_that_follow_an_earlier_occurrence():
    assert lookup_share([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6]) == pytest.approx(3 / 6)  # 4, 5, 6 follow 1 2 3...
    assert lookup_share([1, 2, 3, 4], [9, 8, 7, 6]) == 0.0
    assert lookup_share([1, 2, 3, 4], [1, 2, 3, 7]) == 0.0  # 1 2 3 was followed by 4, not 7
    assert lookup_share([5, 5, 5, 5], [5, 5]) == 1.0  # the latest occurrence may overlap the output
    assert lookup_share([5, 5, 5], [5, 5]) == 0.5  # the first: 5 5 5 has no earlier occurrence
    assert lookup_share([1, 2], []) == 0.0


def test_copied_lines_accepts_the_function_renamed_or_not():
    assert copied_lines(COPY_FUNCTION, COPY_FUNCTION) == 1.0
    assert copied_lines(COPY_FUNCTION, COPY_FUNCTION.replace(*RENAME)) == 1.0
    assert copied_lines(COPY_FUNCTION, "def other():\n    return 1\n") == 0.0


def test_the_copy_workload_gives_the_function_whole():
    assert COPY_FUNCTION in WORKLOADS["copy-heavy"]
    assert RENAME[0] in COPY_FUNCTION


def test_ngram_goals_follow_the_issue():
    assert ngram_goal("copy-heavy", 0) == ">= 1.5"
    assert ngram_goal("copy-heavy", 20) == ">= 3.0"
    assert ngram_goal("copy-heavy", 5) == ""
    assert ngram_goal("novel", 0) == ">= 0.97"
    assert ngram_goal("novel", 20) == ""


def _timing(tps: float, text: str = "same", usage: dict | None = None) -> StreamTiming:
    """11 tokens, the last 10 / tps seconds after the first; usage as a server sends it."""
    spec = Usage.model_validate({"prompt_tokens": 1, "completion_tokens": 11, "total_tokens": 12, **(usage or {})})
    return StreamTiming(0.1, (0.0, 10.0 / tps), 11, spec.speculative, text, usage or {})


def test_proposer_totals_sum_each_proposer_over_requests():
    totals = proposer_totals([{"ngram": {"proposed": 4.0, "accepted": 3.0}},
                              {"ngram": {"proposed": 2.0, "accepted": 1.0}, "draft": {"proposed": 5.0}}, {}])
    assert totals == {"ngram": (6.0, 4.0), "draft": (5.0, 0.0)}


def test_stream_timing_reads_what_a_newer_server_adds_to_usage():
    ngram = {"windows": 1, "proposed": 3, "accepted": 2, "accept_rate": 0.67}
    usage = {"prompt_tokens_details": {"cached_tokens": 12},
             "speculative": {**ngram, "mean_window": 3.0, "by_proposer": {"ngram": ngram}}}
    t = _timing(10.0, usage=usage)
    assert t.cached_tokens == 12
    assert t.by_proposer == {"ngram": {"windows": 1.0, "proposed": 3.0, "accepted": 2.0, "accept_rate": 0.67}}
    assert _timing(10.0).cached_tokens is None
    assert _timing(10.0).by_proposer == {}


def _lookup_record(ngram_text: str = "same") -> LookupRecord:
    record = LookupRecord()
    speed = {"none": 10.0, "ngram": 20.0, "ngram+draft": 25.0, "draft": 12.0}
    ngram = {"windows": 2, "proposed": 8, "accepted": 6, "accept_rate": 0.75}
    draft = {"windows": 2, "proposed": 4, "accepted": 2, "accept_rate": 0.5}
    combined = {"speculative": {"windows": 4, "proposed": 12, "accepted": 8, "accept_rate": 0.667,
                                "mean_window": 3.0, "by_proposer": {"ngram": ngram, "draft": draft}}}
    for mode, tps in speed.items():
        for workload in WORKLOADS:
            text = ngram_text if mode == "ngram" else "same"
            record.timings[(mode, workload)] = [_timing(tps, text, combined if mode == "ngram+draft" else None)]
    return record


def test_lookup_rows_compare_every_mode_with_no_speculation():
    rows = lookup_table("ngram 20 ms", 20.0, _lookup_record())
    copy = [r for r in rows if r.scenario == "ngram 20 ms copy-heavy"]
    ngram = _by(copy, "n-gram tok/s (vs none)")
    assert ngram.ratio == pytest.approx(2.0)
    assert ngram.goal == ">= 3.0"
    assert _by(copy, "n-gram + draft (vs the better alone)").ratio == pytest.approx(1.25)
    assert _by(copy, "ngram+draft: accept rate").value == pytest.approx(8 / 12)
    assert _by(copy, "ngram+draft: ngram accept rate").value == pytest.approx(0.75)
    assert _by(copy, "ngram+draft: ngram share of accepted tokens").value == pytest.approx(0.75)
    assert _by(copy, "ngram+draft: draft share of accepted tokens").value == pytest.approx(0.25)
    assert _by(copy, "ngram: accept rate (nothing proposed)").value == 0.0  # no usage.speculative
    assert not [r for r in copy if r.metric.startswith("ngram: ngram")]  # one proposer: no breakdown
    assert _by(rows, "outputs identical to no speculation (greedy; novel: seeded sampling) (1 = yes)").value == 1.0


def test_lookup_rows_catch_a_reply_speculation_changed():
    rows = lookup_table("ngram 0 ms", 0.0, _lookup_record(ngram_text="different"))
    assert _by(rows, "outputs identical to no speculation (greedy; novel: seeded sampling) (1 = yes)").value == 0.0


# -- prompt_lookup ------------------------------------------------------------------------------

def test_prompt_lookup_decodes_the_same_copy_heavy_message_as_ngram():
    assert WORKLOADS["copy-heavy"] == COPY_PROMPT


def _copy_timings(ngram_text: str = "same") -> dict[str, list[StreamTiming]]:
    ngram = {"speculative": {"windows": 4, "proposed": 20, "accepted": 15, "accept_rate": 0.75, "mean_window": 5.0}}
    return {"none": [_timing(10.0), _timing(12.0), _timing(11.0)],
            "ngram": [_timing(25.0, ngram_text, ngram), _timing(20.0, usage=ngram), _timing(30.0, usage=ngram)]}


def test_prompt_lookup_rows_hold_ngram_to_twice_no_speculation_and_give_its_accept_rate():
    rows = prompt_lookup.lookup_rows("prompt_lookup copy-heavy split-2 0 ms", _copy_timings())
    assert [r.metric for r in rows] == ["no speculation decode tok/s", "n-gram tok/s (vs none)", "n-gram accept rate",
                                        "outputs identical to no speculation (greedy) (1 = yes)"]
    ngram = _by(rows, "n-gram tok/s (vs none)")
    assert (ngram.value, ngram.baseline, ngram.goal) == (pytest.approx(25.0), pytest.approx(11.0), ">= 2.0")
    assert _by(rows, "n-gram accept rate").value == pytest.approx(0.75)
    assert _by(rows, "outputs identical to no speculation (greedy) (1 = yes)").value == 1.0


def test_prompt_lookup_rows_catch_a_changed_reply_and_a_proposer_that_proposed_nothing():
    timings = _copy_timings(ngram_text="different")
    timings["ngram"] = [_timing(t.decode_tps, t.text) for t in timings["ngram"]]  # no usage.speculative
    rows = prompt_lookup.lookup_rows("prompt_lookup", timings)
    assert _by(rows, "outputs identical to no speculation (greedy) (1 = yes)").value == 0.0
    assert _by(rows, "n-gram accept rate (nothing proposed)").value == 0.0


def test_prompt_lookup_alone_decodes_what_the_issue_measured_by_default():
    alone = _bench_args("--scenarios", "prompt_lookup")
    fill_defaults(alone, {"prompt_lookup"})
    assert alone.tokens == 200
    assert ALONE_DELAYS[frozenset({"prompt_lookup"})] == "0,20"
    given = _bench_args("--scenarios", "prompt_lookup", "--tokens", "24")
    fill_defaults(given, {"prompt_lookup"})
    assert given.tokens == 24


def test_bench_refuses_an_unknown_scenario_before_loading_anything():
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["bench", "--scenarios", "chat,nope"])
    with pytest.raises(SystemExit, match="unknown scenarios: nope"):
        args.func(args)


def _bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return parser.parse_args(["bench", *argv])


def test_engines_alone_decodes_less_by_default_and_anything_given_stands():
    alone = _bench_args("--scenarios", "engines")
    fill_defaults(alone, {"engines"})
    assert (alone.tokens, alone.prompts, alone.stages) == (64, 2, "1,2")
    mixed = _bench_args("--scenarios", "engines,split", "--tokens", "32")
    fill_defaults(mixed, {"engines", "split"})
    assert (mixed.tokens, mixed.prompts, mixed.stages) == (32, 8, "1,2,3")


# -- engines ------------------------------------------------------------------------------------

def test_a_reply_equal_to_the_baseline_tokens_parts_nowhere():
    assert parting_token([b"Hel", b"lo", b" world"], "Hello world") == 0
    assert parting_token([], "") == 0


def test_the_parting_token_is_the_first_the_reply_does_not_carry_counted_from_one():
    assert parting_token([b"Hel", b"lo", b" world"], "Jello world") == 1
    assert parting_token([b"Hel", b"lo", b" world"], "Help world") == 2
    assert parting_token([b"Hel", b"lo", b" world"], "Hello there") == 3
    assert parting_token([b"Hel", b"lo"], "Hel") == 2  # shorter: parts where it ends
    assert parting_token([b"Hel", b"lo"], "Hello!") == 3  # longer: parts after the baseline's last


def test_a_character_split_across_tokens_is_compared_as_bytes():
    e_acute = "é".encode()
    assert parting_token([e_acute[:1], e_acute[1:], b"t"], "ét") == 0
    assert parting_token([e_acute[:1], e_acute[1:], b"t"], "èt") == 2  # same first byte, not the second


def test_the_verdict_names_the_earliest_parting_of_any_reply_and_how_many_part():
    assert (first_parting([0, 0]), verdict([0, 0])) == (0, "equal")
    assert (first_parting([0, 9, 5]), verdict([0, 9, 5])) == (5, "parts at token 5 (2 of 3 replies part)")


def test_without_mlx_only_the_llama_meshes_run():
    assert list(runnable(mlx=False)) == ["llama", "llama→llama"]
    assert len(runnable(mlx=True)) == 6
    assert "pip install 'meshpipe[mlx]'" in SKIPPED


def _measured(tps: float, base: float, partings: list[int]) -> Measured:
    return Measured(tps=[tps, tps + 2], ttft=[0.5, 0.7], base_tps=[base, base + 2], base_ttft=[0.1, 0.1],
                    partings=partings)


def test_engine_rows_hold_each_mesh_to_the_baseline_beside_it_and_compare_the_engines():
    record = {"llama": _measured(49.0, 99.0, [0, 0]), "mlx": _measured(6.0, 79.0, [0, 7])}
    rows = engine_table(record, 64, 46)
    base = _by(rows, "single-node llama.cpp decode tok/s")
    assert base.value == pytest.approx(90.0)  # the median of every baseline sample
    mlx = [r for r in rows if r.scenario == "engines mlx"]
    assert (mlx[0].value, mlx[0].baseline) == (7.0, 80.0)
    assert mlx[1].metric.startswith("TTFT 46-token chat prompt")
    assert mlx[2].value == 7.0
    assert "parts at token 7 (1 of 2 replies part)" in mlx[2].metric
    assert "equal" in [r for r in rows if r.scenario == "engines llama"][2].metric
    whole = _by(rows, "whole model on one stage, MLX decode tok/s (vs llama.cpp)")
    assert whole.ratio == pytest.approx(7.0 / 50.0)


def test_engine_rows_leave_out_the_engine_line_without_both_engines():
    rows = engine_table({"llama": _measured(49.0, 99.0, [0])}, 64, 46)
    assert not [r for r in rows if r.scenario == "engines mlx vs llama"]


# -- the runner ---------------------------------------------------------------------------------

def test_the_runner_lists_each_module_of_bench_scenarios_once() -> None:
    """bench/run.py's table of contents and bench/scenarios/ agree: one module per --scenarios name
    (`return_` for return, a keyword, and `kv_tier` for kvtier), each listed once."""
    folder = Path(scenarios.__file__).parent
    modules = sorted({"kv_tier": "kvtier"}.get(p.stem, p.stem.removesuffix("_")) for p in folder.glob("*.py")
                     if p.stem != "__init__")
    assert sorted(SCENARIOS) == modules
    assert len(set(SCENARIOS)) == len(SCENARIOS)
