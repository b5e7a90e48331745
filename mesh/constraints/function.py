"""A function offered as a tool, and the JSON style every tool grammar writes values in."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# one space after ':' and ',', nothing else between tokens: as in schema.py
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Function:
    name: str
    parameters: dict[str, Any]
