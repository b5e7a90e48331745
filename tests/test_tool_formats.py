"""Tool-call formats beyond Hermes (issue 27), without a model: Llama 3.x JSON and Gemma-3's
Python list of calls. Each family is recognised from its chat template or GGUF metadata, its
`auto` grammar allows free text or calls in its format only, and what it writes parses
back into OpenAI's `tool_calls`. The vocabulary is the tiny GGUF's bytes (token b + 3 is byte b)."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from mesh.api.error import ApiError
from mesh.api.pythonic_calls import read_pythonic
from mesh.api.structured import structure
from mesh.api.tool_calls import is_text, parse_calls
from mesh.api.tool_format import BARE, GEMMA3, LLAMA3, tool_format, tools_message, written_calls
from mesh.constraints.compile import build
from mesh.constraints.errors import ConstraintError
from mesh.constraints.guide import Guide
from mesh.constraints.tools import Function, Marker, ToolFormat, tool_grammar

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]},
                                            "days": {"type": "integer"}},
           "required": ["city"], "additionalProperties": False}
FUNCTIONS = [Function("get_weather", WEATHER), Function("now", {"type": "object", "properties": {},
                                                                "additionalProperties": False})]
HERMES = ToolFormat("hermes", Marker("<tool_call>"), Marker("</tool_call>"))
TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {"name": f.name, "parameters": f.parameters}}
                              for f in FUNCTIONS]


def _accepts(byte_tokenizer, grammar: str, text: str) -> bool:
    """Whether the grammar takes `text` whole and may end after it."""
    guide = Guide(build(byte_tokenizer, grammar, "tools", lambda e: ConstraintError(e, "tools")))
    tokens = [b + 3 for b in text.encode()]
    return guide.matcher.try_consume_tokens(tokens) == len(tokens) and bool(guide.matcher.is_accepting())


def _fake(template: str = "", architecture: str = "llama", name: str = "") -> Any:
    """What tool_format reads of a tokenizer: the template and the GGUF's metadata."""
    meta = {"general.architecture": architecture, "general.name": name, "general.basename": name}
    return SimpleNamespace(template=template, llm=SimpleNamespace(metadata=meta), special_by_text={},
                           model_id="m")


# -- which family ---------------------------------------------------------------------------

LLAMA31_TEMPLATE = ("{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
                    "{%- elif message.role == 'tool' %}{{- '<|start_header_id|>ipython<|end_header_id|>' }}")
GEMMA3_TEMPLATE = "{{ '<start_of_turn>' + role + '\\n' }}"


@pytest.mark.parametrize(("tok", "family"), [
    (_fake(LLAMA31_TEMPLATE), "llama3"),
    (_fake(name="Llama-3.2 3B Instruct"), "llama3"),
    (_fake("{{ '<|start_header_id|>' }}", name="Meta Llama 3 8B"), None),  # Llama 3.0 has no tool role
    (_fake(GEMMA3_TEMPLATE, "gemma3", "gemma-3"), "gemma3"),
    (_fake("", "gemma3", "Gemma 3 270m"), "gemma3"),  # the test model's GGUF holds no template
    (_fake("<start_function_call>", "gemma3", "functiongemma"), None),  # a format of its own
    (_fake("{{ '<tool_call>' }}"), "hermes"),
    (_fake(name="smollm2"), "hermes"),
    (_fake(), None),
])
def test_the_family_is_recognised_from_the_template_or_the_gguf(tok, family):
    found = tool_format(tok)
    assert (found.family if found is not None else None) == family


def test_auto_on_an_unknown_format_is_a_400_naming_the_model_and_required_still_works():
    tok = _fake(name="Mystery 7B")
    with pytest.raises(ApiError, match="'Mystery 7B'") as err:
        structure(tok, None, TOOLS, "auto", None)
    assert err.value.param == "tool_choice"
    for choice in ("required", {"type": "function", "function": {"name": "now"}}):
        shape = structure(tok, None, TOOLS, choice, None)
        assert shape is not None
        assert shape.tools is not None
        assert shape.tools.format == BARE


