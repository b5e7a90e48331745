"""Request bodies are typed as OpenAI types them (issue 28): nothing is coerced, every type
error is a 400 naming its field, and a body that is not UTF-8 is a 400 before anything reads it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from fake_backend import FakeBackend
from fastapi.testclient import TestClient

from mesh.api.app import build_app
from mesh.observe.metrics import Metrics

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HI = [{"role": "user", "content": "hi"}]
SURROGATE = b"a\xed\xa0\x80"  # U+D800 encoded as UTF-8 would be, which UTF-8 forbids


@pytest.fixture
def backend(byte_tokenizer) -> FakeBackend:
    return FakeBackend(byte_tokenizer, "Hello world")


@pytest.fixture
def client(backend: FakeBackend) -> Iterator[TestClient]:
    with TestClient(build_app(backend, Metrics())) as c:
        yield c


def _refused(r: Any, param: str | None, code: str | None = None) -> dict[str, Any]:
    """A 400 in OpenAI's error shape naming `param`."""
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


@pytest.mark.parametrize(("path", "field", "value", "expected", "got"), [
    (CHAT, "max_tokens", True, "an integer", "a boolean"),
    (CHAT, "max_tokens", "4", "an integer", "a string"),
    (CHAT, "max_tokens", 4.0, "an integer", "a decimal number"),
    (CHAT, "seed", "42", "an integer", "a string"),
    (CHAT, "temperature", "0.5", "a number", "a string"),
    (CHAT, "temperature", True, "a number", "a boolean"),
    (CHAT, "top_logprobs", False, "an integer", "a boolean"),
    (CHAT, "n", True, "an integer", "a boolean"),
    (CHAT, "stream", 1, "a boolean", "an integer"),
    (CHAT, "logprobs", "true", "a boolean", "a string"),
    (CHAT, "ignore_eos", 0, "a boolean", "an integer"),
    (CHAT, "user", 7, "a string", "an integer"),
    (COMPLETIONS, "logprobs", True, "an integer", "a boolean"),
    (COMPLETIONS, "max_tokens", "4", "an integer", "a string"),
    (COMPLETIONS, "echo", "false", "a boolean", "a string"),
])
def test_no_value_is_coerced(backend: FakeBackend, client: TestClient, path: str, field: str, value: Any,
                             expected: str, got: str):
    body = {"model": "tiny", **({"messages": HI} if path == CHAT else {"prompt": "hi"}), field: value}
    err = _refused(client.post(path, json=body), field, "invalid_type")
    assert err["message"] == f"invalid type for '{field}': expected {expected}, but got {got} instead"
    assert backend.requests == []


def test_an_integer_is_still_a_number(client: TestClient):
    assert client.post(CHAT, json={"model": "tiny", "messages": HI, "temperature": 1, "top_p": 1}).status_code == 200
    assert client.post(CHAT, json={"model": "tiny", "messages": HI, "logit_bias": {"72": 1}}).status_code == 200


@pytest.mark.parametrize(("field", "literal"), [("temperature", "NaN"), ("temperature", "Infinity"),
                                               ("top_p", "NaN"), ("presence_penalty", "-Infinity"),
                                               ("frequency_penalty", "1e999"), ("temperature", "-1e999")])
def test_a_number_that_is_not_finite_is_told_so(backend: FakeBackend, client: TestClient, field: str, literal: str):
    """Python's json reads NaN and Infinity, and 1e999 as infinity: each is named as not finite,
    never as out of the field's range."""
    body = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "%s": %s}' % (
        field.encode(), literal.encode())
    err = _refused(_raw(client, CHAT, body), field)
    assert err["message"] == f"invalid value for '{field}': Input should be a finite number"
    err = _refused(_raw(client, CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], '
                                      b'"logit_bias": {"72": NaN}}'), "logit_bias")
    assert "finite" in err["message"]
    assert backend.requests == []


