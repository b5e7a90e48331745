"""Tool calls as grammars: what a model may write when it is offered functions.

A call names one of the functions and carries that function's parameters, written in the
model's own format (`ToolFormat`; mesh/api/tool_format.py knows which model writes which):
a JSON object `{"name": ..., "arguments": ...}` in Hermes's `<tool_call>` markers, the
bare object Llama 3.x writes (its arguments under "parameters"), or Gemma-3's Python list
of calls `[name(key=value)]` (mesh/constraints/pythonic.py). `required` and a named function
force one call (or several, with parallel calls); `auto` allows free text or calls, told
apart by how calls begin. A model whose format is unknown writes a bare call object, and
can only be forced to.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

import llguidance

from mesh.constraints.function import JSON_STYLE, Function
from mesh.constraints.pythonic import pythonic_rules

__all__ = ["Function", "Marker", "ToolFormat", "call_schema", "tool_grammar"]

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
    """How a model family writes calls: each call's JSON between `begin` and `end` (none:
    the bare object), or a Python list of calls (`pythonic`)."""

    family: str
    begin: Marker | None  # None: a bare JSON object
    end: Marker | None
    pad: str = "\n"  # after the begin marker and before the end marker
    between: str = "\n"  # between parallel calls
    arguments: str = "arguments"  # the key a call object holds its arguments under
    opens: str | None = None  # what calls begin with, for a format without markers; None: the bare format
    pythonic: bool = False

    @property
    def lead(self) -> str | None:
        """What output that holds calls begins with, and free text never does; None where the
        two cannot be told apart (the bare format of a model not known)."""
        return self.begin.text if self.begin is not None else self.opens


def call_schema(functions: list[Function], arguments: str = "arguments") -> dict[str, Any]:
    """One call to any of `functions`, with that function's arguments under `arguments`."""
    options = [{"type": "object", "properties": {"name": {"const": f.name}, arguments: f.parameters},
                "required": ["name", arguments], "additionalProperties": False} for f in functions]
    return options[0] if len(options) == 1 else {"anyOf": options}


def tool_grammar(functions: list[Function], choice: Choice, parallel: bool, fmt: ToolFormat) -> str:
    """The llguidance grammar of what the model may write. `choice` is "auto", "required"
    or a function's name; a format with no `lead` (a bare call) serves only a forced call."""
    chosen = functions if choice in ("auto", "required") else [f for f in functions if f.name == choice]
    calls = pythonic_rules(chosen, parallel) if fmt.pythonic else _json_rules(chosen, parallel, fmt)
    if choice == "auto":
        assert fmt.lead is not None, "a bare call cannot be told from free text"
        lines = ["start: TEXT | calls", *calls, f"TEXT: {_not_beginning(fmt)}"]
    else:
        lines = ["start: calls", *calls]
    return llguidance.LLMatcher.grammar_from_lark("\n".join(lines) + "\n")


def _json_rules(functions: list[Function], parallel: bool, fmt: ToolFormat) -> list[str]:
    """`calls`: call objects, each in the format's markers, `between` apart."""
    body = f"%json {json.dumps({**call_schema(functions, fmt.arguments), 'x-guidance': JSON_STYLE})}"
    # the bare format, the model's own format not known, is held to one call
    repeat = f' ({json.dumps(fmt.between)} call)*' if parallel and fmt.lead is not None else ""
    if fmt.begin is None or fmt.end is None:
        return [f"calls: call{repeat}", "call: body", f"body: {body}"]
    pad = json.dumps(fmt.pad)
    return [f"calls: call{repeat}", f"call: {fmt.begin.lark()} {pad} body {pad} {fmt.end.lark()}", f"body: {body}"]


def _not_beginning(fmt: ToolFormat) -> str:
    """Free text: anything that does not begin as calls do (or nothing). When the marker is a
    special token no text can spell it, and free text may begin with anything."""
    if fmt.begin is not None and fmt.begin.special is not None:
        return r"/(.|\n)*/"
    lead = fmt.lead or ""
    if len(lead) == 1:
        return rf"/[^{_class(lead)}](.|\n)*|/"
    return rf"/([^{_class(lead[0])}]|{_esc(lead[0])}[^{_class(lead[1])}])(.|\n)*|/"


def _esc(char: str) -> str:
    return "\\" + char if char in ".^$*+?()[]{}|\\/" else char


def _class(char: str) -> str:
    return "\\" + char if char in "\\]^-/[" else char
