"""Calls written as a Python list, `[get_weather(city="Paris")]`, read back (Gemma-3's format;
the grammar is mesh/constraints/pythonic.py).

The text is parsed as a Python expression, never evaluated. The grammar wrote every value as
JSON, so each is read with a JSON parser from its own source text; a value the model wrote
as a Python literal (a follow-up turn's call, written by a client) is read as one.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

MAX_RETRIES = 32  # closing a list cut short is tried at this many of its last ')'
_OPEN = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\(")  # a call's whole name
_KEYWORD = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)=\s*")
_COMMA = re.compile(r"\s*,\s*")
_CLOSE = re.compile(r"\s*\)")


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


def cut_pythonic(text: str) -> tuple[str, str] | None:
    """The call `text` ends inside (cut short by max_tokens), past its whole calls: its name and
    its keywords so far as the text of the JSON object they begin (`{"city": "Par`); None when
    no call is open, or its name is not whole yet. Values are read as JSON, as the grammar
    writes them."""
    at = text.find("[")
    if at < 0:
        return None
    at += 1
    while (call := _OPEN.match(text, at)) is not None:
        written, at, closed = _keywords(text, call.end())
        if not closed:
            return call.group(1), "{" + ", ".join(written)
        comma = _COMMA.match(text, at)
        if comma is None:
            return None  # the list closes, or its next call has not begun
        at = comma.end()
    return None


def _keywords(text: str, at: int) -> tuple[list[str], int, bool]:
    """A call's keywords from `at`, each as JSON text (`"key": value`), where they end, and
    whether the call closed there."""
    decoder, written = json.JSONDecoder(), list[str]()
    while (close := _CLOSE.match(text, at)) is None:
        keyword = _KEYWORD.match(text, at)
        if keyword is None:
            return written, at, False  # cut inside a keyword's name: it is left out
        key = json.dumps(keyword.group(1))
        try:
            _, at = decoder.raw_decode(text, keyword.end())
        except json.JSONDecodeError:  # the value is cut: what there is of it
            return [*written, f"{key}: {text[keyword.end():]}"], len(text), False
        written.append(f"{key}: {text[keyword.end():at]}")
        comma = _COMMA.match(text, at)
        if comma is None and _CLOSE.match(text, at) is None:
            return written, at, False
        at = comma.end() if comma is not None else at
    return written, close.end(), True


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
