"""The OpenAI-compatible layer against a fake backend: bodies, streams, usage and errors, no mesh."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from fake_backend import FakeBackend
from fastapi.testclient import TestClient

from mesh.api.app import build_app
from mesh.backend import MeshUnavailableError, RequestRejectedError
from mesh.observe.metrics import Metrics

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture
def backend(byte_tokenizer) -> FakeBackend:
    return FakeBackend(byte_tokenizer, "Hello world")


def _client(backend: FakeBackend, max_body: int = 4 << 20) -> TestClient:
    return TestClient(build_app(backend, Metrics(), max_body=max_body))


@pytest.fixture
def client(backend: FakeBackend) -> Iterator[TestClient]:
    with _client(backend) as c:
        yield c


def _events(client: TestClient, path: str, body: dict[str, Any]) -> list[Any]:
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def _error(r: Any, status: int, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str)
    assert err["message"]
    if code is not None:
        assert err["code"] == code
    if param is not None:
        assert err["param"] == param
    return err


def test_models_and_health(client: TestClient):
    assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"
    assert client.get("/health").status_code == 200


def test_unhealthy_backend_is_503(backend: FakeBackend, client: TestClient):
    backend.healthy = backend.healthy.model_copy(update={"ok": False})
    assert client.get("/health").status_code == 503


def test_chat_body(backend: FakeBackend, client: TestClient):
    r = client.post(CHAT, json={"model": "tiny", "messages": HI})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-")
    assert body["model"] == "tiny"
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": "Hello world", "refusal": None}
    assert choice["finish_reason"] == "stop"
    assert choice["logprobs"] is None
    prompt = len(backend.requests[0].prompt)
    assert body["usage"] == {"prompt_tokens": prompt, "completion_tokens": 11, "total_tokens": prompt + 11,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert backend.closed == 1


def test_completion_body_defaults_to_16_tokens(byte_tokenizer):
    backend = FakeBackend(byte_tokenizer, "x" * 40)
    with _client(backend) as client:
        body = client.post(COMPLETIONS, json={"model": "tiny", "prompt": "hi"}).json()
    assert body["object"] == "text_completion"
    assert body["id"].startswith("cmpl-")
    assert body["choices"][0]["text"] == "x" * 16
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 16
    assert backend.requests[0].max_tokens == 16


def test_max_tokens_and_stop_strings_in_a_body(client: TestClient):
    body = client.post(COMPLETIONS, json={"model": "tiny", "prompt": "hi", "max_tokens": 5}).json()
    assert (body["choices"][0]["text"], body["choices"][0]["finish_reason"]) == ("Hello", "length")
    body = client.post(COMPLETIONS, json={"model": "tiny", "prompt": "hi", "stop": ["o w", "zz"]}).json()
    assert (body["choices"][0]["text"], body["choices"][0]["finish_reason"]) == ("Hell", "stop")
    body = client.post(CHAT, json={"model": "tiny", "messages": HI, "stop": "world"}).json()
    assert body["choices"][0]["message"]["content"] == "Hello "
    assert body["choices"][0]["finish_reason"] == "stop"


def test_chat_stream(client: TestClient):
    events = _events(client, CHAT, {"model": "tiny", "messages": HI, "stream": True})
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert len({e["id"] for e in events}) == 1
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    assert text == "Hello world"
    assert [e["choices"][0]["finish_reason"] for e in events[:-1]] == [None] * (len(events) - 1)
    assert events[-1]["choices"][0] == {"index": 0, "finish_reason": "stop", "logprobs": None, "delta": {}}
    assert all("usage" not in e for e in events)


def test_completion_stream_with_stop_and_usage_when_asked(backend: FakeBackend, client: TestClient):
    events = _events(client, COMPLETIONS, {"model": "tiny", "prompt": "hi", "stream": True, "stop": "wor",
                                           "stream_options": {"include_usage": True}})
    *chunks, usage = events
    assert "".join(e["choices"][0]["text"] for e in chunks) == "Hello "
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert usage["choices"] == []
    assert usage["object"] == "text_completion"
    prompt = len(backend.requests[0].prompt)
    # the stop was seen in the token after "r": the tokens generated count, not the text kept
    assert usage["usage"]["prompt_tokens"] == prompt
    assert usage["usage"]["completion_tokens"] == len("Hello wor")
    assert backend.closed == 1


def test_usage_chunk_only_when_asked(client: TestClient):
    for options in (None, {"include_usage": False}):
        body: dict[str, Any] = {"model": "tiny", "messages": HI, "stream": True}
        if options is not None:
            body["stream_options"] = options
        assert all("usage" not in e and e["choices"] for e in _events(client, CHAT, body))


def test_stream_max_tokens_finishes_with_length(client: TestClient):
    events = _events(client, CHAT, {"model": "tiny", "messages": HI, "stream": True, "max_tokens": 3})
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == "Hel"
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_logprobs_in_a_chat_body(client: TestClient):
    body = client.post(CHAT, json={"model": "tiny", "messages": HI, "max_tokens": 2, "logprobs": True,
                                   "top_logprobs": 2}).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == ["H", "e"]
    assert content[0]["bytes"] == [ord("H")]
    assert content[0]["logprob"] == -0.5
    assert len(content[0]["top_logprobs"]) == 2


@pytest.mark.parametrize(("field", "value"), [
    ("n", 2), ("functions", [{"name": "f"}]), ("function_call", "auto"), ("store", True), ("audio", {"voice": "x"}),
    ("reasoning_effort", "low"), ("best_of", 2),
])
def test_unsupported_values_are_refused_by_name(backend: FakeBackend, client: TestClient, field: str, value: Any):
    r = client.post(CHAT, json={"model": "tiny", "messages": HI, field: value})
    err = _error(r, 400, "unsupported_parameter", field)
    assert field in err["message"]
    assert backend.requests == []


def test_supported_defaults_are_accepted(client: TestClient):
    r = client.post(CHAT, json={"model": "tiny", "messages": HI, "n": 1, "tools": [], "tool_choice": "none",
                                "response_format": {"type": "text"}, "store": False, "user": "u"})
    assert r.status_code == 200


def test_unknown_fields_and_completion_only_fields_are_refused(client: TestClient):
    _error(client.post(CHAT, json={"model": "tiny", "messages": HI, "frobnicate": 1}), 400,
           "unsupported_parameter", "frobnicate")
    _error(client.post(COMPLETIONS, json={"model": "tiny", "prompt": "hi", "suffix": "end"}), 400,
           "unsupported_parameter", "suffix")
    _error(client.post(COMPLETIONS, json={"model": "tiny", "prompt": "hi", "messages": HI}), 400,
           "unsupported_parameter", "messages")


def test_invalid_requests_are_400(client: TestClient):
    _error(client.post(CHAT, content=b"{not json", headers={"content-type": "application/json"}), 400,
           "invalid_json")
    _error(client.post(CHAT, json=[1, 2]), 400)
    _error(client.post(CHAT, json={"model": "tiny", "messages": []}), 400, param="messages")
    _error(client.post(CHAT, json={"model": "tiny", "messages": HI, "temperature": 3}), 400, param="temperature")
    _error(client.post(CHAT, json={"model": "tiny", "messages": HI, "max_tokens": 0}), 400, "invalid_max_tokens")
    _error(client.post(COMPLETIONS, json={"model": "tiny", "prompt": "hi", "max_tokens": 10_000}), 400,
           "context_length_exceeded")
    _error(client.post(COMPLETIONS, json={"model": "tiny", "prompt": [10_000]}), 400, param="prompt")
    _error(client.post(CHAT, json={"model": "tiny", "messages": HI, "logit_bias": {"999999": 1}}), 400,
           param="logit_bias")


@pytest.mark.parametrize(("stop", "param"), [("", "stop"), (["x", ""], "stop.1"), ([""], "stop.0")])
def test_an_empty_stop_string_is_refused_naming_it(backend: FakeBackend, client: TestClient, stop: Any, param: str):
    for path, body in ((CHAT, {"messages": HI}), (COMPLETIONS, {"prompt": "hi"})):
        err = _error(client.post(path, json={"model": "tiny", **body, "stop": stop}), 400, param=param)
        assert "empty string" in err["message"]
    assert backend.requests == []
    assert client.post(CHAT, json={"model": "tiny", "messages": HI, "stop": []}).status_code == 200


@pytest.mark.parametrize("role", ["user", "system", "assistant"])
def test_an_empty_content_array_is_refused(backend: FakeBackend, client: TestClient, role: str):
    messages = [*HI, {"role": role, "content": []}]
    err = _error(client.post(CHAT, json={"model": "tiny", "messages": messages}), 400, param="messages.1.content")
    assert "empty array" in err["message"]
    assert backend.requests == []


CALLED = {"role": "assistant", "content": None,
          "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "add", "arguments": "{}"}}]}


@pytest.mark.parametrize(("messages", "param", "words"), [
    ([*HI, CALLED, {"role": "tool", "content": "2"}], "messages.2.tool_call_id",
     "Missing parameter 'tool_call_id': messages with role 'tool' must have a 'tool_call_id'."),
    ([*HI, {"role": "tool", "tool_call_id": "call_1", "content": "2"}], "messages.1.role",
     "Invalid parameter: messages with role 'tool' must be a response to a preceeding message with 'tool_calls'."),
    ([*HI, CALLED, {"role": "tool", "tool_call_id": "call_2", "content": "2"}], "messages.2.role",
     "Invalid parameter: messages with role 'tool' must be a response to a preceeding message with 'tool_calls'."),
])
def test_a_tool_message_must_answer_an_earlier_call(backend: FakeBackend, client: TestClient,
                                                   messages: list[Any], param: str, words: str):
    """As OpenAI answers (issue 53), in its words: a tool reply names a call an assistant turn made."""
    err = _error(client.post(CHAT, json={"model": "tiny", "messages": messages}), 400, param=param)
    assert err["message"] == words
    assert backend.requests == []
    answered = [*HI, CALLED, {"role": "tool", "tool_call_id": "call_1", "content": "2"}]
    assert client.post(CHAT, json={"model": "tiny", "messages": answered}).status_code == 200


@pytest.mark.parametrize("prompt", ["", [""]])
def test_an_empty_prompt_starts_from_bos(smollm2_gguf, prompt: Any):
    """OpenAI accepts "prompt": "" (issue 53). SmolLM2 adds no BOS of its own, so its empty prompt
    tokenizes to nothing: it starts from the BOS, the start of a text."""
    from mesh.model.tokenizer import Tokenizer

    tok = Tokenizer(smollm2_gguf, "tiny")
    assert tok.tokenize("", special=False) == []
    backend = FakeBackend(tok, "Hello world")
    with _client(backend) as c:
        r = c.post(COMPLETIONS, json={"model": "tiny", "prompt": prompt, "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 1
    assert list(backend.requests[0].prompt) == [tok.bos]


WEATHER_TOOL = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CUT_CALLS = {  # a call cut inside its arguments, in each model's format
    "byte_tokenizer": '{"name": "get_weather", "arguments": {"city": "Par',  # unknown format: the bare call
    "smollm2_gguf": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',  # Hermes
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("model", list(CUT_CALLS))
def test_a_tool_call_cut_by_max_tokens_keeps_what_was_generated(request: pytest.FixtureRequest, model: str,
                                                                 stream: bool):
    """As OpenAI (issue 53): finish_reason "length" with the call's name and its arguments' text so
    far, streamed or not, not an empty message."""
    from mesh.model.tokenizer import Tokenizer

    tok = request.getfixturevalue(model)
    tok = tok if isinstance(tok, Tokenizer) else Tokenizer(tok, "tiny")
    backend = FakeBackend(tok, CUT_CALLS[model], eos=False)  # the script runs out: cut by length
    if model != "byte_tokenizer":  # the fake's script is bytes of the tiny vocabulary; these are SmolLM2's tokens
        backend.script = tok.tokenize(CUT_CALLS[model], special=True, add_bos=False)
    backend.ctx_per_session = 2048  # room for the tools' system message (a token a byte on the tiny vocabulary)
    body = {"model": "tiny", "messages": HI, "tools": WEATHER_TOOL, "tool_choice": "required", "stream": stream}
    with _client(backend) as c:
        if stream:
            chunks = [e["choices"][0] for e in _events(c, CHAT, body)]
            deltas = [d for ch in chunks for d in ch["delta"].get("tool_calls", [])]
            assert not [ch for ch in chunks if ch["delta"].get("content")]
            assert [d["function"] for d in deltas] == [{"name": "get_weather", "arguments": ""},
                                                       {"arguments": '{"city": "Par'}]
            assert chunks[-1]["finish_reason"] == "length"
            return
        (choice,) = c.post(CHAT, json=body).json()["choices"]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Par'}
    assert call["id"].startswith("call_")


JSON_OBJECT = {"type": "json_object"}
NO_JSON = "'{}' must contain the word 'json' in some form, to use 'response_format' of type 'json_object'."


def test_json_object_needs_the_word_json_in_the_prompt(backend: FakeBackend, client: TestClient):
    """OpenAI's rule, in its words: in any message's content, in any case; a completion's prompt too."""
    err = _error(client.post(CHAT, json={"model": "tiny", "messages": HI, "response_format": JSON_OBJECT}), 400,
                 "invalid_request", "messages")
    assert err["message"] == NO_JSON.format("messages")
    err = _error(client.post(COMPLETIONS, json={"model": "tiny", "prompt": "hi", "response_format": JSON_OBJECT}),
                 400, "invalid_request", "prompt")
    assert err["message"] == NO_JSON.format("prompt")
    assert backend.requests == []
    asked = [{"role": "system", "content": [{"type": "text", "text": "Answer in JSON."}]}, *HI]
    for path, body in ((CHAT, {"messages": asked}), (CHAT, {"messages": [*HI, {"role": "user", "content": "a Json"}]}),
                       (COMPLETIONS, {"prompt": "as json:"}), (COMPLETIONS, {"prompt": [ord(c) + 3 for c in "JSON"]})):
        r = client.post(path, json={"model": "tiny", **body, "response_format": JSON_OBJECT})
        assert r.status_code == 200, r.text


