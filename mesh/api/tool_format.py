"""Which tool-call format a model writes, and how it is told of the tools.

A model calls tools in the format it was trained on. The Hermes format (`<tool_call>` JSON
`</tool_call>`) is SmolLM2's, Qwen's and Hermes's; a model is taken to write it when its
chat template shows the marker or its GGUF names one of those families. Any other model
gets the bare call object, under `required` or a named function only.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

from mesh.constraints.tools import Function, Marker, ToolFormat
from mesh.tokenizer import Tokenizer

HERMES_FAMILIES = ("smollm", "qwen", "hermes")
BARE = ToolFormat("json", None, None)


def tool_format(tok: Tokenizer) -> ToolFormat | None:
    """The model's own tool-call format, or None when it is not known."""
    meta = tok.llm.metadata
    name = f"{meta.get('general.basename', '')} {meta.get('general.name', '')}".lower()
    if "<tool_call>" in (tok.template or "") or any(family in name for family in HERMES_FAMILIES):
        return ToolFormat("hermes", _marker(tok, "<tool_call>"), _marker(tok, "</tool_call>"))
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
    if fmt.begin is None:
        how = 'To call one, reply with only a JSON object: {"name": <function name>, "arguments": <arguments>}.'
    else:
        how = (f"To call one, write {fmt.begin.text}{fmt.pad}"
               f'{{"name": <function name>, "arguments": <arguments>}}{fmt.pad}{fmt.end.text if fmt.end else ""}.')
    return f"You can call these functions, described as JSON Schema:\n<tools>\n{listed}\n</tools>\n{how}"


def functions_of(tools: list[dict[str, Any]]) -> list[Function]:
    return [Function(t["function"]["name"], t["function"].get("parameters") or {"type": "object"}) for t in tools]


def written_calls(calls: list[dict[str, Any]], fmt: ToolFormat | None) -> str:
    """An assistant turn's `tool_calls` as the model writes calls, for a template that cannot
    show them: in its own format when known (so a follow-up turn reads as its training did),
    else as OpenAI's JSON."""
    if fmt is None or fmt.begin is None or fmt.end is None:
        return json.dumps(calls, ensure_ascii=False)
    written = []
    for call in calls:
        fn = call.get("function") or {}
        arguments = fn.get("arguments", {})
        with contextlib.suppress(json.JSONDecodeError):  # else kept as the string it is
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        body = json.dumps({"name": fn.get("name"), "arguments": arguments}, ensure_ascii=False)
        written.append(f"{fmt.begin.text}{fmt.pad}{body}{fmt.pad}{fmt.end.text}")
    return fmt.between.join(written)
