"""Structured output and tool calls end to end (issue 27): the real openai client against
`mesh serve`, one server per configuration for the whole module.

Greedy and seeded outputs under a grammar are the same token for token whether speculation
runs or not (the draft model, prompt lookup, forced tokens), on one stage and two: the
final stage samples every row under its mask, exactly as plain decoding does.
"""

from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Iterator
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from mesh_server import mesh_serve
from pydantic import BaseModel, Field

from mesh.model_source import EMBEDDED_ID

pytestmark = pytest.mark.mesh

# no speculation on one stage; prompt lookup, else the draft, and forced tokens, on two
SERVERS = {"plain": ("--no-draft", "--no-forced-drafts"), "spec": ("--strategy", "ngram+draft", "--local-stages", "2")}


class Pet(BaseModel):
    """Short enough that a sample at temperature 1 ends well within its max_tokens."""

    name: str = Field(max_length=6)
    kind: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=30)
    toys: list[Literal["ball", "rope", "bone"]] = Field(max_length=1)


PET_SCHEMA = {**Pet.model_json_schema(), "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}}]
ASK_PET = [{"role": "user", "content": "Describe a pet as JSON."}]
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def urls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """One server per configuration, started together and shared by every test here."""
    cache = tmp_path_factory.mktemp("structured-cache")
    with mesh_serve(cache, *SERVERS["plain"]) as (plain, _), mesh_serve(cache, *SERVERS["spec"]) as (spec, _):
        yield {"plain": plain, "spec": spec}


def _client(url: str) -> Any:  # untyped: the SDK's overloads do not take these bodies as dicts
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def _pet(url: str, max_tokens: int = 60, **sampling: object) -> openai.types.chat.ChatCompletion:
    return _client(url).chat.completions.create(
        model=EMBEDDED_ID, messages=ASK_PET, max_tokens=max_tokens, logprobs=True,
        response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": PET_SCHEMA, "strict": True}},
        **sampling)


def _tokens(r: openai.types.chat.ChatCompletion) -> list[str]:
    assert r.choices[0].logprobs is not None
    assert r.choices[0].logprobs.content is not None
    return [t.token for t in r.choices[0].logprobs.content]


@pytest.mark.parametrize("server", list(SERVERS))
def test_parse_returns_a_valid_object(urls, server):
    r = _client(urls[server]).chat.completions.parse(model=EMBEDDED_ID, messages=ASK_PET,
                                                    response_format=Pet, max_tokens=80, temperature=0)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(r.choices[0].message.parsed, Pet)


def test_greedy_and_seeded_output_equal_without_speculation(urls):
    """Token for token, with prompt lookup, the draft and forced tokens on two stages: the
    forced tokens ran as drafts (usage says so) and changed nothing."""
    plain_greedy, plain_seeded = _pet(urls["plain"], temperature=0), _pet(urls["plain"], temperature=1, seed=11)
    assert plain_greedy.usage is not None
    assert getattr(plain_greedy.usage, "speculative", None) is None
    greedy = _pet(urls["spec"], temperature=0)
    assert _tokens(greedy) == _tokens(plain_greedy)
    assert _tokens(_pet(urls["spec"], temperature=1, seed=11)) == _tokens(plain_seeded)
    assert greedy.model_dump()["usage"]["speculative"]["by_proposer"]["forced"]["accepted"] > 0


def test_fifty_seeded_samples_at_temperature_one_validate(urls):
    """Every sample validates against its schema, and every tool call's arguments against
    the function's parameters (ten of the fifty). On one stage without speculation, where
    samples are cheapest: the test above shows speculation changes no token."""
    client = _client(urls["plain"])

    def one(seed: int) -> tuple[str, str | None]:
        if seed % 5 == 0:
            r = client.chat.completions.create(model=EMBEDDED_ID, messages=ASK_WEATHER,
                                               tools=TOOLS, tool_choice="required",
                                               parallel_tool_calls=False, max_tokens=60, temperature=1, seed=seed)
            calls = r.choices[0].message.tool_calls or []
            assert len(calls) == 1
            assert r.choices[0].finish_reason == "tool_calls"
            jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER)
            return "tool", calls[0].function.arguments
        r = _pet(urls["plain"], temperature=1, seed=seed)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content or ""), PET_SCHEMA)
        return "pet", r.choices[0].message.content

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        outputs = list(pool.map(one, range(50)))
    assert len({text for _, text in outputs}) > 10  # sampled, not one answer fifty times


def test_streamed_tool_call_deltas_reassemble_to_the_whole_response(urls):
    args = dict(model=EMBEDDED_ID, messages=ASK_WEATHER, tools=TOOLS, parallel_tool_calls=False,
                tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=60, temperature=0)
    whole = _client(urls["spec"]).chat.completions.create(**args)
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in _client(urls["spec"]).chat.completions.create(**args, stream=True):
        for delta in chunk.choices[0].delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += delta.id or ""
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    expected = [{"name": c.function.name, "arguments": c.function.arguments}
                for c in whole.choices[0].message.tool_calls]
    assert [{"name": c["name"], "arguments": c["arguments"]} for c in calls.values()] == expected
    assert all(c["id"].startswith("call_") for c in calls.values())
    assert finish == whole.choices[0].finish_reason == "tool_calls"


def test_a_follow_up_tool_message_is_answered(urls):
    """The assistant's call and the tool's result go back in; the model answers in text."""
    first = _client(urls["plain"]).chat.completions.create(
        model=EMBEDDED_ID, messages=ASK_WEATHER, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_tokens=60, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    messages = [*ASK_WEATHER, first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    r = _client(urls["plain"]).chat.completions.create(model=EMBEDDED_ID, messages=messages, tools=TOOLS,
                                                       max_tokens=20, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_bad_schemas_are_400s_naming_the_path(urls):
    url = f"{urls['plain']}/v1/chat/completions"

    def ask(schema: object) -> dict:
        body = {"model": EMBEDDED_ID, "messages": ASK_PET,
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
        r = httpx.post(url, json=body, timeout=60)
        assert r.status_code == 400, r.text
        return r.json()["error"]

    invalid = ask({"type": "object", "properties": {"a": {"type": "strin"}}})
    assert "properties.a.type" in invalid["message"]
    unsupported = ask({"type": "object", "properties": {"a": {"not": {"type": "string"}}}})
    assert "'not'" in unsupported["message"]
    assert "properties.a.not" in unsupported["message"]
    deep: dict = {}
    inner = deep
    for _ in range(200):
        inner["items"] = {}
        inner = inner["items"]
    assert "nests" in ask(deep)["message"]


def test_a_grammar_cut_by_max_tokens_ends_with_length(urls):
    r = _pet(urls["plain"], temperature=0, max_tokens=5)
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.content
    assert not r.choices[0].message.content.endswith("}")


def test_auto_free_text_streams_as_content_and_equals_the_whole_response(urls):
    """Under `auto` the model may answer in text: it streams as it comes, once it cannot be a call."""
    ask = [{"role": "user", "content": "Write a sentence about the sea."}]
    args = dict(model=EMBEDDED_ID, messages=ask, tools=TOOLS, tool_choice="auto", max_tokens=12, temperature=0)
    whole = _client(urls["plain"]).chat.completions.create(**args)
    pieces = [c.choices[0].delta.content for c in _client(urls["plain"]).chat.completions.create(**args, stream=True)
              if c.choices and c.choices[0].delta.content]
    assert whole.choices[0].message.tool_calls is None
    assert "".join(pieces) == whole.choices[0].message.content
    assert len(pieces) > 2  # streamed, not held to the end