def test_unknown_model_and_path_are_404(client: TestClient):
    _error(client.post(CHAT, json={"model": "gpt-4", "messages": HI}), 404, "model_not_found", "model")
    _error(client.get("/v1/nothing"), 404, "not_found")


def test_a_body_over_the_limit_is_413(backend: FakeBackend):
    with _client(backend, max_body=200) as client:
        big = {"model": "tiny", "messages": [{"role": "user", "content": "x" * 500}]}
        _error(client.post(CHAT, json=big), 413, "request_too_large")
        assert client.post(CHAT, json={"model": "tiny", "messages": HI}).status_code == 200
    assert len(backend.requests) == 1


@pytest.mark.parametrize(("fail", "status", "code"), [
    (lambda: RequestRejectedError("too long"), 400, "request_rejected"),
    (lambda: MeshUnavailableError("stage 1 is gone"), 503, "mesh_unavailable"),
    (lambda: RuntimeError("boom"), 500, "internal_error"),
])
def test_backend_errors_before_the_first_token_get_their_status(byte_tokenizer, fail, status: int, code: str):
    backend = FakeBackend(byte_tokenizer, fail=fail)
    with _client(backend) as client:
        _error(client.post(CHAT, json={"model": "tiny", "messages": HI}), status, code)
        _error(client.post(CHAT, json={"model": "tiny", "messages": HI, "stream": True}), status, code)
    assert backend.closed == 2


