"""A completion's text read back into OpenAI tool calls.

The grammar made the text well-formed, so reading it is exact: under `auto` the output is
either free text (which never begins as calls do) or calls from its first byte. The calls
are the marked JSON objects in order (Hermes), the JSON objects one after another (Llama
3.x, and the bare call of a model of unknown format), or the Python list of calls
(Gemma-3). `is_text` tells a stream which of the two it is as soon as it can.

Output cut short by max_tokens keeps its last call as OpenAI does: its name and the text of
its arguments so far, JSON or not yet. The grammar writes a call's name first, so a call is
known by name once that is whole; before that it names nothing a client could run, and is
left out (when it is the only call, the text is returned as content: the tokens were billed).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from mesh.api.pythonic_calls import cut_pythonic, read_pythonic
from mesh.constraints.tools import ToolFormat

_STRING = r'"(?:[^"\\]|\\.)*"'  # a whole JSON string
_NAME = re.compile(rf"\s*\{{\s*\"name\"\s*:\s*({_STRING})")  # a call object's start, to its whole name
_KEY = re.compile(rf"\s*,\s*{_STRING}\s*:\s*")  # the arguments' key after it


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
    """(content, calls) of `text`; no calls when it holds none (free text under `auto`), or
    when it was cut before the first call's name was whole (then the text is the content)."""
    if fmt.lead is not None and not text.startswith(fmt.lead):
        return text, []
    if fmt.pythonic:
        calls = [_new(name, arguments) for name, arguments in read_pythonic(text)]
        cut = cut_pythonic(text)
        calls += [_new(*cut)] if cut is not None else []
    elif fmt.begin is None or fmt.end is None:
        calls = _objects(text, fmt)
    else:
        calls = _marked(text, fmt.begin.text, fmt.end.text, fmt)
    return (None, calls) if calls or not text else (text, [])


def _marked(text: str, begin: str, end: str, fmt: ToolFormat) -> list[ToolCall]:
    """The call objects between `begin` and `end` markers, in order."""
    calls, at = list[ToolCall](), 0
    while (at := text.find(begin, at)) >= 0:
        close = text.find(end, at + len(begin))
        if close < 0:  # the last call, its end marker not written (max_tokens)
            cut = _last(text[at + len(begin) :], fmt)
            return [*calls, cut] if cut is not None else calls
        call = _call(text[at + len(begin) : close], fmt)
        if call is None:
            break
        calls.append(call)
        at = close + len(end)
    return calls


def _last(body: str, fmt: ToolFormat) -> ToolCall | None:
    """A call whose end marker was not written: whole if its object is, else cut short."""
    try:
        value, _ = json.JSONDecoder().raw_decode(body.lstrip())
    except json.JSONDecodeError:
        return _partial(body)
    return _read(value, fmt)


def _objects(text: str, fmt: ToolFormat) -> list[ToolCall]:
    """The call objects written one after another, `fmt.between` apart."""
    decoder, calls, at = json.JSONDecoder(), list[ToolCall](), 0
    while True:
        try:
            value, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            cut = _partial(text[at:])
            return [*calls, cut] if cut is not None else calls
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


def _partial(body: str) -> ToolCall | None:
    """A call object cut short: its name, once whole, and its arguments' text so far (nothing
    before their key is whole); None before the name is whole."""
    head = _NAME.match(body)
    if head is None:
        return None
    key = _KEY.match(body, head.end())
    try:
        name = json.loads(head.group(1))
    except json.JSONDecodeError:  # an escape no JSON has: the grammar never writes one
        return None
    return _new(name, body[key.end():] if key is not None else "")


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
