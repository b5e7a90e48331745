"""`mesh bench --scenarios corpus` (issue 58): the held-out corpus it decodes and its row maths,
from made-up timings: no server; the model's tokenizer for a rewrite's allowance."""

from __future__ import annotations

import argparse
import json
import re
from types import SimpleNamespace
from typing import Any

import pytest
from jsonschema import Draft202012Validator

from bench.harness.client import StreamTiming, _delta_text
from bench.harness.corpus import FREE_SAMPLING, KINDS, PER_KIND, CorpusRequest, corpus
from bench.harness.corpus_modes import REWRITE_MARGIN, allowances
from bench.harness.prompts import PROMPTS
from bench.harness.workloads import COPY_FUNCTION, COPY_PROMPT, RECIPE, RECIPE_PROMPT
from bench.run import ALONE_DELAYS, SCENARIOS, add_parser, fill_defaults
from bench.scenarios.corpus import (
    MODES,
    NEVER_LOSE,
    SPECULATING,
    Timings,
    cells,
    corpus_table,
    delay_rows,
    median_goal,
    request_ratio,
)
from mesh.api.responses import ChatDelta
from mesh.api.tool_format import functions_of
from mesh.constraints.schema import schema_grammar
from mesh.constraints.tools import Marker, ToolFormat, tool_grammar
from mesh.model.tokenizer import Tokenizer

HERMES = ToolFormat("hermes", Marker("<tool_call>"), Marker("</tool_call>"))  # SmolLM2's


def _of(kind: str, requests: list[CorpusRequest] | None = None) -> list[CorpusRequest]:
    return [r for r in (requests if requests is not None else corpus()) if r.kind == kind]


def _prompt(r: CorpusRequest) -> str:
    return r.messages[-1]["content"]


def _label(r: CorpusRequest) -> str:
    """The template a request was drawn from: its name is "<kind>/<nn>-<template>"."""
    return r.name.split("/", 1)[1][3:]


# -- the corpus ---------------------------------------------------------------------------------

def test_every_kind_has_at_least_twelve_requests_with_names_of_their_own():
    requests = corpus()
    assert list(dict.fromkeys(r.kind for r in requests)) == list(KINDS) == [
        "copy-heavy", "free", "code", "nested-schema", "flat-schema", "tool-call"]
    assert PER_KIND >= 12
    assert all(len(_of(kind, requests)) == PER_KIND for kind in KINDS)
    assert len({r.name for r in requests}) == len(requests)
    assert all(r.name.startswith(f"{r.kind}/") for r in requests)
    assert all(m["role"] == "user" and m["content"] for r in requests for m in r.messages)


def test_a_seed_is_one_corpus_and_another_seed_another():
    assert corpus(7) == corpus(7)
    other = corpus(8)
    for kind in KINDS:  # every kind differs, not only one of them
        assert [_prompt(r) for r in _of(kind, corpus(7))] != [_prompt(r) for r in _of(kind, other)]


def test_no_kind_is_one_prompt_over_and_over():
    for kind in KINDS:
        prompts = [_prompt(r) for r in _of(kind)]
        assert len(set(prompts)) == len(prompts), kind
        assert len({_label(r) for r in _of(kind)}) >= 4, kind  # at least four templates a kind


def test_the_corpus_is_held_out_from_the_bench_own_cases():
    for r in corpus():
        prompt = _prompt(r)
        assert COPY_PROMPT not in prompt
        assert COPY_FUNCTION not in prompt
        assert RECIPE_PROMPT not in prompt
        assert "word_statistics" not in prompt
        assert prompt not in PROMPTS
        assert r.body.get("response_format", {}).get("json_schema", {}).get("schema") != RECIPE


@pytest.mark.parametrize("seed", [58, 1, 2, 3])
def test_a_copy_heavy_request_quotes_the_text_its_reply_copies_at_a_modest_size(seed: int):
    labels = set()
    for r in _of("copy-heavy", corpus(seed)):
        labels.add(_label(r))
        assert r.source
        assert r.source in _prompt(r)
        # 100-300 tokens of SmolLM2, at its 2.5 (JSON, INI) to 4.5 (prose) characters a token
        assert 300 <= len(r.source) <= 900, (r.name, len(r.source))
        assert r.body == {}  # greedy
    assert labels == {"rename", "typo", "json-echo", "config"}


