"""`mesh bench --scenarios sweep`: the cost-aware window against every fixed setting it chooses among.

At each per-hop delay, split-2 with machines emulated as pinned cores: no draft, the
package's defaults (the cost-aware window, warmed up at start as `mesh serve` always is),
and the draft at each fixed (window, frames in flight) of WINDOWS x DEPTHS. All decode the
same prompts, greedy, interleaved, every server once per repeat in an order that rotates.
The rows say what each setting earned, which fixed one was best, and the controller
against it: a controller worth trusting earns at least 0.95 of the best setting at every
delay, and at least as much as no draft where no setting beats it.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import tempfile
from pathlib import Path

from bench.harness.client import stream_chat
from bench.harness.harness import Asked, Outcome, Row, ServeOptions, Setup, serve
from bench.harness.pairs import cost_realistic_pair, package_draft

WINDOWS = (1, 2, 3, 4)
DEPTHS = (1, 3, 5)
PLAIN, DEFAULT = "no draft", "defaults (cost-aware)"


def fixed(k: int, d: int) -> str:
    return f"window {k}, {d} in flight"


def sweep_rows(setup: Setup, prompts: list[str], delays: list[float], repeats: int, tmp: Path,
               pair: str = "") -> list[Row]:
    """`pair` names a target and draft other than the package's own in every row."""
    rows: list[Row] = []
    for delay in delays:
        tps = _measure(setup, prompts, delay, repeats, tmp)
        rows += _rows_at(delay, {name: statistics.median(s) for name, s in tps.items()}, tps, pair)
    return rows


def _measure(setup: Setup, prompts: list[str], delay: float, repeats: int, tmp: Path) -> dict[str, list[float]]:
    with contextlib.ExitStack() as stack:
        urls = {PLAIN: stack.enter_context(serve(setup, tmp, 2, ServeOptions(delay_ms=delay))).url,
                DEFAULT: stack.enter_context(serve(setup, tmp, 2, ServeOptions(draft=True, delay_ms=delay))).url}
        for k in WINDOWS:
            for d in DEPTHS:
                server = serve(setup, tmp, 2, ServeOptions(draft=True, delay_ms=delay, in_flight=d,
                                                           extra=("--draft-window", str(k))))
                urls[fixed(k, d)] = stack.enter_context(server).url
        for url in urls.values():  # a first request pays for lazy loading and warms caches
            stream_chat(url, setup.model_id, prompts[0], 2)
        names = list(urls)
        tps: dict[str, list[float]] = {name: [] for name in names}
        for rep in range(repeats):
            for name in names[rep % len(names):] + names[: rep % len(names)]:
                tps[name] += [stream_chat(urls[name], setup.model_id, p, setup.tokens).decode_tps for p in prompts]
        return tps


def _rows_at(delay: float, tok_s: dict[str, float], samples: dict[str, list[float]], pair: str = "") -> list[Row]:
    scenario = f"sweep split-2, {pair + ', ' if pair else ''}{delay:g} ms"
    rows = [Row(scenario, f"{name} decode tok/s", value, samples=samples[name]) for name, value in tok_s.items()]
    settings = {name: v for name, v in tok_s.items() if name not in (PLAIN, DEFAULT)}
    best = max(settings, key=lambda name: settings[name])
    best_any = max(settings[best], tok_s[PLAIN])
    rows += [Row(scenario, f"best fixed: {best}", settings[best], tok_s[PLAIN]),
             Row(scenario, "defaults ÷ the best of every fixed setting and no draft", tok_s[DEFAULT], best_any,
                 ">= 0.95"),
             Row(scenario, "defaults ÷ no draft", tok_s[DEFAULT], tok_s[PLAIN])]
    return rows


def run(asked: Asked) -> Outcome:
    """The package's own pair, or with --cost-realistic the one peers tables beside it, named."""
    setup, label = asked.setup, ""
    if asked.args.cost_realistic:
        draft = package_draft(setup)
        if draft is None:
            raise SystemExit("mesh bench: --cost-realistic needs a package that ships its draft (the embedded "
                             "model does)")
        pair = cost_realistic_pair(setup, draft, lambda m: print(f"bench: {m}", file=sys.stderr))
        setup, label = pair.setup, pair.label
    with tempfile.TemporaryDirectory(prefix="mesh-bench-sweep-") as tmp:
        rows = sweep_rows(setup, asked.prompts, asked.delays, asked.args.repeats, Path(tmp), label)
    # model and quant in the header are the package's own, which the sweep did not run
    return Outcome(rows, header={"sweep": label} if label else {})
