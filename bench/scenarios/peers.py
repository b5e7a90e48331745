"""`mesh bench --scenarios peers`: meshpipe head to head with the llama.cpp a user would pick instead.

Six servers per pair and one-way delay, each "machine" one pinned CPU set running one
thread per CPU: llama-server on one node; llama.cpp's RPC split-2, without and with
llama-server's own speculation on the same draft (bench/harness/llama_cpp.py); meshpipe on
one node, split-2 without a draft and split-2 with its defaults. llama.cpp's one link
goes through the bench's delay proxy, meshpipe's hops through `--wire-delay-ms`, the same
delay each way. All decode the same prompts, greedy, the same number of tokens, as a
streaming client sees it; repeats are interleaved, every server once per repeat in an
order that rotates. The one-node servers have no link, so they stay up for the whole pair
and are measured again beside the split servers of each delay. Two pairs
(bench/harness/pairs.py): the package's own target and draft (about the same cost per token)
and the cost-realistic F32 target with the same draft.

Without --llama-cpp-bin the llama.cpp servers are skipped, and the run says so.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from bench.harness import llama_cpp
from bench.harness.client import StreamTiming, mesh_cuts, stream_chat
from bench.harness.harness import Asked, Outcome, Row, Setup, serve
from bench.harness.llama_cpp import Binaries, RpcSplit, ServerSpec
from bench.harness.pairs import Pair, cost_realistic_pair, package_draft, same_cost_pair

LLAMA_ONE = "llama-server, 1 node"
RPC = "llama.cpp RPC split-2"
RPC_SPEC = "llama.cpp RPC split-2 + its speculation (same draft)"
MESH_ONE = "meshpipe, 1 node"
MESH_PLAIN = "meshpipe split-2, no draft"
MESH_DEFAULT = "meshpipe split-2, defaults (draft)"
UNITS = (LLAMA_ONE, RPC, RPC_SPEC, MESH_ONE, MESH_PLAIN, MESH_DEFAULT)
LLAMA_UNITS = (LLAMA_ONE, RPC, RPC_SPEC)

# (name, numerator, denominator): the ratios issue 26's goals name
RATIOS = (("meshpipe split-2 no-draft ÷ llama.cpp RPC split-2", MESH_PLAIN, RPC),
          ("meshpipe 1 node ÷ llama-server 1 node", MESH_ONE, LLAMA_ONE),
          ("meshpipe split-2 default ÷ llama.cpp RPC + its speculation", MESH_DEFAULT, RPC_SPEC),
          ("meshpipe split-2 default ÷ meshpipe no-draft", MESH_DEFAULT, MESH_PLAIN))


def skipped_message(bins: Binaries | None) -> str:
    """Which rows a run without the llama.cpp binaries leaves out, and why ("" when none)."""
    if bins is None:
        why = f"no --llama-cpp-bin given ({llama_cpp.BUILD_HINT})"
    elif missing := bins.missing():
        why = f"{bins.dir} lacks {', '.join(missing)} ({llama_cpp.BUILD_HINT})"
    else:
        return ""
    return f"peers: skipped the llama.cpp servers ({'; '.join(LLAMA_UNITS)}): {why}"


def goal(ratio: str, delay: float, costly: bool) -> str:
    """Issue 26's goal for a ratio at a delay; the speculation goals differ by pair."""
    if ratio == RATIOS[0][0]:
        return ">= 1.05" if delay == 0 else ""
    if ratio == RATIOS[1][0]:
        return ">= 0.97" if delay == 0 else ""
    if ratio == RATIOS[2][0]:
        return ">= 1.8" if delay == 20 and not costly else ""
    if costly:
        return ">= 2.5" if delay == 20 else ""
    return {0.0: ">= 0.98", 20.0: ">= 1.8", 50.0: ">= 2.0"}.get(delay, "")