def test_a_rewrite_may_finish_where_other_replies_stop_at_tokens(smollm2_gguf):
    """A copy-heavy reply may take its source's tokens and a margin, so the copy is not cut
    off at --tokens (every source is longer than 128); any other request stops at --tokens."""
    requests = corpus(58, 2)
    setup = SimpleNamespace(gguf=smollm2_gguf, model_id="smollm2", tokens=128)
    limits = allowances(setup, requests)  # type: ignore[arg-type]  # what allowances reads of a Setup
    tokenizer = Tokenizer(smollm2_gguf, "smollm2")
    for r in requests:
        if r.kind == "copy-heavy":
            source = len(tokenizer.tokenize(r.source, special=False, add_bos=False))
            assert source > 128
            assert limits[r.name] == source + REWRITE_MARGIN
        else:
            assert limits[r.name] == 128


@pytest.mark.parametrize("seed", [58, 1, 2, 3])
def test_the_change_asked_for_is_in_the_text_given(seed: int):
    for r in _of("copy-heavy", corpus(seed)):
        prompt = _prompt(r)
        if _label(r) == "rename":
            old = re.search(r"`(\w+)`(?: renamed)? to `(\w+)`", prompt)
            assert old
            assert re.search(rf"\b{old.group(1)}\b", r.source)
        elif _label(r) == "typo":
            typo, word = re.findall(r'"(\w+)"', prompt)[:2]
            assert re.search(rf"\b{typo}\b", r.source)
            assert typo != word
            assert sorted(typo) == sorted(word)  # two letters swapped
        elif _label(r) == "json-echo":
            key = re.search(r'"(\w+)"', prompt)
            assert key
            assert key.group(1) in json.loads(r.source)
        else:
            asked = re.search(r"(?:`(\w+)` in|Change (\w+) under) \[(\w+)\]", prompt)
            assert asked
            name, section = asked.group(1) or asked.group(2), asked.group(3)
            assert f"[{section}]" in r.source
            assert re.search(rf"^{name} = ", r.source.split(f"[{section}]")[1].split("\n\n")[0], re.MULTILINE)


def test_free_text_is_sampled_with_a_seed_of_its_own():
    seeds = []
    for r in _of("free"):
        assert r.body.items() >= FREE_SAMPLING.items()
        assert FREE_SAMPLING == {"temperature": 0.8, "top_p": 0.95}
        assert isinstance(r.body["seed"], int)
        seeds.append(r.body["seed"])
    assert len(set(seeds)) == len(seeds)
    assert all(r.body == {} for r in _of("code"))  # greedy


def _schema(r: CorpusRequest) -> dict[str, Any]:
    fmt = r.body["response_format"]
    assert fmt["type"] == "json_schema"
    assert fmt["json_schema"]["strict"] is True
    assert isinstance(fmt["json_schema"]["name"], str)
    return dict(fmt["json_schema"]["schema"])


def _lists_of_objects(schema: dict[str, Any]) -> int:
    found = 0
    for sub in schema.get("properties", {}).values():
        if sub.get("type") == "array" and sub["items"].get("type") == "object":
            found += 1 + _lists_of_objects(sub["items"])
        elif sub.get("type") == "object":
            found += _lists_of_objects(sub)
    return found


def test_schemas_are_valid_json_schema_the_server_compiles_and_vary():
    nested, flat = [_schema(r) for r in _of("nested-schema")], [_schema(r) for r in _of("flat-schema")]
    for schema in nested + flat:
        Draft202012Validator.check_schema(schema)
        assert schema_grammar(schema, "schema")  # what `mesh serve` builds a request's grammar from
        assert schema["required"] == list(schema["properties"])
        assert schema["additionalProperties"] is False
    assert all(_lists_of_objects(s) >= 1 for s in nested)
    assert any(_lists_of_objects(s) >= 2 for s in nested)  # some lists hold lists, or two lists
    for schema in flat:
        kinds = [sub.get("type", "enum") for sub in schema["properties"].values()]
        assert set(kinds) <= {"string", "integer", "number", "boolean", "enum"}
        assert "enum" in kinds
        assert len(kinds) >= 3
    assert len({json.dumps(s, sort_keys=True) for s in nested + flat}) == len(nested + flat)


