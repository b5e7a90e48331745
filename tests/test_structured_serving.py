"""Structured output and tool calls end to end (issue 27): the real openai client against
`mesh serve` on 1, 2 and 3 stages, each with no speculation and with prompt lookup, the draft
and forced tokens (frames in flight). One server at a time: the `served` fixture is
parametrized at module scope, so pytest runs every test of one configuration, stops its
server, then starts the next.

Greedy and seeded outputs under a grammar are the same token for token whatever the split
and whether speculation runs or not: the final stage samples every row under its mask,
exactly as plain decoding does (SmolLM2 is batch-invariant: DESIGN.md §9).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from mesh_server import mesh_serve
from pydantic import BaseModel, Field

from bench.harness.local_server import stage_pids
from mesh.model.source import EMBEDDED_ID

pytestmark = pytest.mark.mesh

# a fixed window and frames in flight: every request is verified in windows whatever a
# cost-aware controller would choose on this machine
SPEC = ("--strategy", "ngram+draft", "--draft-window", "3", "--frames-in-flight", "3")
PLAIN = ("--no-draft", "--no-forced-drafts")
SERVERS = {f"{stages}-{mode}": (*(SPEC if mode == "spec" else PLAIN), "--local-stages", str(stages))
           for stages in (1, 2, 3) for mode in ("plain", "spec")}
TOKEN = "structured-test-token"


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
# an example in the prompt gives prompt lookup something to copy
ASK_LIKE = [{"role": "user", "content": 'Describe a pet as JSON, like {"name": "Rex", "kind": "dog", "age": 3, '
                                       '"toys": ["ball"]}.'}]
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


@dataclass(frozen=True)
class Served:
    name: str  # a key of SERVERS
    url: str
    pid: int

    @property
    def speculative(self) -> bool:
        return self.name.endswith("spec")


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return tmp_path_factory.mktemp("structured-cache")


@pytest.fixture(scope="module", params=list(SERVERS))
def served(request: pytest.FixtureRequest, cache: Any) -> Iterator[Served]:
    with mesh_serve(cache, *SERVERS[request.param], env={"MESHPIPE_TOKEN": TOKEN}) as (url, proc):
        yield Served(request.param, url, proc.pid)


def on(*names: str) -> pytest.MarkDecorator:
    """Run a test on these configurations only (grouped with their server's other tests)."""
    return pytest.mark.parametrize("served", names, indirect=True)


def _client(url: str) -> Any:  # untyped: the SDK's overloads do not take these bodies as dicts
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def _pet(url: str, max_tokens: int = 60, ask: list[dict[str, str]] = ASK_PET, **sampling: object
         ) -> openai.types.chat.ChatCompletion:
    return _client(url).chat.completions.create(
        model=EMBEDDED_ID, messages=ask, max_tokens=max_tokens, logprobs=True,
        response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": PET_SCHEMA, "strict": True}},
        **sampling)


def _logprobs(r: openai.types.chat.ChatCompletion) -> list[Any]:
    assert r.choices[0].logprobs is not None
    assert r.choices[0].logprobs.content is not None
    return r.choices[0].logprobs.content


def _tokens(r: openai.types.chat.ChatCompletion) -> list[str]:
    return [t.token for t in _logprobs(r)]


# every configuration's outputs, by request: each one seen must equal all seen before it
SEEN: dict[str, tuple[str, list[str]]] = {}


def _same_as_every_other_configuration(what: str, served: Served, tokens: list[str]) -> None:
    first = SEEN.setdefault(what, (served.name, tokens))
    assert tokens == first[1], f"{what} on {served.name} differs from {first[0]}"


def test_parse_returns_a_valid_object(served):
    r = _client(served.url).chat.completions.parse(model=EMBEDDED_ID, messages=ASK_PET,
                                                   response_format=Pet, max_tokens=80, temperature=0)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(r.choices[0].message.parsed, Pet)


def test_greedy_and_seeded_output_is_the_same_on_every_split_with_speculation_or_without(served):
    """Token for token against every other configuration; where speculation runs, prompt
    lookup, the draft and forced tokens each proposed drafts (usage says so)."""
    greedy = _pet(served.url, ask=ASK_LIKE, temperature=0)
    seeded = _pet(served.url, ask=ASK_LIKE, temperature=1, seed=11)
    _same_as_every_other_configuration("greedy", served, _tokens(greedy))
    _same_as_every_other_configuration("seeded", served, _tokens(seeded))
    jsonschema.validate(json.loads(seeded.choices[0].message.content or ""), PET_SCHEMA)
    usage = greedy.model_dump()["usage"]
    if not served.speculative:
        assert "speculative" not in usage
        return
    by = usage["speculative"]["by_proposer"]
    assert by["forced"]["accepted"] > 0
    assert by["ngram"]["proposed"] > 0
    assert by["draft"]["proposed"] > 0


@on("1-plain")
def test_fifty_seeded_samples_at_temperature_one_validate(served):
    """Every sample validates against its schema, and every tool call's arguments against
    the function's parameters (ten of the fifty). On one stage without speculation, where
    samples are cheapest: the test above shows speculation changes no token."""
    client = _client(served.url)

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
        r = _pet(served.url, temperature=1, seed=seed)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content or ""), PET_SCHEMA)
        return "pet", r.choices[0].message.content

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        outputs = list(pool.map(one, range(50)))
    assert len({text for _, text in outputs}) > 10  # sampled, not one answer fifty times


