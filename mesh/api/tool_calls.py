"""A completion's text read back into OpenAI tool calls.

The grammar made the text well-formed, so reading it is exact: under `auto` the output is
either free text (which never begins as calls do) or calls from its first byte. The calls
are the marked JSON objects in order (Hermes), the JSON objects one after another (Llama
3.x, and the bare call of a model of unknown format), or the Python list of calls
(Gemma-3). `is_text` tells a stream which of the two it is as soon as it can.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

from mesh.api.pythonic_calls import read_pythonic
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
    if fmt.lead is not None and not text.startswith(fmt.lead):
        return text, []
    if fmt.pythonic:
        calls = [_new(name, arguments) for name, arguments in read_pythonic(text)]
    elif fmt.begin is None or fmt.end is None:
        calls = _objects(text, fmt)
        if fmt.lead is None and not calls:
            return text, []
    else:
        calls = _marked(text, fmt.begin.text, fmt.end.text, fmt)
    return None, calls


def _marked(text: str, begin: str, end: str, fmt: ToolFormat) -> list[ToolCall]:
    """The call objects between `begin` and `end` markers, in order."""
    calls, at = [], 0
    while (at := text.find(begin, at)) >= 0:
        close = text.find(end, at + len(begin))
        call = _call(text[at + len(begin) : close if close >= 0 else len(text)], fmt)
        if call is None:
            break  # cut short (max_tokens): what is whole is returned, the rest is dropped
        calls.append(call)
        at = close + len(end) if close >= 0 else len(text)
    return calls


def _objects(text: str, fmt: ToolFormat) -> list[ToolCall]:
    """The call objects written one after another, `fmt.between` apart."""
    decoder, calls, at = json.JSONDecoder(), list[ToolCall](), 0
    while True:
        try:
            value, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return calls  # cut short: what is whole is returned
        call = _read(value, fmt)
        if call is None:
            return calls
        calls.append(call)
        if not text.startswith(fmt.between, at):
            return calls
        at += len(fmt.between)


def is_text(start: str, fmt: ToolFormat) -> bool:
    """Whether an output beginning `start` is free text: it cannot be the beginning of calls."""
    lead = fmt.lead or ""
    return bool(lead) and bool(start) and not lead.startswith(start[: len(lead)])


def _call(body: str, fmt: ToolFormat) -> ToolCall | None:
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    return _read(value, fmt)


def _read(value: Any, fmt: ToolFormat) -> ToolCall | None:
    """A call object: its name, and its arguments under the format's key (or OpenAI's)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    key = fmt.arguments if fmt.arguments in value else "arguments"
    if key not in value:
        return None
    return _new(value["name"], value[key])


def _new(name: str, arguments: Any) -> ToolCall:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall("call_" + secrets.token_hex(12), name, text)
