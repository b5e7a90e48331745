"""The grammar of calls written as a Python list, `[get_weather(city="Paris"), ...]`.

This is the format Gemma-3 is prompted to call tools in (its template defines none; Google's
function-calling guide and vLLM's Gemma-3 template both use it). Each value is written as
JSON under its parameter's schema, so a value is exactly what the schema allows and reads
back with a JSON parser; keyword arguments follow the order of the schema's `properties`,
required ones always there, optional ones free to be left out.
"""

from __future__ import annotations

import json
import re
from typing import Any

from mesh.constraints.errors import ConstraintError
from mesh.constraints.function import JSON_STYLE, Function

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def pythonic_rules(functions: list[Function], parallel: bool) -> list[str]:
    """Lark rules whose `calls` is a list of calls to `functions` (one call unless `parallel`)."""
    repeat = ' (", " call)*' if parallel else ""
    lines = [f'calls: "[" call{repeat} "]"', "call: " + " | ".join(f"f{i}" for i in range(len(functions)))]
    for i, function in enumerate(functions):
        lines += _function_rules(i, function)
    return lines


def _function_rules(i: int, f: Function) -> list[str]:
    params = f.parameters
    props = params.get("properties")
    if not _IDENTIFIER.fullmatch(f.name):
        raise ConstraintError(f"function {f.name!r} cannot be called by this model: its call format "
                              "names functions as Python identifiers", "tools")
    if not isinstance(props, dict) or not props:
        if params.get("additionalProperties") is False:
            return [f'f{i}: "{f.name}()"']
        # no named parameters: any keywords, any JSON values
        return [f'f{i}: "{f.name}(" (k{i} (", " k{i})*)? ")"', f'k{i}: K{i} "=" %json {json.dumps(_styled({}))}',
                f"K{i}: /[A-Za-z_][A-Za-z0-9_]*/"]
    names = list(props)
    for name in names:
        if not _IDENTIFIER.fullmatch(name):
            raise ConstraintError(f"parameter {name!r} of {f.name!r} cannot be passed by this model: its call "
                                  "format names parameters as Python identifiers", "tools")
    required = set(params.get("required") or ())
    # each value's schema is its own root: the definitions "$ref"s point into go with it
    defs: dict[str, Any] = {key: params[key] for key in ("$defs", "definitions") if key in params}
    lines = [f'a{i}_{j}: "{name}=" %json {json.dumps(_styled({**_schema(props[name]), **defs}))}'
             for j, name in enumerate(names)]
    optional = [name not in required for name in names]
    lines += [_tail(i, j, optional[j], len(names)) for j in range(1, len(names))]  # t_0 is never used
    return [f'f{i}: "{f.name}(" {_head(i, 0, optional)} ")"', *lines]


def _head(i: int, j: int, optional: list[bool]) -> str:
    """The keywords from the j-th on, the first written without a comma before it: the j-th
    and its tail, or (when it may be left out) what follows without it; empty past the last."""
    if j == len(optional):
        return ""
    first = f"a{i}_{j} t{i}_{j + 1}" if j + 1 < len(optional) else f"a{i}_{j}"
    if not optional[j]:
        return f"({first})"
    rest = _head(i, j + 1, optional)
    return f"({first} | {rest})" if rest else f"({first})?"  # `rest` may itself be empty


def _tail(i: int, j: int, optional: bool, n: int) -> str:
    """Rule t_j: the j-th keyword after a comma (left out when optional), then the rest."""
    item = f'", " a{i}_{j}'
    rest = f" t{i}_{j + 1}" if j + 1 < n else ""
    return f"t{i}_{j}: ({item})?{rest}" if optional else f"t{i}_{j}: {item}{rest}"


def _schema(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {} if value is True else {"not": {}}


def _styled(schema: dict[str, Any]) -> dict[str, Any]:
    return {**schema, "x-guidance": JSON_STYLE}
