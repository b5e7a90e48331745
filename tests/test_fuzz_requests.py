"""Thousands of request bodies, well-typed, mistyped and broken, against the live app (issue 28):
none may get a server error, and the server answers as before once they are done.

Each field gets either a value of its own type (in range or not) or any JSON at all; the
encoded body is sometimes cut, or has bytes that are not UTF-8 put into it. The app runs on
FakeBackend with SmolLM2's tokenizer and chat template, so the whole path from bytes to
tokens to a response is the real one but for the model.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest
from fake_backend import FakeBackend
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mesh.api.app import build_app
from mesh.model.tokenizer import Tokenizer
from mesh.observe.metrics import Metrics

pytestmark = pytest.mark.mesh  # 30-60 s: hypothesis takes about as long as the requests

CASES = 2000
HI = [{"role": "user", "content": "hi"}]

# text from pieces that have broken servers: lone surrogates (json.dumps escapes them), control
# tokens, NUL, template syntax, this module's own marks, characters of every width
_PIECES = ["hi", " ", "\ud800", "\udfff", "<|im_start|>system", "<|im_end|>", "\x1e0\x1f", "\x00", "{{ x }}",
           "{% raise %}", "東京", "🙂", "\U0010ffff", "²", "٣", "\n", "wor", "Hello world", "\\u", "é"]
_TEXT = st.lists(st.sampled_from(_PIECES), max_size=4).map("".join)
# values of every JSON type, including those OpenAI's validation refuses where a number is due
_WRONG: st.SearchStrategy[Any] = st.sampled_from([
    None, True, False, 0, 1, -1, 2**70, -(2**70), 0.5, 1.5, -0.0, float("nan"), float("inf"), "", "42", "0.5",
    "true", "²", [], [True], [1, "a"], [[]], {}, {"a": 1}, {"type": "text"}, [{"role": "user"}]])
_JSON: st.SearchStrategy[Any] = st.recursive(_WRONG | _TEXT, lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(_TEXT, inner, max_size=2), max_leaves=4)
_ID = st.integers(-2, 300)  # both vocabularies have more than 300 tokens
_PART = st.fixed_dictionaries({"type": st.sampled_from(["text", "refusal", "image_url", "x"]), "text": _TEXT})
_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool"]),
     "content": _TEXT | st.lists(_PART, max_size=2) | st.none()},
    optional={"name": _TEXT, "tool_calls": st.lists(st.dictionaries(_TEXT, _JSON, max_size=2), max_size=1)})
# each field's values of its own type, in range and just out of it
_COMMON: dict[str, st.SearchStrategy[Any]] = {
    "max_tokens": st.integers(-1, 20), "temperature": st.floats(-0.5, 2.5), "top_p": st.floats(-0.5, 1.5),
    "top_k": st.integers(-3, 2**70), "seed": st.integers(-(2**64), 2**65), "stop": _TEXT | st.lists(_TEXT, max_size=17),
    "n": st.integers(0, 2), "stream": st.booleans(), "stream_options": st.fixed_dictionaries(
        {}, optional={"include_usage": st.booleans()}), "presence_penalty": st.floats(-3, 3),
    "frequency_penalty": st.floats(-3, 3), "user": _TEXT, "ignore_eos": st.booleans(), "best_of": st.integers(0, 2),
    "logit_bias": st.dictionaries(_TEXT | _ID.map(str), st.floats(-150, 150), max_size=3),
}
_FIELDS: dict[str, dict[str, st.SearchStrategy[Any]]] = {
    "/v1/chat/completions": {
        **_COMMON, "model": st.just("tiny"), "messages": st.lists(_MESSAGE, min_size=1, max_size=3),
        "max_completion_tokens": st.integers(-1, 20), "logprobs": st.booleans(), "top_logprobs": st.integers(-1, 21),
        "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}]), "tools": st.just([]),
        "tool_choice": st.sampled_from(["none", "auto"]), "metadata": st.dictionaries(_TEXT, _TEXT, max_size=2),
        "modalities": st.just(["text"])},
    "/v1/completions": {
        **_COMMON, "model": st.just("tiny"), "logprobs": st.integers(-1, 6), "echo": st.booleans(),
        "prompt": _TEXT | st.lists(_TEXT, max_size=2) | st.lists(_ID, max_size=6)
        | st.lists(st.lists(_ID, max_size=4), max_size=2)},
}
_REQUIRED = {"/v1/chat/completions": ("model", "messages"), "/v1/completions": ("model", "prompt")}


@st.composite
def _request(draw: st.DrawFn) -> tuple[str, bytes]:
    """A body that is well-typed but for at most two fields, sometimes damaged on the wire:
    cut short, or with bytes that may not be UTF-8 put into it."""
    path = draw(st.sampled_from(sorted(_FIELDS)))
    fields = _FIELDS[path]
    names = [*_REQUIRED[path], *draw(st.lists(st.sampled_from(sorted(fields)), max_size=4, unique=True))]
    body: Any = {name: draw(fields[name]) for name in names}
    for name in draw(st.lists(st.sampled_from([*sorted(fields), "frobnicate"]), max_size=2, unique=True)):
        if draw(st.sampled_from(["typed", "typed", "anything"])) == "anything":
            body[name] = draw(_JSON)
    # the uncommon cases last: hypothesis draws the first of a list most often
    if draw(st.sampled_from(["object"] * 15 + ["anything"])) == "anything":
        body = draw(_JSON)  # not even an object, most often
    raw = json.dumps(body).encode()
    damage, at = draw(st.sampled_from(["none"] * 8 + ["junk", "cut"])), draw(st.integers(0, len(raw)))
    if damage == "junk":
        junk = draw(st.sampled_from([b"\xed\xa0\x80", b"\xff", b"\xc3", b"\xc0\xaf", b"\xf4\x90\x80\x80", b"\x00"]))
        return path, raw[:at] + junk + raw[at:]
    return path, raw[:at] if damage == "cut" else raw


def _fuzz(backend: FakeBackend) -> Counter[int]:
    statuses: Counter[int] = Counter()
    with TestClient(build_app(backend, Metrics()), raise_server_exceptions=False) as client:

        @settings(max_examples=CASES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(_request())
        def one(request: tuple[str, bytes]) -> None:
            path, raw = request
            r = client.post(path, content=raw, headers={"content-type": "application/json"})
            assert r.status_code < 500, (path, raw, r.text)
            if r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"):
                assert '"internal_error"' not in r.text, (path, raw, r.text)
            elif r.status_code != 200:
                assert set(r.json()["error"]) == {"message", "type", "param", "code"}
            statuses[r.status_code] += 1

        one()
        assert client.post("/v1/chat/completions", json={"model": "tiny", "messages": HI}).status_code == 200
        assert client.get("/health").status_code == 200
    return statuses


def test_no_request_body_gets_a_server_error(smollm2_gguf):
    statuses = _fuzz(FakeBackend(Tokenizer(smollm2_gguf, "tiny"), "Hello world"))
    assert sum(statuses.values()) >= CASES
    assert not [s for s in statuses if s >= 500]
    # the cases reach generation, not only the validator: both answers and refusals are many
    assert statuses[200] > CASES // 10, statuses
    assert statuses[400] > CASES // 4, statuses
