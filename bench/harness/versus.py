"""Speculating servers against one that does not, on the same prompts: the requests
interleaved, and the rows that compare each server with it (decode rate, accept rate, whether
the text stayed the same). The hybrid and mtp scenarios share them.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from bench.harness.client import StreamTiming, stream_messages
from bench.harness.harness import Row, Setup

GREEDY: Mapping[str, dict[str, Any] | None] = {"": None}


def interleaved(setup: Setup, urls: Mapping[str, str], prompts: list[str], repeats: int,
                samplings: Mapping[str, dict[str, Any] | None] = GREEDY) -> dict[str, list[StreamTiming]]:
    """Each server under each sampling (its key a suffix to the server's name: "none", "self
    sampled"), per prompt and repeat; which goes first rotates, to spread drift. A first short
    request to each pays for lazy loading."""
    for url in urls.values():
        stream_messages(url, setup.model_id, [{"role": "user", "content": prompts[0]}], 2)
    timings: dict[str, list[StreamTiming]] = defaultdict(list)
    runs = [(mode, suffix, sampling) for suffix, sampling in samplings.items() for mode in urls]
    for rep in range(repeats):
        for i, prompt in enumerate(prompts):
            turn = (rep + i) % len(runs)
            for mode, suffix, sampling in runs[turn:] + runs[:turn]:
                messages = [{"role": "user", "content": prompt}]
                timings[f"{mode}{suffix}"].append(stream_messages(urls[mode], setup.model_id, messages, setup.tokens,
                                                                  sampling=sampling))
    return timings


def plain_row(scenario: str, metric: str, none: list[StreamTiming]) -> Row:
    """The server without speculation: its median decode rate, every run's as samples."""
    tps = [t.decode_tps for t in none]
    return Row(scenario, metric, statistics.median(tps), samples=tps)


def versus_rows(scenario: str, label: str, runs: list[StreamTiming], none: list[StreamTiming],
                goal: str = "") -> list[Row]:
    """`label`'s server against `none` run for run: its decode rate over none's (held to
    `goal`), its accept rate (0 where nothing was proposed) and whether every reply was none's."""
    tps = [t.decode_tps for t in runs]
    base = statistics.median(t.decode_tps for t in none)
    stats = [t.speculative for t in runs if t.speculative]
    proposed, accepted = sum(s.proposed for s in stats), sum(s.accepted for s in stats)
    same = all(t.text == ref.text for t, ref in zip(runs, none, strict=True))
    return [Row(scenario, f"{label} tok/s (vs none)", statistics.median(tps), base, goal, tps),
            Row(scenario, f"{label} accept rate", accepted / proposed if proposed else 0.0),
            Row(scenario, f"{label}, outputs identical to none (1 = yes)", float(same), goal="1")]
