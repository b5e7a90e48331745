"""Which tool-call format a model writes, and how it is told of the tools.

A model calls tools in the format it was trained or prompted to, recognised from its chat
template, else from its GGUF's architecture and name:
- Hermes (`<tool_call>` JSON `</tool_call>`): SmolLM2, Qwen and Hermes, or a template that
  shows the marker.
- Llama 3.x JSON (`{"name": ..., "parameters": ...}`, calls `; ` apart): a template with the
  `ipython` role of Llama 3.1 and later, or a Llama 3.1-3.3 name.
- Gemma-3's Python list (`[name(key=value)]`): the gemma3 architectures. FunctionGemma, a
  Gemma-3 trained on a format of its own (`<start_function_call>`), is not taken for one.
Any other model gets the bare call object, under `required` or a named function only.
"""

from __future__ import annotations

import contextlib
import json
import re
from typing import Any

from mesh.constraints.tools import Function, Marker, ToolFormat
from mesh.model.tokenizer import Tokenizer

HERMES_FAMILIES = ("smollm", "qwen", "hermes")
BARE = ToolFormat("json", None, None)
LLAMA3 = ToolFormat("llama3", None, None, between="; ", arguments="parameters", opens="{")
GEMMA3 = ToolFormat("gemma3", None, None, between=", ", opens="[", pythonic=True)
_LLAMA3_NAME = re.compile(r"llama[- ]?3\.[123]\b")
_GEMMA3_ARCHITECTURES = ("gemma3", "gemma3n")


def tool_format(tok: Tokenizer) -> ToolFormat | None:
    """The model's own tool-call format, or None when it is not known."""
    meta = tok.llm.metadata
    name = f"{meta.get('general.basename', '')} {meta.get('general.name', '')}".lower()
    template = tok.template or ""
    if "<tool_call>" in template or any(family in name for family in HERMES_FAMILIES):
        return ToolFormat("hermes", _marker(tok, "<tool_call>"), _marker(tok, "</tool_call>"))
    if ("<|start_header_id|>" in template and "ipython" in template) or _LLAMA3_NAME.search(name):
        return LLAMA3
    if meta.get("general.architecture") in _GEMMA3_ARCHITECTURES and "start_function_call" not in template:
        return GEMMA3
    return None


def model_name(tok: Tokenizer) -> str:
    meta = tok.llm.metadata
    return str(meta.get("general.name") or meta.get("general.basename") or tok.model_id)


def _marker(tok: Tokenizer, text: str) -> Marker:
    special = tok.special_by_text.get(text)
    return Marker(text, special.id if special is not None else None)


def tools_message(functions: list[dict[str, Any]], fmt: ToolFormat) -> str:
    """The system text that offers the tools, in the words of the model's format."""
    listed = "\n".join(json.dumps(f, ensure_ascii=False) for f in functions)
    return f"You can call these functions, described as JSON Schema:\n<tools>\n{listed}\n</tools>\n{_how(fmt)}"


def _how(fmt: ToolFormat) -> str:
    if fmt.pythonic:
        return ("To call functions, reply with only a list of calls, [function_name(parameter=value, ...)], "
                "each value written as JSON.")
    call = f'{{"name": <function name>, "{fmt.arguments}": <arguments>}}'
    if fmt.begin is None or fmt.end is None:
        return f"To call one, reply with only a JSON object: {call}."
    return f"To call one, write {fmt.begin.text}{fmt.pad}{call}{fmt.pad}{fmt.end.text}."


def functions_of(tools: list[dict[str, Any]]) -> list[Function]:
    return [Function(t["function"]["name"], t["function"].get("parameters") or {"type": "object"}) for t in tools]


def written_calls(calls: list[dict[str, Any]], fmt: ToolFormat | None) -> str:
    """An assistant turn's `tool_calls` as the model writes calls, for a template that cannot
    show them: in its own format when known (so a follow-up turn reads as its training did),
    else as OpenAI's JSON."""
    if fmt is None or fmt.lead is None:
        return json.dumps(calls, ensure_ascii=False)
    read = [_read(call) for call in calls]
    if fmt.pythonic:
        written = [f"{name}({', '.join(f'{k}={json.dumps(v, ensure_ascii=False)}' for k, v in _items(args))})"
                   for name, args in read]
        return f"[{fmt.between.join(written)}]"
    bodies = [json.dumps({"name": name, fmt.arguments: args}, ensure_ascii=False) for name, args in read]
    if fmt.begin is None or fmt.end is None:
        return fmt.between.join(bodies)
    return fmt.between.join(f"{fmt.begin.text}{fmt.pad}{body}{fmt.pad}{fmt.end.text}" for body in bodies)


def _read(call: dict[str, Any]) -> tuple[Any, Any]:
    """A call's name and arguments, the arguments' JSON text read (kept as the string it is
    when it is no JSON)."""
    fn = call.get("function")
    fn = fn if isinstance(fn, dict) else {}  # a client's turn: whatever it sent is written, never a 500
    arguments = fn.get("arguments", {})
    with contextlib.suppress(json.JSONDecodeError):
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    return fn.get("name"), arguments


def _items(arguments: Any) -> list[tuple[str, Any]]:
    """Keyword arguments of a Python call: an object's entries (anything else, one `value`)."""
    return list(arguments.items()) if isinstance(arguments, dict) else [("value", arguments)]
