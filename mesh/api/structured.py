"""response_format, tools and tool_choice read into the grammar a request must follow.

`structure` (blocking work none: it only reads the body) says what the request asks; its
grammar is compiled later, off the event loop (`constrain`). A request that asks for free
text, or tools with `tool_choice: "none"`, gets no grammar.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mesh.api.error import bad_request
from mesh.api.tool_format import BARE, functions_of, model_name, tool_format, tools_message
from mesh.backend import GenerationRequest
from mesh.constraints.compile import compile_grammar
from mesh.constraints.errors import ConstraintError
from mesh.constraints.schema import explain, schema_grammar
from mesh.constraints.tools import ToolFormat, tool_grammar
from mesh.model.tokenizer import Tokenizer

_ANY_OBJECT: dict[str, Any] = {"type": "object"}
_FUNCTION_NAME = re.compile("[a-zA-Z0-9_-]{1,64}")  # OpenAI's; ASCII only, unlike \w


@dataclass(frozen=True)
class Tools:
    """A request's tools as the response reads them back: the format calls are written in."""

    format: ToolFormat
    message: str  # the system text offering them


@dataclass(frozen=True)
class Structure:
    grammar: str
    kind: str  # json_object, json_schema, tools
    param: str  # the field a compile error names
    explain: Callable[[str], ConstraintError]
    tools: Tools | None = None


def structure(tok: Tokenizer, response_format: dict[str, Any] | None, tools: list[dict[str, Any]] | None,
              tool_choice: str | dict[str, Any] | None, parallel: bool | None) -> Structure | None:
    """What the request's output must follow; None for free text. A 400 for what cannot be served."""
    _check_tools(tools or [])  # even under tool_choice "none": OpenAI refuses a bad tool whatever the choice
    choice = _choice(tool_choice, tools)
    if tools and choice != "none":
        if response_format not in (None, {"type": "text"}):
            raise bad_request("response_format and tool calls cannot be combined; send one", "response_format")
        return _tools(tok, tools, choice, parallel is not False)
    return _response_format(response_format)


def _response_format(rf: dict[str, Any] | None) -> Structure | None:
    kind = rf.get("type") if isinstance(rf, dict) else None
    if rf is None or kind == "text":
        return None
    if kind == "json_object":
        return _schema(_ANY_OBJECT, "json_object", "response_format")
    if kind != "json_schema":
        raise bad_request(f"response_format type {kind!r} is not one of 'text', 'json_object', 'json_schema'",
                          "response_format")
    spec = rf.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request("response_format.json_schema must be an object with a 'name' and a 'schema'",
                          "response_format.json_schema")
    if not isinstance(spec.get("name"), str):
        raise bad_request("missing required parameter: 'response_format.json_schema.name'",
                          "response_format.json_schema.name", "missing_required_parameter")
    # OpenAI lets `schema` be left out: the output is then held to a JSON object, as json_object's
    return _schema(spec.get("schema", _ANY_OBJECT), "json_schema", "response_format.json_schema.schema")


def _schema(schema: Any, kind: str, param: str) -> Structure:
    try:
        grammar = schema_grammar(schema, param)
    except ConstraintError as exc:
        raise bad_request(str(exc), exc.param) from None
    return Structure(grammar, kind, param, lambda error: explain(error, schema, param))


def _choice(tool_choice: str | dict[str, Any] | None, tools: list[dict[str, Any]] | None) -> str:
    """"none", "auto", "required" or the named function's name."""
    if tool_choice is None:
        return "auto" if tools else "none"
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise bad_request(f"tool_choice {tool_choice!r} is not 'none', 'auto', 'required' or a function",
                              "tool_choice")
        if tool_choice != "none" and not tools:
            raise bad_request(f"tool_choice {tool_choice!r} needs tools", "tool_choice")
        return tool_choice
    name = (tool_choice.get("function") or {}).get("name") if tool_choice.get("type") == "function" else None
    if not isinstance(name, str):
        raise bad_request('a named tool_choice is {"type": "function", "function": {"name": ...}}', "tool_choice")
    if name not in {(t.get("function") or {}).get("name") for t in tools or []}:
        raise bad_request(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
    return name


def _check_tools(tools: list[dict[str, Any]]) -> None:
    """Each tool is a function with a name OpenAI allows, no two with the same name: a call
    names its function, so a name the model cannot write, or two alike, cannot be answered."""
    seen: dict[str, int] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function")
        if tool.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                              f"tools.{i}")
        name = fn["name"]
        if not _FUNCTION_NAME.fullmatch(name):
            raise bad_request(f"tools[{i}].function.name {name[:80]!r} is not a function name: it must be 1 to 64 "
                              "letters, digits, '_' or '-'", f"tools.{i}.function.name")
        if name in seen:
            raise bad_request(f"tools[{i}].function.name {name!r} is the name of tools[{seen[name]}] too; each "
                              "function needs a name of its own", f"tools.{i}.function.name")
        seen[name] = i


def _tools(tok: Tokenizer, tools: list[dict[str, Any]], choice: str, parallel: bool) -> Structure:
    for i, tool in enumerate(tools):
        params = tool["function"].get("parameters", _ANY_OBJECT)
        _schema(params, "tools", f"tools[{i}].function.parameters")  # each one's 400 names it
    fmt = tool_format(tok)
    if fmt is None:
        if choice == "auto":
            raise bad_request(f"tool_choice 'auto' needs the model's own tool-call format, and that of "
                              f"{model_name(tok)!r} is not known; use 'required' or name a function", "tool_choice")
        fmt = BARE
    functions = functions_of(tools)
    try:
        grammar = tool_grammar(functions, choice, parallel, fmt)
    except ConstraintError as exc:  # a name the model's call format cannot write
        raise bad_request(str(exc), exc.param) from None
    offered = [t["function"] for t in tools]
    # explained over the tools as sent, so a path reads as the request's: tools[0].function...
    return Structure(grammar, "tools", "tools", lambda error: explain(error, tools, "tools"),
                     Tools(fmt, tools_message(offered, fmt)))


async def constrain(tok: Tokenizer, s: Structure, generation: GenerationRequest) -> GenerationRequest:
    """`generation` (a GenerationRequest) with the structure's grammar compiled in; a 400 if it cannot be."""
    try:
        constraint = await compile_grammar(tok, s.grammar, s.kind, s.explain, s.param)
    except ConstraintError as exc:
        raise bad_request(str(exc), exc.param) from None
    return dataclasses.replace(generation, constraint=constraint)
