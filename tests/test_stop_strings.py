"""Stop strings: `find_stop`, `held_back`, and `Responder.deltas` holding back only the text that may
begin a stop string."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from fake_backend import EOS, FakeBackend

from mesh.api.request import Prepared
from mesh.api.responder import Responder
from mesh.api.stop_strings import find_stop, held_back
from mesh.backend import GenerationRequest
from mesh.observe.metrics import Metrics


def test_find_stop_returns_the_earliest_hit_of_any_stop():
    assert find_stop("Hello world", ("world",)) == 6
    assert find_stop("Hello world", ("world", "lo")) == 3
    assert find_stop("Hello world", ("xyz",)) is None
    assert find_stop("Hello world", ()) is None
    assert find_stop("aaa", ("a",)) == 0


def _run(backend: FakeBackend, stops: tuple[str, ...], max_tokens: int = 100) -> Responder:
    req = GenerationRequest([5, 6], max_tokens, stop_tokens=frozenset({EOS}))
    prepared = Prepared(req, stops, chat=False, stream=False, include_usage=False)
    return Responder(backend, Metrics(), prepared, "completions")


def _deltas(backend: FakeBackend, stops: tuple[str, ...],
            max_tokens: int = 100) -> tuple[Responder, list[tuple[str, int]]]:
    async def go() -> tuple[Responder, list[tuple[str, int]]]:
        run = _run(backend, stops, max_tokens)
        await run.open()
        out = [(text, len(made)) async for text, made in run.deltas()]
        await run._finish(failed=False)
        return run, out

    return asyncio.run(go())


def _whole(backend: FakeBackend, stops: tuple[str, ...], max_tokens: int = 100) -> dict[str, Any]:
    return asyncio.run(_run(backend, stops, max_tokens).whole())


@pytest.mark.parametrize(("script", "stops", "text"), [
    ("Hello world", ("wor",), "Hello "),
    ("Hello world", ("He",), ""),
    ("Hello world", ("world", "lo"), "Hel"),  # the earliest hit wins, not the first listed
    ("Hello world", ("d",), "Hello worl"),
    ("café au lait", ("é",), "caf"),
    ("café au lait", (" au",), "café"),
])
def test_text_is_cut_before_the_stop_and_finish_reason_is_stop(byte_tokenizer, script, stops, text):
    backend = FakeBackend(byte_tokenizer, script)
    body = _whole(backend, stops)
    assert body["choices"][0]["text"] == text
    assert body["choices"][0]["finish_reason"] == "stop"
    assert backend.closed == 1  # the generation is abandoned at the stop, and its session freed


def test_a_stop_prefix_at_the_end_is_not_lost(byte_tokenizer):
    body = _whole(FakeBackend(byte_tokenizer, "Hello wo", eos=False), ("world",))
    assert body["choices"][0]["text"] == "Hello wo"
    assert body["choices"][0]["finish_reason"] == "length"
    body = _whole(FakeBackend(byte_tokenizer, "Hello wo", eos=True), ("world",))
    assert body["choices"][0]["text"] == "Hello wo"
    assert body["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize(("text", "stops", "held"), [
    ("abc", ("xyz",), 0),
    ("abx", ("xyz",), 1),
    ("abxy", ("xyz",), 2),
    ("abxy", ("xyz", "yq"), 2),  # the longest of the stops' prefixes
    ("abxy", ("yq", "xyz"), 2),
    ("aaa", ("aaab",), 3),
    ("aaaa", ("aaab",), 3),  # all of the text but the first "a" may begin it
    ("abab", ("abac",), 3 - 1),  # "ab" begins it; "abab" and "bab" do not
    ("ab", ("ab",), 0),  # a whole stop is found, never held
    ("x" * 50, ("x" * 300,), 50),
    ("hello x", ("x" * 300,), 1),
    ("hello", ("x" * 300,), 0),
    ("", ("abc",), 0),
    ("abc", ("", "c!"), 1),
    ("€", ("€€",), 1),
])
def test_held_back_is_the_longest_suffix_that_begins_a_stop(text: str, stops: tuple[str, ...], held: int):
    assert held_back(text, stops) == held


def test_held_back_is_found_quickly_for_the_longest_stops():
    import time

    stops = tuple("a" * 299 + chr(ord("b") + i) for i in range(16))  # every "a" begins every stop
    started = time.perf_counter()
    for n in range(0, 600, 3):
        assert held_back("a" * n, stops) == min(n, 299)
    assert time.perf_counter() - started < 1.0


def test_text_that_cannot_begin_a_stop_streams_at_once(byte_tokenizer):
    _, out = _deltas(FakeBackend(byte_tokenizer, "abcdef"), ("xyz", "q"))
    assert out == [("a", 1), ("b", 1), ("c", 1), ("d", 1), ("e", 1), ("f", 1)]
    _, out = _deltas(FakeBackend(byte_tokenizer, "abcdef"), ("x" * 300,))
    assert out == [("a", 1), ("b", 1), ("c", 1), ("d", 1), ("e", 1), ("f", 1)]


def test_only_a_possible_stop_waits_and_goes_out_when_it_is_not_one(byte_tokenizer):
    _, out = _deltas(FakeBackend(byte_tokenizer, "a xy xyb"), ("xyz",))
    # "x" and "xy" wait; " " shows they were no stop, and out they go with it
    assert out == [("a", 1), (" ", 1), ("xy ", 3), ("xyb", 3)]


def test_a_long_stop_stops_exactly_and_streams_what_came_before(byte_tokenizer):
    stop = "x" * 300
    script = "one two " + stop + " three"
    run, out = _deltas(FakeBackend(byte_tokenizer, script), (stop,), max_tokens=400)
    assert "".join(t for t, _ in out) == "one two "
    assert [t for t, _ in out][:8] == list("one two ")  # each character as it came
    assert run.finish_reason() == "stop"
    assert sum(n for _, n in out) == len("one two ") + 300  # the stop's tokens were generated
    run, out = _deltas(FakeBackend(byte_tokenizer, "one " + "x" * 299 + " two"), (stop,), max_tokens=400)
    assert "".join(t for t, _ in out) == "one " + "x" * 299 + " two"  # one short: no stop
    assert run.finish_reason() == "stop"  # the EOS


def test_without_stops_every_token_is_a_delta(byte_tokenizer):
    _, out = _deltas(FakeBackend(byte_tokenizer, "abc"), ())
    assert out == [("a", 1), ("b", 1), ("c", 1)]


def test_a_stop_split_over_tokens_never_leaks_its_start(byte_tokenizer):
    run, out = _deltas(FakeBackend(byte_tokenizer, "one STOP two"), ("STOP",))
    assert "".join(t for t, _ in out) == "one "
    assert all("S" not in t for t, _ in out)
    assert run.finish_reason() == "stop"


def test_held_text_counts_characters_not_bytes(byte_tokenizer):
    # "€" is three byte tokens: it waits for its last byte, then as the start of "€z" for the next character
    _, out = _deltas(FakeBackend(byte_tokenizer, "a€b€z"), ("€z",))
    assert out == [("a", 1), ("€b", 4), ("", 4)]  # the stop's tokens go out with no text
    _, out = _deltas(FakeBackend(byte_tokenizer, "a€b€c"), ("zz",))
    assert out == [("a", 1), ("€", 3), ("b", 1), ("€", 3), ("c", 1)]


def test_max_tokens_ends_with_length_and_the_usage_counts(byte_tokenizer):
    body = _whole(FakeBackend(byte_tokenizer, "Hello world"), (), max_tokens=4)
    assert body["choices"][0]["text"] == "Hell"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6,
                             "prompt_tokens_details": {"cached_tokens": 0}}
