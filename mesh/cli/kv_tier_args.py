"""`--cache-ram` and `--cache-disk`: the KV tier's bounds, on `mesh serve` (stage 0 and its
local stages) and `mesh stage` (DESIGN.md §2, "KV tier")."""

from __future__ import annotations

import argparse
import re

from stage.kv_tier import DEFAULT_CACHE_RAM

_SIZE = re.compile(r"([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)(i?[bB])?")
_POWER = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}


def tier_size(text: str) -> int:
    """Bytes from "2GiB", "800MB", "4G" or "0" (none)."""
    match = _SIZE.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"expected a size such as 2GiB, 800MB or 0, got {text!r}")
    number, prefix, unit = match.groups()
    base = 1000 if unit is not None and unit == "B" and prefix and "i" not in unit else 1024
    return int(float(number) * base ** _POWER[prefix.upper()])


def add_kv_tier_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache-ram", type=tier_size, default=DEFAULT_CACHE_RAM, metavar="SIZE",
                   help="host memory for KV evicted from its lane (a conversation whose lane another request "
                   "took): kept there, and loaded back when the conversation returns, so only its new "
                   "tokens are prefilled; least recently used out first, every coordinator's together "
                   "(default: 2GiB; 0: none)")
    p.add_argument("--cache-disk", type=tier_size, default=0, metavar="SIZE",
                   help="disk for KV past --cache-ram, under --cache-dir/kv: kept across restarts of the same "
                   "package, cut, engine and KV type (default: 0, none)")
