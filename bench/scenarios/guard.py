"""`mesh bench --scenarios guard`: the ratios issue 42 named, in one run, held to BENCHMARKS.md.

Run it before a release (it is too noisy for CI). Five checks, each the ratio of two
measurements made side by side; every check is measured once per round, in an order that
rotates, so drift on the machine falls on all of them alike:
- prompt lookup: the copy-heavy chat reply (bench/harness/workloads.py), `--strategy ngram`
  against no speculation, split-2, 0 ms;
- a split's cost: split-2 against one node, no draft, 0 ms (with --machines each stage is
  its own core, as the figure was recorded);
- constrained: the draft and forced tokens against no speculation on the nested recipe
  schema, split-2, 20 ms a hop;
- a verify row: the final stage's compute per row of verify frames (the package's draft at
  a fixed window of 8, one frame out) against per row of plain decodes (the split-2 server
  without a draft), from each server's /metrics;
- never losing (issue 58): the held-out corpus (bench/scenarios/corpus.py), one request of
  every kind a round, on a server per strategy (prompt lookup, the defaults, the draft alone)
  and one without speculation, split-2, 0 ms: the worst whole-request ratio of any strategy on any
  request. The first four are the bench's own cases, which speculation was tuned on; this
  one is what a regression on work nobody tuned for shows up in.
Every server cuts on parameters, so the final stage holds the same layers in all of them and
in every run.
A check falls when its ratio is more than 15% worse than the figure in BENCHMARKS.md's
"Guard figures" table (below it; above it for the verify row, where less is better); then
the run exits 1. A check with no figure there is printed and not judged.
"""

from __future__ import annotations

import contextlib
import re
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.harness.breakdown import Counters, compute_per_row, scrape
from bench.harness.client import stream_chat, stream_messages
from bench.harness.corpus import SEED, corpus
from bench.harness.corpus_modes import MODES, measure, whole
from bench.harness.harness import Asked, Outcome, Row, ServeOptions, Setup, serve
from bench.harness.workloads import COPY_PROMPT, RECIPE, RECIPE_PROMPT

FIGURES = Path(__file__).resolve().parents[2] / "BENCHMARKS.md"
HEADING = "## Guard figures"
SLACK = 0.15  # how much worse than its figure a ratio may measure before the guard fails
LOOKUP, SPLIT, CONSTRAINED, VERIFY, WORST = (
    "prompt lookup ÷ no speculation, copy-heavy chat, split-2, 0 ms",
    "split-2 ÷ one node, no draft, 0 ms",
    "draft + forced ÷ no speculation, recipe schema, split-2, 20 ms",
    "verify row ÷ decode row, final stage compute, served",
    "worst request ÷ no speculation, held-out corpus, every strategy, split-2, 0 ms",
)
LOWER_IS_BETTER = {VERIFY}
PARAMETER_CUT = ("--cut-on", "parameters")
RECIPE_FORMAT = {"response_format": {"type": "json_schema",
                                     "json_schema": {"name": "recipe", "schema": RECIPE, "strict": True}}}


Sides = dict[str, tuple[list[float], list[float]]]  # check -> (numerator, denominator) samples, one a round


def recorded(text: str) -> dict[str, float]:
    """The figures of BENCHMARKS.md's guard table: check -> ratio (its first two cells)."""
    if HEADING not in text:
        return {}
    section = text.split(HEADING, 1)[1].split("\n## ", 1)[0]
    figures = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and re.fullmatch(r"\d+(\.\d+)?", cells[1]):
            figures[cells[0]] = float(cells[1])
    return figures


def verdict(check: str, ratio: float, figure: float | None) -> str:
    """"ok", "FELL" (more than SLACK worse than its figure), or "no figure"."""
    if figure is None:
        return "no figure"
    worse = ratio > figure * (1 + SLACK) if check in LOWER_IS_BETTER else ratio < figure * (1 - SLACK)
    return "FELL" if worse else "ok"


def _bound(check: str, figure: float | None) -> str:
    """The goal column: how far the ratio may go before the check falls."""
    if figure is None:
        return ""
    return f"<= {figure * (1 + SLACK):.3g}" if check in LOWER_IS_BETTER else f">= {figure * (1 - SLACK):.3g}"


