"""`mesh bench --scenarios prompt_lookup`: prompt lookup on the copy-heavy chat case alone (issue 42).

The case where a prompt-lookup proposal should pay most: a chat message asking for a given
function rewritten with one identifier renamed, so the reply copies most of its prompt (the
`ngram` scenario's copy-heavy workload, without its other workloads and modes). Greedy, up to
--tokens (the issue measured 200), ending at EOS as a real client's reply does. At each per-hop
delay (alone, 0 and 20 ms unless --wire-delays says), two split-2 servers decode it,
interleaved: no speculation and `--strategy ngram`. Rows: both decode rates, n-gram's accept
rate, and whether speculation left the reply as it was (greedy: it must).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

from bench.harness.client import StreamTiming, stream_messages
from bench.harness.harness import Asked, Outcome, Row, Setup, split2_per_delay
from bench.harness.workloads import COPY_PROMPT

# mode -> serve() keywords; "none" first: n-gram is measured against it
MODES: dict[str, dict[str, Any]] = {"none": {}, "ngram": {"strategy": "ngram"}}
GOAL = ">= 2.0"  # issue 42's, n-gram over no speculation, at every delay


def prompt_lookup_rows(setup: Setup, delays: list[float], repeats: int) -> list[Row]:
    """One delay at a time, two split-2 servers each."""
    rows: list[Row] = []
    for d, urls in split2_per_delay(setup, "mesh-bench-prompt-lookup-", delays, MODES):
        rows += lookup_rows(f"prompt_lookup copy-heavy split-2 {d:g} ms", _measure(setup, urls, repeats))
    return rows


def _measure(setup: Setup, urls: dict[str, str], repeats: int) -> dict[str, list[StreamTiming]]:
    """Both modes per repeat; which goes first alternates, to spread drift."""
    timings: dict[str, list[StreamTiming]] = defaultdict(list)
    messages = [{"role": "user", "content": COPY_PROMPT}]
    modes = list(urls)
    for rep in range(repeats):
        for mode in modes[rep % len(modes):] + modes[: rep % len(modes)]:
            timings[mode].append(stream_messages(urls[mode], setup.model_id, messages, setup.tokens,
                                                 ignore_eos=False))
    return timings


def lookup_rows(scenario: str, timings: dict[str, list[StreamTiming]]) -> list[Row]:
    tps = {mode: [t.decode_tps for t in timings[mode]] for mode in MODES}
    med = {mode: statistics.median(values) for mode, values in tps.items()}
    stats = [t.speculative for t in timings["ngram"] if t.speculative]
    proposed, accepted = sum(s.proposed for s in stats), sum(s.accepted for s in stats)
    # a rate of nothing: say so rather than print a 0 that reads as all refused
    accept = (Row(scenario, "n-gram accept rate", accepted / proposed) if proposed
              else Row(scenario, "n-gram accept rate (nothing proposed)", 0.0))
    same = all(t.text == ref.text for t, ref in zip(timings["ngram"], timings["none"], strict=True))
    return [Row(scenario, "no speculation decode tok/s", med["none"], samples=tps["none"]),
            Row(scenario, "n-gram tok/s (vs none)", med["ngram"], med["none"], GOAL, tps["ngram"]),
            accept,
            Row(scenario, "outputs identical to no speculation (greedy) (1 = yes)", float(same), goal="1")]


def run(asked: Asked) -> Outcome:
    return Outcome(prompt_lookup_rows(asked.setup, asked.delays, asked.args.repeats))