@dataclass
class Record:
    """Decode tok/s samples of one pair: (delay, unit) -> samples; 1-node units at every delay."""

    label: str  # the pair's
    costly: bool
    tps: dict[tuple[float, str], list[float]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # e.g. the RPC split's log line
    choices: dict[float, Counter[str]] = field(default_factory=dict)  # delay -> the defaults' controller's picks

    def median(self, delay: float, unit: str) -> float | None:
        samples = self.tps.get((delay, unit))
        return statistics.median(samples) if samples else None


def peer_rows(setup: Setup, pairs: list[Pair], bins: Binaries | None, prompts: list[str], delays: list[float],
              repeats: int, tmp: Path) -> tuple[list[Row], str]:
    """The rows for the results table and JSON, and the side-by-side table issue 26 shows."""
    if skip := skipped_message(bins):
        print(f"bench: {skip}", file=sys.stderr)
    runnable = None if skip else bins
    records = [_measure_pair(pair, runnable, prompts, delays, repeats, tmp) for pair in pairs]
    rows = [row for r in records for row in rows_of(r, delays)]
    rows += [Row("peers", skip, 0.0)] if skip else []
    return rows, "\n\n".join([tables(r, delays) for r in records] + ([skip] if skip else []))


def _measure_pair(pair: Pair, bins: Binaries | None, prompts: list[str], delays: list[float], repeats: int,
                  tmp: Path) -> Record:
    record = Record(pair.label, pair.costly)
    setup = pair.setup
    assert setup.machines is not None  # the peers scenario always emulates machines
    with contextlib.ExitStack() as stack:
        one_node = {MESH_ONE: stack.enter_context(serve(setup, tmp, 1)).url}
        if bins:
            spec = ServerSpec(pair.target, setup.machines.sets[0], setup.ctx)
            one_node[LLAMA_ONE] = stack.enter_context(llama_cpp.llama_server(bins, spec, tmp)).url
        for d in delays:
            with _split_units(pair, bins, d, tmp, record.notes) as split:
                _interleave(setup, {**one_node, **split}, prompts, repeats, d, record)
    return record


@contextlib.contextmanager
def _split_units(pair: Pair, bins: Binaries | None, delay: float, tmp: Path,
                 notes: list[str]) -> Iterator[dict[str, str]]:
    """The split-2 servers at one delay; llama.cpp's get the cut meshpipe's split-2 chose."""
    setup = pair.setup
    assert setup.machines is not None
    with contextlib.ExitStack() as stack:
        units = {MESH_PLAIN: stack.enter_context(serve(setup, tmp, 2, delay_ms=delay)).url,
                 MESH_DEFAULT: stack.enter_context(serve(setup, tmp, 2, draft=True, delay_ms=delay)).url}
        (cut,) = mesh_cuts(units[MESH_PLAIN])
        notes.append(cuts_note(delay, cut, mesh_cuts(units[MESH_DEFAULT])[0]))
        if bins:
            first, second = setup.machines.for_stages(2)
            for unit, draft in ((RPC, None), (RPC_SPEC, pair.draft)):
                link = stack.enter_context(llama_cpp.rpc_link(bins, second, delay, tmp))
                split = RpcSplit((link,), (cut,), setup.manifest.layer_count)
                started = stack.enter_context(llama_cpp.llama_server(bins, ServerSpec(pair.target, first, setup.ctx,
                                                                                      split, draft), tmp))
                units[unit] = started.url
            notes.append(f"{delay:g} ms: llama.cpp RPC split at layer {cut}, as meshpipe's split-2 "
                         f"(-ngl {split.offload}: layers {cut}-{setup.manifest.layer_count - 1} and the head "
                         f"on the RPC device; its log: {started.split})")
        yield units


def cuts_note(delay: float, plain: int, default: int) -> str:
    """Where meshpipe's two split-2 servers cut: each re-cuts at start on its own
    calibrations, so servers started alike may cut apart, and their ratio then compares
    two cuts as well as speculation."""
    if plain == default:
        return f"{delay:g} ms: meshpipe's split-2 servers both cut at layer {plain}"
    return (f"{delay:g} ms: meshpipe's split-2 cut at layer {plain} without a draft and at layer {default} "
            "with its defaults (each re-cut on its own calibrations at start)")


def _interleave(setup: Setup, urls: dict[str, str], prompts: list[str], repeats: int, delay: float,
                record: Record) -> None:
    for url in urls.values():  # a first request pays for lazy loading and warms caches
        stream_chat(url, setup.model_id, prompts[0], 2)
    names = [u for u in UNITS if u in urls]
    for rep in range(repeats):
        for unit in names[rep % len(names):] + names[: rep % len(names)]:
            for p in prompts:
                timing = stream_chat(urls[unit], setup.model_id, p, setup.tokens)
                record.tps.setdefault((delay, unit), []).append(timing.decode_tps)
                if unit == MESH_DEFAULT and (choice := controller_choice(timing)):
                    record.choices.setdefault(delay, Counter())[choice] += 1


def controller_choice(timing: StreamTiming) -> str | None:
    """What the draft's cost-aware controller had settled on when a request ended, from its
    usage; None when no controller reported."""
    chosen = timing.speculative.controller if timing.speculative else None
    draft = (chosen or {}).get("draft")
    if draft is None:
        return None
    if draft.window == 0:
        return "off"
    frames = draft.frames_in_flight
    return f"window {draft.window}, {frames} frame{'s' if frames != 1 else ''} out"


def rows_of(record: Record, delays: list[float]) -> list[Row]:
    rows = []
    for d in delays:
        scenario = f"peers {record.label}, {d:g} ms"
        rows += [Row(scenario, f"{unit} decode tok/s", statistics.median(s), samples=s)
                 for unit in UNITS if (s := record.tps.get((d, unit)))]
        for name, top, bottom in RATIOS:
            num, den = record.median(d, top), record.median(d, bottom)
            if num is not None and den:
                rows.append(Row(scenario, name, num, den, goal(name, d, record.costly)))
    return rows


def tables(record: Record, delays: list[float]) -> str:
    """Decode tok/s, one line per delay and one column per server; then the ratios."""
    fmt: Callable[[float | None], str] = lambda v: f"{v:.1f}" if v is not None else "skipped"  # noqa: E731
    lines = [f"peers, {record.label}: decode tok/s", "",
             "| one-way delay | " + " | ".join(UNITS) + " |", "|---" * (len(UNITS) + 1) + "|"]
    lines += [f"| {d:g} ms | " + " | ".join(fmt(record.median(d, u)) for u in UNITS) + " |" for d in delays]
    lines += ["", "| one-way delay | " + " | ".join(name for name, _, _ in RATIOS) + " |",
              "|---" * (len(RATIOS) + 1) + "|"]
    for d in delays:
        cells = []
        for name, top, bottom in RATIOS:
            num, den = record.median(d, top), record.median(d, bottom)
            want = goal(name, d, record.costly)
            cells.append(f"{num / den:.2f}" + (f" (goal {want})" if want else "") if num is not None and den
                         else "skipped")
        lines.append(f"| {d:g} ms | " + " | ".join(cells) + " |")
    picks = [f"{d:g} ms: the defaults' controller ended " + ", ".join(f"{c} in {n}" for c, n in count.most_common())
             + f" of {sum(count.values())} requests" for d in delays if (count := record.choices.get(d))]
    return "\n".join(lines + [f"- {n}" for n in record.notes + picks])


def run(asked: Asked) -> Outcome:
    """The package's pair and the cost-realistic one (pairs.py), in a directory of their own."""
    setup = asked.setup
    draft = package_draft(setup)
    if draft is None:
        raise SystemExit("mesh bench: peers needs a package that ships its draft (the embedded model does)")
    say: Callable[[str], None] = lambda m: print(f"bench: {m}", file=sys.stderr)  # noqa: E731
    pairs = [same_cost_pair(setup, draft), cost_realistic_pair(setup, draft, say)]
    with tempfile.TemporaryDirectory(prefix="mesh-bench-peers-") as tmp:
        rows, table = peer_rows(setup, pairs, asked.bins, asked.prompts, asked.delays, asked.args.repeats, Path(tmp))
    return Outcome(rows, [table])