@pytest.mark.parametrize("prompt", [[True], [1, False], [[True]], 5, [1.5], {"a": 1}])
def test_a_prompt_of_the_wrong_type_names_every_shape_it_may_take(backend: FakeBackend, client: TestClient,
                                                                  prompt: Any):
    err = _refused(client.post(COMPLETIONS, json={"model": "tiny", "prompt": prompt}), "prompt", "invalid_type")
    assert "a string" in err["message"]
    assert "an array of integers" in err["message"]
    assert "list[" not in err["message"]
    assert backend.requests == []


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ({"messages": [*HI, {"role": "user", "content": "x", "name": 1}]}, "messages.1.name"),
    ({"messages": [{"role": "user", "content": [5]}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": "x", "role2": 1}]}, "messages.0.role2"),
    ({"messages": "hi"}, "messages"),
    ({"messages": HI, "stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"messages": HI, "stream": True, "stream_options": []}, "stream_options"),
    ({"messages": HI, "stop": [1]}, "stop"),
    ({"messages": HI, "stop": 5}, "stop"),
    ({"messages": HI, "logit_bias": {"5": "1"}}, "logit_bias"),
    ({"messages": HI, "logit_bias": {"5": True}}, "logit_bias"),
    ({"messages": HI, "logit_bias": [1]}, "logit_bias"),
    ({"messages": HI, "tool_choice": 5}, "tool_choice"),
    ({"messages": HI, "metadata": "x"}, "metadata"),
    ({"messages": HI, "model": 5}, "model"),
    ({"messages": HI, "model": None}, "model"),
])
def test_every_type_error_names_its_field(client: TestClient, body: dict[str, Any], param: str):
    _refused(client.post(CHAT, json={"model": "tiny", **body}), param)


def test_a_missing_field_is_named(client: TestClient):
    _refused(client.post(CHAT, json={"messages": HI}), "model", "missing_required_parameter")
    _refused(client.post(COMPLETIONS, json={"model": "tiny"}), "prompt", "missing_required_parameter")


@pytest.mark.parametrize("key", ["²", "٣", " 5 ", "5 ", "+5", "-1", "5.0", "", "0x10", "1_0", "9" * 5000,
                                 "5\n"])
def test_logit_bias_keys_are_ascii_digits_only(backend: FakeBackend, client: TestClient, key: str):
    err = _refused(client.post(CHAT, json={"model": "tiny", "messages": HI, "logit_bias": {key: 1}}), "logit_bias")
    assert "not a token id" in err["message"]
    assert backend.requests == []


def test_logit_bias_keys_in_ascii_digits_are_token_ids(backend: FakeBackend, client: TestClient):
    r = client.post(CHAT, json={"model": "tiny", "messages": HI, "logit_bias": {"72": 1, "0073": -2, "0": 3}})
    assert r.status_code == 200, r.text
    assert backend.requests[0].sampling.logit_bias == ((0, 3.0), (72, 1.0), (73, -2.0))


@pytest.mark.parametrize("stream", [None, False])
def test_stream_options_need_stream_true(backend: FakeBackend, client: TestClient, stream: bool | None):
    body: dict[str, Any] = {"model": "tiny", "messages": HI, "stream_options": {"include_usage": True}}
    if stream is not None:
        body["stream"] = stream
    err = _refused(client.post(CHAT, json=body), "stream_options")
    assert "stream" in err["message"]
    _refused(client.post(COMPLETIONS, json={"model": "tiny", "prompt": "hi", "stream_options": {}}),
             "stream_options")
    assert backend.requests == []


def test_stream_options_null_is_no_stream_options(client: TestClient):
    assert client.post(CHAT, json={"model": "tiny", "messages": HI, "stream_options": None}).status_code == 200


def _raw(client: TestClient, path: str, body: bytes) -> Any:
    return client.post(path, content=body, headers={"content-type": "application/json"})


@pytest.mark.parametrize(("path", "body"), [
    # each was a 500 before issue 28; the model's was plain text, raised rendering the 404
    (CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "' + SURROGATE + b'"}]}'),
    (COMPLETIONS, b'{"model": "tiny", "prompt": "' + SURROGATE + b'"}'),
    (CHAT, b'{"model": "' + SURROGATE + b'", "messages": [{"role": "user", "content": "hi"}]}'),
    (CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "\xff\xfe"}]}'),
    (CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "\xc3"}]}'),  # cut short
    (CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "\xc0\xaf"}]}'),  # overlong
    (CHAT, b'{"model": "tiny", "' + SURROGATE + b'": 1, "messages": []}'),  # in a key, before any field
    (COMPLETIONS, b'{"model": "tiny", "prompt": "hi", "stop": ["\xf4\x90\x80\x80"]}'),  # past U+10FFFF
])
def test_a_body_that_is_not_utf8_is_a_400_before_anything_reads_it(backend: FakeBackend, client: TestClient,
                                                                   path: str, body: bytes):
    err = _refused(_raw(client, path, body), None, "invalid_encoding")
    assert "UTF-8" in err["message"]
    assert backend.requests == []
    assert client.post(CHAT, json={"model": "tiny", "messages": HI}).status_code == 200


def test_escaped_lone_surrogates_are_still_answered(backend: FakeBackend, client: TestClient):
    for text in ("a\ud800", "\udfff b"):
        body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": text}]}).encode()
        assert b"\\ud" in body
        assert _raw(client, CHAT, body).status_code == 200
    body = json.dumps({"model": "x\ud800", "messages": HI}).encode()
    r = _raw(client, CHAT, body)
    assert r.status_code == 404
    assert "x\ufffd" in r.json()["error"]["message"]


def test_a_utf8_byte_order_mark_is_allowed(client: TestClient):
    body = "\ufeff" + json.dumps({"model": "tiny", "messages": HI})
    assert _raw(client, CHAT, body.encode()).status_code == 200


def test_an_error_about_the_whole_body_names_no_param():
    from pydantic import ValidationError

    from mesh.api.invalid import invalid_request
    from mesh.api.request import ChatRequest

    with pytest.raises(ValidationError) as exc:  # a key that is no Unicode: body.py never lets one through
        ChatRequest.model_validate({"\ud800model": "tiny", "messages": HI})
    err = invalid_request(exc.value, {})
    assert (err.status, err.param) == (400, None)
