"""A completion's text read back into OpenAI tool calls.

The grammar made the text well-formed, so reading it is exact: under `auto` the output is
either free text (which never begins with the call marker) or calls from its first byte;
the calls are the marked JSON objects in order. A bare call (a model of unknown format) is
the whole text. `is_text` tells a stream which of the two it is as soon as it can.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass

from mesh.constraints.tools import ToolFormat


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def as_dict(self, index: int | None = None) -> dict[str, object]:
        out: dict[str, object] = {"id": self.id, "type": "function",
                                  "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def parse_calls(text: str, fmt: ToolFormat) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of `text`; no calls when it holds none (free text under `auto`)."""
    if fmt.begin is None or fmt.end is None:
        call = _call(text)
        return (None, [call]) if call is not None else (text, [])
    begin, end = fmt.begin.text, fmt.end.text
    if not text.startswith(begin):
        return text, []
    calls, at = [], 0
    while (at := text.find(begin, at)) >= 0:
        close = text.find(end, at + len(begin))
        call = _call(text[at + len(begin) : close if close >= 0 else len(text)])
        if call is None:
            break  # cut short (max_tokens): what is whole is returned, the rest is dropped
        calls.append(call)
        at = close + len(end) if close >= 0 else len(text)
    return None, calls


def is_text(start: str, fmt: ToolFormat) -> bool:
    """Whether an output beginning `start` is free text: it cannot be the call marker's beginning."""
    begin = fmt.begin.text if fmt.begin is not None else ""
    return bool(begin) and bool(start) and not begin.startswith(start[: len(begin)])


def _call(body: str) -> ToolCall | None:
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or "arguments" not in value:
        return None
    arguments = value["arguments"]
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall("call_" + secrets.token_hex(12), value["name"], text)