def test_schema_prompts_name_every_field_asked_for():
    for r in _of("nested-schema") + _of("flat-schema"):
        for key in _schema(r)["properties"]:
            assert key.replace("_", " ") in _prompt(r), (r.name, key)


def test_tool_calls_offer_functions_in_openai_shape_with_the_one_called_among_them():
    choices = set()
    for r in _of("tool-call"):
        tools, choice = r.body["tools"], r.body["tool_choice"]
        assert 1 <= len(tools) <= 3
        assert choice in ("required", "auto")
        choices.add(choice)
        names = [t["function"]["name"] for t in tools]
        assert len(set(names)) == len(names)
        assert _label(r) in names
        for tool in tools:
            assert set(tool) == {"type", "function"}
            assert tool["type"] == "function"
            fn = tool["function"]
            assert set(fn) == {"name", "description", "parameters"}
            assert re.fullmatch(r"[a-zA-Z0-9_-]{1,64}", fn["name"])
            params = fn["parameters"]
            Draft202012Validator.check_schema(params)
            assert params["type"] == "object"
            assert set(params["required"]) <= set(params["properties"])
            assert all(p.get("description") for p in params["properties"].values())
        assert tool_grammar(functions_of(tools), choice, True, HERMES)
    assert choices == {"required", "auto"}
    assert len({len(r.body["tools"]) for r in _of("tool-call")}) >= 2  # one tool, and more


# -- the client: a tool call is a reply too -----------------------------------------------------

def test_a_tool_call_streams_as_its_name_and_arguments_without_its_id():
    head = ChatDelta(tool_calls=[{"index": 0, "id": "call_x1", "type": "function",
                                  "function": {"name": "get_weather", "arguments": ""}}])
    args = ChatDelta(tool_calls=[{"index": 0, "function": {"arguments": '{"city": "Cork"}'}}])
    assert _delta_text(head) + _delta_text(args) == 'get_weather{"city": "Cork"}'
    assert _delta_text(ChatDelta(content="hello")) == "hello"
    assert _delta_text(ChatDelta()) == ""


# -- the rows -----------------------------------------------------------------------------------

def _t(seconds: float, text: str = "same") -> StreamTiming:
    """A reply whose last chunk came `seconds` after the request."""
    return StreamTiming(0.05, (0.05, seconds), 8, text=text)


def _requests() -> list[CorpusRequest]:
    return [CorpusRequest(kind, f"{kind}/{i:02d}", [{"role": "user", "content": "x"}])
            for kind in ("copy-heavy", "nested-schema") for i in range(3)]


def _timings(speedup: dict[tuple[str, str], list[float]], text: dict[str, str] | None = None) -> Timings:
    """none takes 1 s a request a repeat; each (kind, mode) goes `speedup` times faster, one
    value a request (the same every repeat); two repeats."""
    timings: Timings = {}
    for r in _requests():
        timings[("none", r.name)] = [_t(1.0), _t(1.0)]
        index = int(r.name[-2:])
        for mode in SPECULATING:
            s = speedup.get((r.kind, mode), [1.0] * 3)[index]
            timings[(mode, r.name)] = [_t(1.0 / s, (text or {}).get(r.name, "same")), _t(1.0 / s)]
    return timings


def test_a_request_ratio_is_the_median_of_its_repeats_of_none_over_the_mode():
    assert request_ratio([_t(2.0), _t(2.0), _t(2.0)], [_t(1.0), _t(4.0), _t(0.5)]) == pytest.approx(2.0)
    assert request_ratio([_t(1.0)], [_t(1.25)]) == pytest.approx(0.8)  # slower: below 1


def test_cells_give_each_kind_and_mode_its_median_worst_and_differing_replies():
    timings = _timings({("copy-heavy", "ngram"): [3.0, 2.5, 0.9]}, {"copy-heavy/01": "changed"})
    found = cells(_requests(), timings)
    assert set(found) == {(k, m) for k in ("copy-heavy", "nested-schema") for m in SPECULATING}
    ngram = found[("copy-heavy", "ngram")]
    assert (ngram.median, ngram.worst) == (pytest.approx(2.5), pytest.approx(0.9))
    assert (ngram.differ, ngram.replies) == (1, 6)  # one reply of 3 requests x 2 repeats
    assert found[("nested-schema", "defaults")].median == pytest.approx(1.0)