@on("2-spec")
def test_unseeded_samples_accepted_by_rejection_sampling_validate(served):
    """An unseeded request's drafts are accepted by rejection sampling (the default rule): the
    draft draws under the grammar's mask, and every sample still validates, logprobs and all."""
    def one(_: int) -> dict:
        r = _pet(served.url, temperature=1)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content or ""), PET_SCHEMA)
        assert all(t.logprob <= 0 for t in _logprobs(r))
        return r.model_dump()["usage"]["speculative"]

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        usages = list(pool.map(one, range(12)))
    assert {u["acceptance"] for u in usages} == {"rejection"}
    draft = [u["by_proposer"]["draft"] for u in usages if "draft" in u.get("by_proposer", {})]
    assert sum(d["accepted"] for d in draft) > 0


@on("2-spec")
def test_streamed_tool_call_deltas_reassemble_to_the_whole_response(served):
    args = dict(model=EMBEDDED_ID, messages=ASK_WEATHER, tools=TOOLS, parallel_tool_calls=False,
                tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=60, temperature=0)
    whole = _client(served.url).chat.completions.create(**args)
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in _client(served.url).chat.completions.create(**args, stream=True):
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


@on("1-plain")
def test_a_tool_call_cut_by_max_tokens_keeps_its_name_and_its_arguments_so_far(served):
    """As OpenAI (issue 53): cut inside its arguments, a call still comes back, with its name
    and the arguments' text so far, finish_reason "length", streamed or not."""
    args = dict(model=EMBEDDED_ID, messages=ASK_WEATHER, tools=TOOLS, tool_choice="required",
                parallel_tool_calls=False, temperature=0)
    whole = _client(served.url).chat.completions.create(**args, max_tokens=60)
    [call] = whole.choices[0].message.tool_calls
    # the last tokens end the unit, the arguments, the call and its marker: without them it is cut inside
    cut = _client(served.url).chat.completions.create(**args, max_tokens=whole.usage.completion_tokens - 8)
    assert cut.choices[0].finish_reason == "length"
    [part] = cut.choices[0].message.tool_calls
    assert part.function.name == call.function.name == "get_weather"
    assert part.id.startswith("call_")
    assert call.function.arguments.startswith(part.function.arguments)
    assert 0 < len(part.function.arguments) < len(call.function.arguments)
    streamed = {"name": "", "arguments": ""}
    finish = None
    for chunk in _client(served.url).chat.completions.create(**args, max_tokens=whole.usage.completion_tokens - 8,
                                                             stream=True):
        for delta in chunk.choices[0].delta.tool_calls or []:
            streamed["name"] += delta.function.name or ""
            streamed["arguments"] += delta.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (streamed, finish) == ({"name": part.function.name, "arguments": part.function.arguments}, "length")


