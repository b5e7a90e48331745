"""Stop strings: `_find_stop`, and `Responder.deltas` holding back text that may begin a stop string."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from fake_backend import EOS, FakeBackend

from mesh.api.request import Prepared
from mesh.api.responder import Responder, _find_stop
from mesh.backend import GenerationRequest
from mesh.metrics import Metrics


def test_find_stop_returns_the_earliest_hit_of_any_stop():
    assert _find_stop("Hello world", ("world",)) == 6
    assert _find_stop("Hello world", ("world", "lo")) == 3
    assert _find_stop("Hello world", ("xyz",)) is None
    assert _find_stop("Hello world", ()) is None
    assert _find_stop("aaa", ("a",)) == 0


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


def test_deltas_hold_back_one_char_less_than_the_longest_stop(byte_tokenizer):
    _, out = _deltas(FakeBackend(byte_tokenizer, "abcdef"), ("xyz", "q"))
    assert [t for t, _ in out] == ["a", "b", "c", "d", "ef"]
    assert sum(n for _, n in out) == 6  # every token travels with the text it made, once


def test_without_stops_every_token_is_a_delta(byte_tokenizer):
    _, out = _deltas(FakeBackend(byte_tokenizer, "abc"), ())
    assert out == [("a", 1), ("b", 1), ("c", 1)]


def test_a_stop_split_over_tokens_never_leaks_its_start(byte_tokenizer):
    run, out = _deltas(FakeBackend(byte_tokenizer, "one STOP two"), ("STOP",))
    assert "".join(t for t, _ in out) == "one "
    assert all("S" not in t for t, _ in out)
    assert run.finish_reason() == "stop"


def test_held_text_counts_characters_not_bytes(byte_tokenizer):
    # "€" is three byte tokens; with keep = 1 the euro is held until the next character arrives
    _, out = _deltas(FakeBackend(byte_tokenizer, "a€b€c"), ("zz",))
    assert "".join(t for t, _ in out) == "a€b€c"
    assert [t for t, _ in out] == ["a", "€", "b", "€", "c"]
    assert sum(n for _, n in out) == 9


def test_max_tokens_ends_with_length_and_the_usage_counts(byte_tokenizer):
    body = _whole(FakeBackend(byte_tokenizer, "Hello world"), (), max_tokens=4)
    assert body["choices"][0]["text"] == "Hell"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6,
                             "prompt_tokens_details": {"cached_tokens": 0}}
