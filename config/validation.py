"""A pydantic validation error as users read it: the field's dotted path and one line.

The TOML config (config/settings.py), a package's speculative block (packages/speculative.py)
and `mesh package` all report a bad field this way.
"""

from __future__ import annotations

from pydantic import ValidationError

_EXPECTED = {"int_type": "int", "string_type": "str", "model_type": "object", "dict_type": "object"}


def problem(exc: ValidationError) -> tuple[str, str]:
    """The first error's dotted path, in serialized names, and a one-line message for users."""
    error = exc.errors()[0]
    kind = error["type"]
    if kind == "value_error":
        message = str(error["ctx"]["error"])
    elif kind == "extra_forbidden":
        message = "unknown field"
    elif kind == "missing":
        message = "required"
    elif kind in _EXPECTED:
        message = f"expected {_EXPECTED[kind]}, got {error['input']!r}"
    else:
        message = error["msg"]
    return ".".join(str(part) for part in error["loc"]), message
