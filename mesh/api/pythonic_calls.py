"""Calls written as a Python list, `[get_weather(city="Paris")]`, read back (Gemma-3's format;
the grammar is mesh/constraints/pythonic.py).

The text is parsed as a Python expression, never evaluated. The grammar wrote every value as
JSON, so each is read with a JSON parser from its own source text; a value the model wrote
as a Python literal (a follow-up turn's call, written by a client) is read as one.
"""

from __future__ import annotations

import ast
import json
from typing import Any

MAX_RETRIES = 32  # closing a list cut short is tried at this many of its last ')'


def read_pythonic(text: str) -> list[tuple[str, dict[str, Any]]]:
    """The (name, arguments) of each whole call in `text`, in order; a call cut short (by
    max_tokens) is dropped with what follows it."""
    calls = _parse(text)
    if calls is not None:
        return calls
    ends = [at for at, char in enumerate(text) if char == ")"][-MAX_RETRIES:]
    for at in reversed(ends):  # the longest run of whole calls, closed
        calls = _parse(text[: at + 1] + "]")
        if calls is not None:
            return calls
    return []


def _parse(text: str) -> list[tuple[str, dict[str, Any]]] | None:
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError):
        return None
    if not isinstance(tree.body, ast.List):
        return None
    calls = []
    for node in tree.body.elts:
        call = _call(node, text.strip())
        if call is None:
            return None
        calls.append(call)
    return calls


def _call(node: ast.expr, source: str) -> tuple[str, dict[str, Any]] | None:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    arguments = {}
    for keyword in node.keywords:
        if keyword.arg is None:  # **spread
            return None
        try:
            arguments[keyword.arg] = _value(keyword.value, source)
        except ValueError:
            return None
    return node.func.id, arguments


def _value(node: ast.expr, source: str) -> Any:
    text = ast.get_source_segment(source, node)
    if text is None:
        raise ValueError("no source")
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return ast.literal_eval(text)  # ValueError for anything but a literal