@on("1-plain")
def test_a_follow_up_tool_message_is_answered(served):
    """The assistant's call and the tool's result go back in; the model answers in text."""
    first = _client(served.url).chat.completions.create(
        model=EMBEDDED_ID, messages=ASK_WEATHER, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_tokens=60, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    messages = [*ASK_WEATHER, first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    r = _client(served.url).chat.completions.create(model=EMBEDDED_ID, messages=messages, tools=TOOLS,
                                                    max_tokens=20, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


@on("1-plain")
def test_bad_schemas_are_400s_naming_the_path(served):
    url = f"{served.url}/v1/chat/completions"

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


@on("1-plain")
def test_a_grammar_cut_by_max_tokens_ends_with_length(served):
    r = _pet(served.url, temperature=0, max_tokens=5)
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.content
    assert not r.choices[0].message.content.endswith("}")


@on("1-plain")
def test_auto_free_text_streams_as_content_and_equals_the_whole_response(served):
    """Under `auto` the model may answer in text: it streams as it comes, once it cannot be a call."""
    ask = [{"role": "user", "content": "Write a sentence about the sea."}]
    args = dict(model=EMBEDDED_ID, messages=ask, tools=TOOLS, tool_choice="auto", max_tokens=12, temperature=0)
    whole = _client(served.url).chat.completions.create(**args)
    pieces = [c.choices[0].delta.content for c in _client(served.url).chat.completions.create(**args, stream=True)
              if c.choices and c.choices[0].delta.content]
    assert whole.choices[0].message.tool_calls is None
    assert "".join(pieces) == whole.choices[0].message.content
    assert len(pieces) > 2  # streamed, not held to the end


@on("1-spec")
def test_langchain_structured_output_and_bound_tools(served):
    """LangChain's ChatOpenAI as agents use it: `with_structured_output` sends a strict
    json_schema, `bind_tools` the tools and a named tool_choice; both come back parsed."""
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(model=EMBEDDED_ID, base_url=f"{served.url}/v1", api_key="none",
                                      temperature=0, max_tokens=80, max_retries=0, timeout=120)
    pet = llm.with_structured_output(Pet).invoke(ASK_PET[0]["content"])
    assert isinstance(pet, Pet)
    message = llm.bind_tools(TOOLS, tool_choice="get_weather", parallel_tool_calls=False).invoke(
        ASK_WEATHER[0]["content"])
    [call] = message.tool_calls
    assert call["name"] == "get_weather"
    assert call["id"].startswith("call_")
    jsonschema.validate(call["args"], WEATHER)


# long enough to kill a stage in, short enough to end well within max_tokens
STORY = {"type": "object", "properties": {"story": {"type": "string", "minLength": 80, "maxLength": 100}},
         "required": ["story"], "additionalProperties": False}


def _story(url: str, at_chunk: Any = lambda _: None) -> tuple[str, dict]:
    stream = _client(url).chat.completions.create(
        model=EMBEDDED_ID, messages=[{"role": "user", "content": "Tell me a story about a dragon, as JSON."}],
        max_tokens=160, temperature=0, stream=True, stream_options={"include_usage": True},
        response_format={"type": "json_schema", "json_schema": {"name": "story", "schema": STORY}})
    text, usage = "", {}
    for n, chunk in enumerate(stream, 1):
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        text += "".join(c.delta.content or "" for c in chunk.choices)
        at_chunk(n)
    return text, usage


@on("3-spec")
def test_a_constrained_stream_whose_final_stage_is_killed_resumes_and_ends_the_same(served):
    """The resumed request replays its output into a fresh matcher: the grammar's state is
    carried, and the rest is what an undisturbed run writes. Last on this server: it
    leaves the route rebuilt."""
    reference, plain = _story(served.url)
    final = stage_pids(served.pid)[-1]

    def kill(n: int) -> None:
        if n == 3:
            os.kill(final, signal.SIGKILL)

    text, usage = _story(served.url, at_chunk=kill)
    assert text == reference
    assert usage["completion_tokens"] == plain["completion_tokens"]
    assert usage["resumed"] == 1
    assert final not in stage_pids(served.pid)
    assert len(json.loads(text)["story"]) >= 80  # whole: the grammar held across the resume
