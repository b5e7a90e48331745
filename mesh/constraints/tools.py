"""Tool calls as grammars: what a model may write when it is offered functions.

A call is `{"name": <one of the functions>, "arguments": <that function's parameters>}`,
wrapped in the model's own tool-call markers (`ToolFormat`; mesh/api/tool_format.py knows
which model writes which). `required` and a named function force one call (or several,
with parallel calls); `auto` allows free text or calls. A model whose format is unknown
writes a bare call object, and can only be forced to.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

import llguidance

Choice = Literal["auto", "required"] | str  # or the one function's name


@dataclass(frozen=True)
class Marker:
    """A tool-call marker: its text, and its token id when the vocabulary has it as a special token."""

    text: str
    special: int | None = None

    def lark(self) -> str:
        return f"<[{self.special}]>" if self.special is not None else json.dumps(self.text)


@dataclass(frozen=True)
class ToolFormat:
    """How a model family writes a call: begin marker, the call's JSON, end marker."""

    family: str
    begin: Marker | None  # None: a bare JSON object, the format of no model in particular
    end: Marker | None
    pad: str = "\n"  # after the begin marker and before the end marker
    between: str = "\n"  # between parallel calls


@dataclass(frozen=True)
class Function:
    name: str
    parameters: dict[str, Any]


# the JSON style of every grammar: as in schema.py
_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def call_schema(functions: list[Function]) -> dict[str, Any]:
    """One call to any of `functions`, with that function's arguments."""
    options = [{"type": "object", "properties": {"name": {"const": f.name}, "arguments": f.parameters},
                "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
    return options[0] if len(options) == 1 else {"anyOf": options}


def tool_grammar(functions: list[Function], choice: Choice, parallel: bool, fmt: ToolFormat) -> str:
    """The llguidance grammar of what the model may write. `choice` is "auto", "required"
    or a function's name; `fmt.begin` None (a bare call) serves only a forced call."""
    chosen = functions if choice in ("auto", "required") else [f for f in functions if f.name == choice]
    body = f"%json {json.dumps({**call_schema(chosen), 'x-guidance': _STYLE})}"
    if fmt.begin is None or fmt.end is None:
        assert choice != "auto", "a bare call cannot be told from free text"
        return llguidance.LLMatcher.grammar_from_lark(f"start: call\ncall: {body}\n")
    repeat = f' ({json.dumps(fmt.between)} call)*' if parallel else ""
    pad = json.dumps(fmt.pad)
    lines = [f"calls: call{repeat}", f"call: {fmt.begin.lark()} {pad} body {pad} {fmt.end.lark()}", f"body: {body}"]
    if choice == "auto":
        # free text never begins with the marker's text; when the marker is a special token
        # no text can spell it, and free text may begin with anything
        first = fmt.begin.text[0]
        text = r"/(.|\n)*/" if fmt.begin.special is not None else \
            rf"/([^{_class(first)}]|{_esc(first)}[^{_class(fmt.begin.text[1])}])(.|\n)*|/"
        lines = ["start: TEXT | calls", *lines, f"TEXT: {text}"]
    else:
        lines = ["start: calls", *lines]
    return llguidance.LLMatcher.grammar_from_lark("\n".join(lines) + "\n")


def _esc(char: str) -> str:
    return "\\" + char if char in ".^$*+?()[]{}|\\/" else char


def _class(char: str) -> str:
    return "\\" + char if char in "\\]^-/" else char
