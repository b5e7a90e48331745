"""`mesh bench --scenarios spec`: speculation with the package's draft against none, on the split servers.

At each split (2, and 3 with --machines) and per-hop delay, three servers interleaved:
--no-draft, the package's draft one window at a time, and the draft with the default frames
in flight. One split and delay at a time: loading every combination at once would not fit
in memory. With --breakdown, where the time of the draft's server goes, frame by frame.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
from pathlib import Path

from bench.harness.breakdown import measure
from bench.harness.busy import busy_during, busy_rows
from bench.harness.client import stream_chat
from bench.harness.harness import Row, ServeOptions, Setup, Shared, serve
from bench.harness.local_server import LocalServer
from bench.harness.streams import run_batches
from mesh.api.responses import SpeculativeUsage

SPEC_MODES: dict[str, tuple[bool, int | None]] = {"plain": (False, None), "one": (True, 1), "default": (True, None)}


def rows(shared: Shared) -> list[Row]:
    asked = shared.asked
    stages = [n for n in shared.servers if n in (2, 3)] if asked.setup.machines else [2]
    return _spec_rows(asked.setup, shared.tmp, asked.prompts, stages, asked.delays, asked.args.repeats,
                      asked.args.breakdown)


def _spec_rows(setup: Setup, tmp: Path, prompts: list[str], stages: list[int], delays: list[float],
               repeats: int, breakdown: bool) -> list[Row]:
    out = []
    for n in stages:
        for d in delays:
            with contextlib.ExitStack() as stack:
                servers = {mode: stack.enter_context(serve(setup, tmp, n,
                                                           ServeOptions(draft=draft, delay_ms=d, in_flight=depth)))
                           for mode, (draft, depth) in SPEC_MODES.items()}
                out += _spec_group(setup, f"spec split-{n} {d:g} ms", servers, prompts, repeats, d)
                if breakdown:  # verify frames next to plain decode frames, on the server with the draft
                    url = servers["default"].url
                    run = functools.partial(run_batches, url, setup, [[p] for p in prompts])
                    out += [Row(f"breakdown spec split-{n} {d:g} ms", what, value)
                            for what, value in measure(url, 1, run)]
    return out


def _spec_group(setup: Setup, scenario: str, servers: dict[str, LocalServer], prompts: list[str],
                repeats: int, delay: float) -> list[Row]:
    tps: dict[str, list[float]] = {mode: [] for mode in servers}
    stats: list[SpeculativeUsage] = []
    for _ in range(repeats):
        for mode, server in servers.items():
            for p in prompts:
                timing = stream_chat(server.url, setup.model_id, p, setup.tokens)
                tps[mode].append(timing.decode_tps)
                if mode == "default" and timing.speculative:
                    stats.append(timing.speculative)
    plain, one, default = (statistics.median(tps[mode]) for mode in SPEC_MODES)
    proposed = sum(s.proposed for s in stats)
    windows = sum(s.windows for s in stats)
    goal = ">= 2.5" if delay >= 20 else ">= 1.0" if delay == 0 else ""
    deep_goal = ">= 2.5" if delay >= 50 else ">= 1.8" if delay >= 20 else ""
    _, busy = busy_during(servers["default"].url, lambda: stream_chat(
        servers["default"].url, setup.model_id, prompts[0], setup.tokens))
    return [Row(scenario, "no-draft decode tok/s", plain, samples=tps["plain"]),
            Row(scenario, "draft, 1 window in flight tok/s (vs no-draft)", one, plain, samples=tps["one"]),
            Row(scenario, "draft, default frames in flight tok/s (vs no-draft)", default, plain, goal,
                tps["default"]),
            Row(scenario, "draft, default frames in flight (vs 1 in flight)", default, one, deep_goal),
            Row(scenario, "accept rate", sum(s.accepted for s in stats) / proposed if proposed else 0.0),
            Row(scenario, "mean window", proposed / windows if windows else 0.0),
            *busy_rows(scenario, "draft, default in flight", busy)]
