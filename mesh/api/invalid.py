"""A request body's validation errors as the one 400 OpenAI would send: the field in `param`,
what was expected in the message.

pydantic reports a union's failure once per member, with the member's type in the location
(`prompt.list[int].0`); a client wants to hear which field, and what it should have been.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import ValidationError
from pydantic_core import ErrorDetails

from mesh.api.error import ApiError, bad_request

# pydantic's error type -> the JSON type it asked for
_EXPECTED = {"string_type": "a string", "int_type": "an integer", "float_type": "a number",
             "bool_type": "a boolean", "list_type": "an array", "dict_type": "an object",
             "model_type": "an object"}
# a union member's type, as pydantic names it -> (one, many) in JSON's words
_NOUNS = {"str": ("a string", "strings"), "int": ("an integer", "integers"), "float": ("a number", "numbers"),
          "bool": ("a boolean", "booleans")}


def invalid_request(exc: ValidationError, nested: Mapping[str, frozenset[str]]) -> ApiError:
    """The first failing field's 400. `nested` names, for each field holding objects of its own
    (`messages`), the fields those objects have, so `param` can name them (`messages.0.role`)."""
    errors = exc.errors()
    first = errors[0]
    if not first["loc"]:  # the body as a whole (body.py lets no such body through)
        return bad_request(f"invalid request: {first['msg']}", None)
    loc, union = _union(first["loc"])
    param = _param(loc, nested)
    if first["type"] == "extra_forbidden":  # the location ends with the unknown key itself
        param = f"{_param(loc[:-1], nested)}.{loc[-1]}" if len(loc) > 1 else str(loc[0])
        return bad_request(f"unrecognized request argument supplied: {param}", param, "unsupported_parameter")
    if first["type"] == "missing":
        return bad_request(f"missing required parameter: '{param}'", param, "missing_required_parameter")
    members = [_noun(str(e["loc"][len(loc)]), plural=False) for e in errors if _union(e["loc"]) == (loc, True)]
    if union and len(members) > 1:  # every member of the union refused it
        return bad_request(f"invalid type for '{param}': expected {_either(members)}", param, "invalid_type")
    if _is_type_error(first):
        return bad_request(f"invalid type for '{param}': expected {_EXPECTED[first['type']]}, "
                           f"but got {_json_type(first['input'])} instead", param, "invalid_type")
    return bad_request(f"invalid value for '{param}': {first['msg']}", param)


def _union(loc: Sequence[int | str]) -> tuple[Sequence[int | str], bool]:
    """The location up to the union member pydantic names in it (`prompt` of `prompt.list[int].0`),
    and whether there was one."""
    for i, part in enumerate(loc[1:], 1):
        if isinstance(part, str) and (part in _NOUNS or "[" in part):
            return loc[:i], True
    return loc, False


def _param(loc: Sequence[int | str], nested: Mapping[str, frozenset[str]]) -> str:
    """The field, its indices, and the fields of the objects it holds; never a key the client
    chose (`logit_bias`'s token ids)."""
    head, *rest = loc
    names = nested.get(str(head), frozenset())
    parts = [str(head)]
    for part in rest:
        if isinstance(part, int):
            parts.append(str(part))
        elif part in names:
            parts.append(part)
            names = frozenset()  # below an object's field: only indices
    return ".".join(parts)


def _is_type_error(error: ErrorDetails) -> bool:
    return error["type"] in _EXPECTED


def _noun(tag: str, plural: bool) -> str:
    if tag.startswith("list[") and tag.endswith("]"):
        inner = _noun(tag[5:-1], plural=True)
        return f"arrays of {inner}" if plural else f"an array of {inner}"
    one, many = _NOUNS.get(tag, ("an object", "objects"))
    return many if plural else one


def _either(nouns: list[str]) -> str:
    unique = list(dict.fromkeys(nouns))
    return unique[0] if len(unique) == 1 else ", ".join(unique[:-1]) + " or " + unique[-1]


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a decimal number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "an object"
