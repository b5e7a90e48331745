"""`mesh bench --scenarios split`: split-N against single-node llama.cpp, decode and time to first token.

Every split server of --stages and the baseline decode the same prompts, their repeats
interleaved in an order that rotates to spread drift, and answer one long prompt for time to
first token. Then how busy each stage of each split is while one stream decodes. Every
other mesh scenario runs these too: they are what the others' servers are started for.
"""

from __future__ import annotations

import functools
import statistics

from bench.harness.busy import busy_during, busy_rows
from bench.harness.client import stream_chat
from bench.harness.harness import Baseline, Row, Setup, Shared
from bench.harness.local_server import LocalServer
from bench.harness.prompts import long_prompt
from bench.harness.streams import run_batches


def rows(shared: Shared) -> list[Row]:
    asked = shared.asked
    return [*_decode_rows(asked.setup, shared.base, shared.servers, asked.prompts, asked.args.repeats),
            *_busy_rows(asked.setup, shared.servers, asked.prompts[:2])]


def _decode_rows(setup: Setup, base: Baseline, servers: dict[int, LocalServer], prompts: list[str],
                 repeats: int) -> list[Row]:
    long = long_prompt(base.tokenizer)
    tps: dict[str, list[float]] = {"baseline": []}
    ttft: dict[str, list[float]] = {"baseline": []}
    for rep in range(repeats):
        units = ["baseline", *[f"split-{n}" for n in servers]]
        units = units[rep % len(units):] + units[: rep % len(units)]  # rotate to spread drift
        for unit in units:
            if unit == "baseline":
                tps[unit] += [base.chat(p, setup.tokens)["decode_tps"] for p in prompts]
                ttft[unit].append(base.chat(long, 2)["ttft"])
                continue
            url = servers[int(unit.split("-")[1])].url
            tps.setdefault(unit, []).extend(
                stream_chat(url, setup.model_id, p, setup.tokens).decode_tps for p in prompts)
            ttft.setdefault(unit, []).append(stream_chat(url, setup.model_id, long, 2).ttft)
    b_tps, b_ttft = statistics.median(tps["baseline"]), statistics.median(ttft["baseline"])
    out = [Row("baseline", "decode tok/s", b_tps, b_tps, samples=tps["baseline"]),
           Row("baseline", "TTFT 512-token prompt (s)", b_ttft, b_ttft, samples=ttft["baseline"])]
    goals = {2: (">= 0.95", "<= 1.15"), 3: (">= 0.90", "")}
    for n in servers:
        unit = f"split-{n}"
        g_tps, g_ttft = goals.get(n, ("", ""))
        out.append(Row(unit, "decode tok/s", statistics.median(tps[unit]), b_tps, g_tps, tps[unit]))
        out.append(Row(unit, "TTFT 512-token prompt (s)", statistics.median(ttft[unit]), b_ttft, g_ttft,
                       ttft[unit]))
    return out


def _busy_rows(setup: Setup, servers: dict[int, LocalServer], prompts: list[str]) -> list[Row]:
    """How busy each stage of each split is while one stream decodes."""
    out = []
    for n, server in servers.items():
        _, busy = busy_during(server.url, functools.partial(run_batches, server.url, setup, [[p] for p in prompts]))
        out += busy_rows(f"split-{n}", "1 stream", busy)
    return out