def test_the_goals_are_the_issue_s():
    assert NEVER_LOSE == ">= 0.98"
    assert list(MODES) == ["none", "ngram", "defaults", "draft"]
    assert MODES["none"] == {"extra": ("--no-forced-drafts",)}
    assert MODES["defaults"] == {"strategy": "auto"}  # as mesh serve runs: prompt lookup, then the draft
    assert MODES["draft"] == {"draft": True}  # the draft alone (bench.harness.harness.serve)
    assert (median_goal("copy-heavy", "ngram", 0), median_goal("copy-heavy", "ngram", 20)) == (">= 2.0", ">= 3.0")
    assert median_goal("copy-heavy", "ngram", 5) == ""
    assert median_goal("copy-heavy", "defaults", 20) == ""
    assert (median_goal("nested-schema", "defaults", 0), median_goal("nested-schema", "defaults", 20)) == ("", ">= 1.8")
    assert median_goal("free", "ngram", 20) == ""


def test_delay_rows_hold_each_median_worst_and_reply_count_to_its_goal():
    timings = _timings({("copy-heavy", "ngram"): [3.5, 3.1, 0.97], ("nested-schema", "defaults"): [2.0, 1.9, 1.7]})
    rows = delay_rows(20.0, _requests(), timings)
    copy = {r.metric: r for r in rows if r.scenario == "corpus copy-heavy split-2 20 ms"}
    assert copy["none: whole request (s), median"].value == pytest.approx(1.0)
    median = copy["ngram speed-up over none, whole request: median of 3"]
    worst = copy["ngram speed-up over none, whole request: worst of 3"]
    assert (median.value, median.goal) == (pytest.approx(3.1), ">= 3.0")
    assert median.samples == pytest.approx([3.5, 3.1, 0.97])
    assert (worst.value, worst.goal) == (pytest.approx(0.97), ">= 0.98")
    assert copy["ngram: replies differing from none (of 6)"].value == 0
    assert copy["ngram: replies differing from none (of 6)"].goal == "== 0"
    nested = {r.metric: r for r in rows if r.scenario == "corpus nested-schema split-2 20 ms"}
    assert nested["defaults speed-up over none, whole request: median of 3"].goal == ">= 1.8"
    assert nested["ngram speed-up over none, whole request: median of 3"].goal == ""
    assert len(rows) == 2 * (1 + 3 * len(SPECULATING))


def test_the_table_marks_a_cell_that_misses_any_goal():
    timings = _timings({("copy-heavy", "ngram"): [2.2, 2.1, 1.5], ("copy-heavy", "defaults"): [1.0, 1.0, 0.97],
                        ("nested-schema", "defaults"): [1.2, 1.1, 1.0]}, {"nested-schema/02": "changed"})
    table = corpus_table(0.0, _requests(), timings).splitlines()
    assert table[2] == "| kind | ngram | defaults | draft |"
    assert table[4] == "| copy-heavy | 2.10 / 1.50 | 1.00 / 0.97 ✗ | 1.00 / 1.00 |"
    # a reply that differs from none's misses a goal whatever the speed
    assert table[5] == "| nested-schema | 1.00 / 1.00 ✗ | 1.10 / 1.00 ✗ | 1.00 / 1.00 ✗ |"
    slow = corpus_table(0.0, _requests(), _timings({("copy-heavy", "ngram"): [1.9, 1.9, 1.9]})).splitlines()
    assert slow[4].startswith("| copy-heavy | 1.90 / 1.90 ✗ |")  # the median below 2.0 at 0 ms


# -- the runner ---------------------------------------------------------------------------------

def test_corpus_alone_runs_at_0_and_20_ms_and_128_tokens_on_split_2():
    assert "corpus" in SCENARIOS
    assert ALONE_DELAYS[frozenset({"corpus"})] == "0,20"
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["bench", "--scenarios", "corpus"])
    fill_defaults(args, {"corpus"})
    assert (args.tokens, args.stages) == (128, "2")