def _rounds(setup: Setup, urls: dict[str, str], rounds: int) -> Sides:
    """Every check once a round, the order rotating; the verify row's counters around it all."""
    sides: Sides = {c: ([], []) for c in (LOOKUP, SPLIT, CONSTRAINED)}
    prompt = "Write a short story about a lighthouse keeper who finds a message in a bottle."
    copy = [{"role": "user", "content": COPY_PROMPT}]
    recipe = [{"role": "user", "content": RECIPE_PROMPT}]
    steps: dict[str, Callable[[], tuple[float, float]]] = {
        LOOKUP: lambda: (stream_messages(urls["ngram"], setup.model_id, copy, 200, ignore_eos=False).decode_tps,
                         stream_messages(urls["split-2"], setup.model_id, copy, 200, ignore_eos=False).decode_tps),
        SPLIT: lambda: (stream_chat(urls["split-2"], setup.model_id, prompt, setup.tokens).decode_tps,
                        stream_chat(urls["split-1"], setup.model_id, prompt, setup.tokens).decode_tps),
        CONSTRAINED: lambda: (
            stream_messages(urls["spec 20 ms"], setup.model_id, recipe, 160, False, RECIPE_FORMAT).decode_tps,
            stream_messages(urls["none 20 ms"], setup.model_id, recipe, 160, False, RECIPE_FORMAT).decode_tps)}
    before = {name: scrape(urls[name]) for name in ("split-2", "verify")}
    order = list(steps)
    for r in range(rounds):
        for check in order[r % len(order):] + order[: r % len(order)]:
            top, bottom = steps[check]()
            sides[check][0].append(top)
            sides[check][1].append(bottom)
        stream_chat(urls["verify"], setup.model_id, prompt, setup.tokens)
    verify = _per_row(urls["verify"], before["verify"], "verify")
    decode = _per_row(urls["split-2"], before["split-2"], "decode")
    sides[VERIFY] = ([verify], [decode])
    sides[WORST] = _worst(setup, urls, rounds)
    return sides


def _worst(setup: Setup, urls: dict[str, str], rounds: int) -> tuple[list[float], list[float]]:
    """The corpus's worst request: `rounds` requests of every kind on every corpus server, each
    after the others in a rotating order; none's whole request and the strategy's on the
    request and strategy where their ratio is lowest."""
    timings = measure(setup, {mode: urls[f"corpus {mode}"] for mode in MODES}, corpus(SEED, rounds), 1)
    pairs = [(whole(timings[("none", name)][0]), whole(runs[0])) for (mode, name), runs in timings.items()
             if mode != "none"]
    none, mode = min(pairs, key=lambda p: p[0] / p[1])
    return [none], [mode]


def _per_row(url: str, before: Counters, kind: str) -> float:
    """ms of the final stage's compute per row of `kind` frames since `before`."""
    after = scrape(url)
    rows = {stage: ms for (k, stage), ms in compute_per_row(after.since(before), after, before).items() if k == kind}
    if not rows:
        raise RuntimeError(f"guard: {url} ran no {kind} frames")
    return rows[max(rows, key=lambda s: int(s) if s.isdigit() else -1)]


def _servers(setup: Setup, tmp: Path, stack: contextlib.ExitStack) -> dict[str, str]:
    """Every server the checks ask, each cut on parameters so the cuts are the same every run."""
    def up(stages: int, *flags: str, **kw: Any) -> str:
        return stack.enter_context(serve(setup, tmp, stages, ServeOptions(extra=(*PARAMETER_CUT, *flags), **kw))).url

    urls = {"split-1": up(1), "split-2": up(2), "ngram": up(2, strategy="ngram"),
            "none 20 ms": up(2, "--no-forced-drafts", delay_ms=20.0), "spec 20 ms": up(2, draft=True, delay_ms=20.0),
            "verify": up(2, "--draft-window", "8", draft=True, in_flight=1)}
    for mode, kw in MODES.items():  # the corpus scenario's servers, as it runs them
        kw = dict(kw)
        urls[f"corpus {mode}"] = up(2, *kw.pop("extra", ()), **kw)
    return urls


def guard_rows(setup: Setup, rounds: int, figures: dict[str, float]) -> tuple[list[Row], list[str]]:
    """The rows (each side's median, and their ratio), and the checks that fell."""
    with tempfile.TemporaryDirectory(prefix="mesh-bench-guard-") as tmp, contextlib.ExitStack() as stack:
        sides = _rounds(setup, _servers(setup, Path(tmp), stack), rounds)
    rows, fell = [], []
    for check, (top, bottom) in sides.items():
        num, den, figure = statistics.median(top), statistics.median(bottom), figures.get(check)
        judged = verdict(check, num / den, figure)
        rows.append(Row("guard", f"{check} ({judged}; recorded {figure if figure is not None else '-'})",
                        num, den, _bound(check, figure), top))
        fell += [check] if judged == "FELL" else []
    return rows, fell


def run(asked: Asked) -> Outcome:
    if not FIGURES.is_file():
        raise SystemExit(f"mesh bench: guard reads its figures from {FIGURES}, which a checkout has and this "
                         "install lacks")
    figures = recorded(FIGURES.read_text())
    rows, fell = guard_rows(asked.setup, asked.args.repeats, figures)
    note = (f"guard: {len(fell)} of {len(rows)} checks fell more than {SLACK:.0%} below BENCHMARKS.md's figure: "
            + "; ".join(fell)) if fell else f"guard: every check within {SLACK:.0%} of BENCHMARKS.md's figures"
    return Outcome(rows, [note], failed=bool(fell))