@pytest.mark.parametrize(("tok", "fmt"), [(_fake(LLAMA31_TEMPLATE), LLAMA3), (_fake("", "gemma3"), GEMMA3)])
def test_auto_is_served_for_each_known_family_and_the_tools_are_offered_in_its_words(tok, fmt):
    shape = structure(tok, None, TOOLS, "auto", None)
    assert shape is not None
    assert shape.tools is not None
    assert shape.tools.format == fmt
    message = tools_message([t["function"] for t in TOOLS], fmt)
    assert ("[function_name(parameter=value" if fmt.pythonic else '"parameters": <arguments>') in message


# -- Llama 3.x JSON ---------------------------------------------------------------------------

LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}'


def test_llama3_auto_allows_text_or_call_objects_with_their_parameters(byte_tokenizer):
    grammar = tool_grammar(FUNCTIONS, "auto", True, LLAMA3)
    assert _accepts(byte_tokenizer, grammar, "It is sunny.")
    assert _accepts(byte_tokenizer, grammar, LLAMA_CALL)
    assert _accepts(byte_tokenizer, grammar, f'{LLAMA_CALL}; {{"name": "now", "parameters": {{}}}}')
    assert not _accepts(byte_tokenizer, grammar, '{"name": "get_weather", "arguments": {"city": "Paris"}}')
    assert not _accepts(byte_tokenizer, grammar, '{"name": "get_weather", "parameters": {"unit": "c"}}')
    assert not _accepts(byte_tokenizer, grammar, "{not a call")
    single = tool_grammar(FUNCTIONS, "required", False, LLAMA3)
    assert _accepts(byte_tokenizer, single, LLAMA_CALL)
    assert not _accepts(byte_tokenizer, single, f"{LLAMA_CALL}; {LLAMA_CALL}")
    assert not _accepts(byte_tokenizer, single, "It is sunny.")


@pytest.mark.parametrize(("fmt", "written", "name", "arguments"), [
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', "get_weather", '{"city": "Par'),
    (HERMES, '<tool_call>\n{"name": "now", "arguments": {}', "now", "{}"),
    (HERMES, '<tool_call>\n{"name": "now", "argu', "now", ""),
    (HERMES, '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_', "now", "{}"),  # whole but its end marker
    (LLAMA3, '{"name": "get_weather", "parameters": {"city": "Paris", "un', "get_weather", '{"city": "Paris", "un'),
    (GEMMA3, '[get_weather(city="Paris", days=3', "get_weather", '{"city": "Paris", "days": 3'),
    (GEMMA3, '[get_weather(city="Paris", da', "get_weather", '{"city": "Paris"'),
])
def test_a_call_cut_by_max_tokens_keeps_its_name_and_its_arguments_so_far(fmt, written, name, arguments):
    """As OpenAI (issue 53): the arguments' text as far as it was generated, JSON or not yet."""
    content, [call] = parse_calls(written, fmt)
    assert content is None
    assert (call.name, call.arguments) == (name, arguments)
    assert call.id.startswith("call_")


@pytest.mark.parametrize(("fmt", "written"), [(HERMES, '<tool_call>\n{"name": "get_w'), (LLAMA3, '{"na'),
                                              (GEMMA3, "[get_wea")])
def test_a_call_cut_before_its_name_is_whole_leaves_the_text_as_content(fmt, written):
    """It names nothing a client could run; the text is what the tokens were."""
    assert parse_calls(written, fmt) == (written, [])


def test_llama3_calls_parse_and_a_call_cut_short_is_dropped():
    content, calls = parse_calls(f'{LLAMA_CALL}; {{"name": "now", "parameters": {{}}}}; {{"name": "ge', LLAMA3)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris", "unit": "c"}),
                                                                  ("now", {})]
    assert parse_calls("It is sunny.", LLAMA3) == ("It is sunny.", [])
    assert [is_text(s, LLAMA3) for s in ("{", '{"na', "It", " {", "")] == [False, False, True, True, False]


# -- Gemma-3's Python list ----------------------------------------------------------------------

