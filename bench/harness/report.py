"""The results: the header line of a run, and the table of rows."""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import re
from pathlib import Path
from typing import Any

from bench.harness.harness import Row, Setup
from stage.llama_model import flash_attn, use_extra_bufts


def header(setup: Setup, args: argparse.Namespace) -> dict[str, Any]:
    machines = {"machines": setup.machines.describe([int(n) for n in args.stages.split(",")])} \
        if setup.machines else {}
    return {"model": setup.model_id, "quant": setup.quant, "threads": setup.threads, **machines,
            "extra buffer types": "on" if use_extra_bufts() else "off",
            "flash attn": "on" if flash_attn() else "off",
            "tokens": setup.tokens, "repeats": args.repeats, "prompts": args.prompts,
            "machine": machine()}


def machine() -> str:
    return f"{platform.node()}, {_cpu_name()}, {os.cpu_count()} cores"


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown cpu"


def format_table(header: dict[str, Any], rows: list[Row]) -> str:
    lines = [" · ".join(f"{k} {v}" for k, v in header.items()), "",
             "| scenario | metric | value | baseline | ratio | goal |", "|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r.ratio:.3f}" if r.ratio is not None else ""
        base = f"{r.baseline:.2f}" if r.baseline is not None else ""
        lines.append(f"| {r.scenario} | {r.metric} | {r.value:.2f} | {base} | {ratio} | {r.goal} |")
    return "\n".join(lines)


def proposer_totals(breakdowns: list[dict[str, dict[str, float]]]) -> dict[str, tuple[float, float]]:
    """Proposed and accepted per proposer, summed over requests' `by_proposer`."""
    totals: dict[str, tuple[float, float]] = {}
    for by in breakdowns:
        for name, counts in by.items():
            p, a = totals.get(name, (0.0, 0.0))
            totals[name] = (p + counts.get("proposed", 0.0), a + counts.get("accepted", 0.0))
    return totals


def met(goal: str, value: float) -> bool | None:
    """Whether `value` meets a goal such as "<= 0.25" or ">= 1"; None for no goal."""
    found = re.fullmatch(r"\s*(<=|>=|==)\s*(-?[0-9.]+)\s*", goal)
    if not found:
        return None
    op, bound = found.group(1), float(found.group(2))
    return {"<=": value <= bound, ">=": value >= bound, "==": value == bound}[op]