def test_an_error_mid_stream_is_an_error_event_then_done(byte_tokenizer):
    backend = FakeBackend(byte_tokenizer, fail=lambda: MeshUnavailableError("stage 1 is gone"), fail_after=3)
    with _client(backend) as client:
        events = _events(client, CHAT, {"model": "tiny", "messages": HI, "stream": True})
        assert events[-1]["error"]["code"] == "mesh_unavailable"
        assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1]) == "Hel"
        _error(client.post(CHAT, json={"model": "tiny", "messages": HI}), 503, "mesh_unavailable")
    assert backend.closed == 2


def test_metrics_count_responses_by_endpoint_and_status(client: TestClient):
    client.post(CHAT, json={"model": "tiny", "messages": HI})
    client.post(CHAT, json={"model": "nope", "messages": HI})
    text = client.get("/metrics").text
    assert 'endpoint="chat",status="200"' in text
    assert 'endpoint="chat",status="404"' in text


@pytest.mark.parametrize(("server", "extra", "rule"), [
    ("auto", {}, "rejection"), ("auto", {"seed": 4}, "exact"),
    ("auto", {"seed": 4, "speculative_acceptance": "rejection"}, "rejection"),
    ("auto", {"speculative_acceptance": "exact"}, "exact"), ("exact", {}, "exact"),
    ("rejection", {"seed": 4}, "rejection"), ("exact", {"speculative_acceptance": "rejection"}, "rejection")])
def test_the_acceptance_rule_is_the_requests_then_the_servers(backend: FakeBackend, server: str,
                                                              extra: dict[str, Any], rule: str):
    """auto keeps a seeded request's promise (exact) and samples the rest by rejection."""
    backend.speculative_acceptance = server
    with _client(backend) as c:
        assert c.post(CHAT, json={"model": "tiny", "messages": HI, "temperature": 0.8, **extra}).status_code == 200
    assert backend.requests[-1].sampling.acceptance == rule


def test_an_unknown_acceptance_rule_is_a_400_naming_it(client: TestClient):
    r = client.post(CHAT, json={"model": "tiny", "messages": HI, "speculative_acceptance": "typical"})
    _error(r, 400, param="speculative_acceptance")