def test_gemma3_auto_allows_text_or_a_list_of_calls_keyed_by_the_schema(byte_tokenizer):
    grammar = tool_grammar(FUNCTIONS, "auto", True, GEMMA3)
    assert _accepts(byte_tokenizer, grammar, "It is sunny.")
    for calls in ('[get_weather(city="Paris")]', '[get_weather(city="Paris", days=3)]',
                  '[get_weather(city="Paris", unit="f", days=3), now()]'):
        assert _accepts(byte_tokenizer, grammar, calls), calls
    for wrong in ('[get_weather(unit="c")]',  # the required city left out
                  '[get_weather(city=3)]',  # not the parameter's type
                  '[get_weather(city="P", unit="k")]',  # not in its enum
                  '[now(x=1)]',  # no such parameter
                  '[get_time()]', "[It is sunny."):
        assert not _accepts(byte_tokenizer, grammar, wrong), wrong
    single = tool_grammar(FUNCTIONS, "now", False, GEMMA3)
    assert _accepts(byte_tokenizer, single, "[now()]")
    assert not _accepts(byte_tokenizer, single, '[get_weather(city="P")]')
    assert not _accepts(byte_tokenizer, single, "[now(), now()]")


def test_gemma3_values_follow_nested_schemas_and_their_refs(byte_tokenizer):
    params = {"type": "object", "$defs": {"Pet": {"type": "object", "properties": {"kind": {"enum": ["cat"]}},
                                                  "required": ["kind"], "additionalProperties": False}},
              "properties": {"pets": {"type": "array", "items": {"$ref": "#/$defs/Pet"}}, "ok": {"type": "boolean"}},
              "required": ["pets", "ok"]}
    grammar = tool_grammar([Function("adopt", params)], "required", False, GEMMA3)
    assert _accepts(byte_tokenizer, grammar, '[adopt(pets=[{"kind": "cat"}], ok=true)]')
    assert not _accepts(byte_tokenizer, grammar, '[adopt(pets=[{"kind": "dog"}], ok=true)]')
    _, [call] = parse_calls('[adopt(pets=[{"kind": "cat"}], ok=true)]', GEMMA3)
    assert json.loads(call.arguments) == {"pets": [{"kind": "cat"}], "ok": True}


def test_a_name_the_pythonic_format_cannot_write_is_refused_naming_it():
    with pytest.raises(ConstraintError, match="'first-name'"):
        tool_grammar([Function("f", {"type": "object", "properties": {"first-name": {}}})], "auto", True, GEMMA3)


def test_gemma3_calls_parse_without_evaluating_anything_and_a_call_cut_short_keeps_its_text():
    content, calls = parse_calls('[get_weather(city="Paris, \\"FR\\"", days=3), now(), get_weather(city="Lo', GEMMA3)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls[:2]] == \
        [("get_weather", {"city": 'Paris, "FR"', "days": 3}), ("now", {})]
    assert (calls[2].name, calls[2].arguments) == ("get_weather", '{"city": "Lo')  # as OpenAI: the text so far
    assert read_pythonic("[__import__('os').system('true')]") == []  # a call that is no name(key=value)
    assert read_pythonic("[f(x=True, y=None, z='a')]") == [("f", {"x": True, "y": None, "z": "a"})]
    assert parse_calls("It is sunny.", GEMMA3) == ("It is sunny.", [])
    assert [is_text(s, GEMMA3) for s in ("[", "[now", "It", "")] == [False, False, True, False]


@pytest.mark.parametrize("fmt", [LLAMA3, GEMMA3])
def test_an_earlier_call_is_written_back_in_the_family_format_and_reads_back(fmt):
    calls = [{"id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}},
             {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": "{}"}}]
    written = written_calls(calls, fmt)
    assert written == ('[get_weather(city="Paris", days=2), now()]' if fmt.pythonic else
                       '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}; '
                       '{"name": "now", "parameters": {}}')
    _, read = parse_calls(written, fmt)
    assert [(c.name, json.loads(c.arguments)) for c in read] == [("get_weather", {"city": "Paris", "days": 2}),
                                                                 ("now", {})]


def test_a_tool_the_models_format_cannot_write_is_a_400_not_a_500():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                         "properties": {"first-name": {}}}}}]
    with pytest.raises(ApiError, match="'first-name'") as err:
        structure(_fake("", "gemma3"), None, tools, "auto", None)
    assert err.value.status == 400


@pytest.mark.parametrize("fmt", [LLAMA3, GEMMA3])
def test_a_malformed_earlier_call_is_still_written_back(fmt):
    """A client's assistant turn is written whatever its tool_calls hold: text, never a 500."""
    written = written_calls([{"id": "x", "function": "not an object"}, {"function": {"name": "f", "arguments": "[1"}}],
                            fmt)
    assert '"[1"' in written
