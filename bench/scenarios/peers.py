"""`mesh bench --scenarios peers`: meshpipe head to head with the llama.cpp a user would pick instead.

Per pair and one-way delay, each "machine" one pinned CPU set running one thread per CPU:
llama-server on one node; llama.cpp's RPC split-2, without and with llama-server's own
speculation on the same draft (bench/harness/llama_cpp.py); meshpipe on one node, split-2
without a draft and split-2 with its defaults. `--stages` picks which of these it measures
(1: the one-node servers, 2: the split-2 ones; peers alone defaults to 1,2), and 3 adds the
same four at split-3: llama-server with two ggml-rpc-servers against meshpipe's three stages.
llama.cpp's links go through the bench's delay proxy, one per RPC server, meshpipe's hops
through `--wire-delay-ms`, the same delay each way: llama.cpp goes out to each RPC server and
back to llama-server, 2(n-1) one-way trips a token, where meshpipe's frame goes stage to
stage and its reply straight back, n. With fewer CPU sets than stages, stages share sets
round-robin in both systems alike, and the tables say which. All decode the same prompts,
greedy, the same number of tokens, as a streaming client sees it; repeats are interleaved,
every server once per repeat in an order that rotates. The one-node servers have no link,
so they stay up for the whole pair and are measured again beside the split servers of each
delay. Two pairs (bench/harness/pairs.py): the package's own target and draft (about the
same cost per token) and the cost-realistic F32 target with the same draft.

Without --llama-cpp-bin the llama.cpp servers are skipped, and the run says so.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

from bench.harness import llama_cpp
from bench.harness.client import StreamTiming, mesh_cuts, stream_chat
from bench.harness.harness import Asked, Outcome, Row, ServeOptions, Setup, serve
from bench.harness.llama_cpp import Binaries, RpcSplit, ServerSpec
from bench.harness.machines import Machines
from bench.harness.pairs import Pair, cost_realistic_pair, package_draft, same_cost_pair

LLAMA_ONE = "llama-server, 1 node"
MESH_ONE = "meshpipe, 1 node"


@dataclass(frozen=True)
class Split:
    """The four servers of a split-n: llama.cpp's RPC split without and with its speculation,
    meshpipe's without a draft and with its defaults."""

    n: int
    rpc: str
    rpc_spec: str
    plain: str
    default: str


SPLITS = {n: Split(n, f"llama.cpp RPC split-{n}", f"llama.cpp RPC split-{n} + its speculation (same draft)",
                   f"meshpipe split-{n}, no draft", f"meshpipe split-{n}, defaults (draft)") for n in (2, 3)}
RPC, RPC_SPEC, MESH_PLAIN, MESH_DEFAULT = (SPLITS[2].rpc, SPLITS[2].rpc_spec, SPLITS[2].plain, SPLITS[2].default)
RPC3, RPC3_SPEC, MESH3_PLAIN, MESH3_DEFAULT = (SPLITS[3].rpc, SPLITS[3].rpc_spec, SPLITS[3].plain,
                                               SPLITS[3].default)
UNITS = (LLAMA_ONE, RPC, RPC_SPEC, MESH_ONE, MESH_PLAIN, MESH_DEFAULT, RPC3, RPC3_SPEC, MESH3_PLAIN, MESH3_DEFAULT)
LLAMA_UNITS = (LLAMA_ONE, RPC, RPC_SPEC, RPC3, RPC3_SPEC)
STAGES_OF = {LLAMA_ONE: 1, MESH_ONE: 1} | {u: s.n for s in SPLITS.values() for u in (s.rpc, s.rpc_spec, s.plain,
                                                                                       s.default)}

# (name, numerator, denominator): the ratios issue 26's goals name, then issue 42's for split-3
RATIOS = (("meshpipe split-2 no-draft ÷ llama.cpp RPC split-2", MESH_PLAIN, RPC),
          ("meshpipe 1 node ÷ llama-server 1 node", MESH_ONE, LLAMA_ONE),
          ("meshpipe split-2 default ÷ llama.cpp RPC + its speculation", MESH_DEFAULT, RPC_SPEC),
          ("meshpipe split-2 default ÷ meshpipe no-draft", MESH_DEFAULT, MESH_PLAIN),
          ("meshpipe split-3 no-draft ÷ llama.cpp RPC split-3 (two RPC servers)", MESH3_PLAIN, RPC3),
          ("meshpipe split-3 default ÷ llama.cpp RPC split-3 + its speculation", MESH3_DEFAULT, RPC3_SPEC),
          ("meshpipe split-3 default ÷ meshpipe split-3 no-draft", MESH3_DEFAULT, MESH3_PLAIN))


def units_of(stages: tuple[int, ...]) -> tuple[str, ...]:
    """The servers `--stages` asks for, in the tables' order."""
    return tuple(u for u in UNITS if STAGES_OF[u] in stages)


def skipped_message(bins: Binaries | None, stages: tuple[int, ...] = (1, 2)) -> str:
    """Which rows a run without the llama.cpp binaries leaves out, and why ("" when none)."""
    if bins is None:
        why = f"no --llama-cpp-bin given ({llama_cpp.BUILD_HINT})"
    elif missing := bins.missing():
        why = f"{bins.dir} lacks {', '.join(missing)} ({llama_cpp.BUILD_HINT})"
    else:
        return ""
    skipped = [u for u in units_of(stages) if u in LLAMA_UNITS]
    return f"peers: skipped the llama.cpp servers ({'; '.join(skipped)}): {why}"


def goal(ratio: str, delay: float, costly: bool) -> str:
    """Issue 26's goal for a ratio at a delay, the speculation goals differing by pair; and
    issue 42's for split-3, at 20 ms, for both pairs alike."""
    names = [name for name, _, _ in RATIOS]
    if ratio == names[0]:
        return ">= 1.05" if delay == 0 else ""
    if ratio == names[1]:
        return ">= 0.97" if delay == 0 else ""
    if ratio == names[2]:
        return ">= 1.8" if delay == 20 and not costly else ""
    if ratio == names[3]:
        if costly:
            return ">= 2.5" if delay == 20 else ""
        return {0.0: ">= 0.98", 20.0: ">= 1.8", 50.0: ">= 2.0"}.get(delay, "")
    return {names[4]: ">= 1.25", names[5]: ">= 2.0"}.get(ratio, "") if delay == 20 else ""


@dataclass
class Record:
    """Decode tok/s samples of one pair: (delay, unit) -> samples; 1-node units at every delay."""

    label: str  # the pair's
    costly: bool
    stages: tuple[int, ...] = (1, 2)  # what --stages asked for: 1 node, split-2, split-3
    tps: dict[tuple[float, str], list[float]] = field(default_factory=dict)
    notes: dict[int, list[str]] = field(default_factory=dict)  # split n -> e.g. its cuts and the RPC split's log
    # (delay, a defaults unit) -> the picks its controller had settled on
    choices: dict[tuple[float, str], Counter[str]] = field(default_factory=dict)

    def median(self, delay: float, unit: str) -> float | None:
        samples = self.tps.get((delay, unit))
        return statistics.median(samples) if samples else None

    def note(self, n: int, text: str) -> None:
        if text:
            self.notes.setdefault(n, []).append(text)


@dataclass(frozen=True)
class PeerRun:
    """What one peers run measures, besides its pairs: the llama.cpp binaries (None: meshpipe
    alone), the prompts, delays and repeats, where servers write, and the stage counts."""

    bins: Binaries | None
    prompts: list[str]
    delays: list[float]
    repeats: int
    tmp: Path
    stages: tuple[int, ...] = (1, 2)


def peer_rows(pairs: list[Pair], run: PeerRun) -> tuple[list[Row], str]:
    """The rows for the results table and JSON, and the side-by-side tables issues 26 and 42 show."""
    if skip := skipped_message(run.bins, run.stages):
        print(f"bench: {skip}", file=sys.stderr)
        run = replace(run, bins=None)
    records = [_measure_pair(pair, run) for pair in pairs]
    rows = [row for r in records for row in rows_of(r, run.delays)]
    rows += [Row("peers", skip, 0.0)] if skip else []
    return rows, "\n\n".join([tables(r, run.delays) for r in records] + ([skip] if skip else []))


def _measure_pair(pair: Pair, run: PeerRun) -> Record:
    bins, prompts, delays, repeats, tmp, stages = run.bins, run.prompts, run.delays, run.repeats, run.tmp, run.stages
    record = Record(pair.label, pair.costly, stages)
    setup = pair.setup
    assert setup.machines is not None  # the peers scenario always emulates machines
    splits = [SPLITS[n] for n in stages if n in SPLITS]
    for split in splits:
        record.note(split.n, sharing_note(setup.machines, split.n))
    with contextlib.ExitStack() as stack:
        one_node = {MESH_ONE: stack.enter_context(serve(setup, tmp, 1)).url} if 1 in stages else {}
        if bins and 1 in stages:
            spec = ServerSpec(pair.target, setup.machines.sets[0], setup.ctx)
            one_node[LLAMA_ONE] = stack.enter_context(llama_cpp.llama_server(bins, spec, tmp)).url
        for d in delays:
            with contextlib.ExitStack() as at_delay:
                split_units = [at_delay.enter_context(_split_units(pair, bins, At(d, s, tmp), record))
                               for s in splits]
                _interleave(setup, {**one_node, **{k: v for u in split_units for k, v in u.items()}}, prompts,
                            repeats, d, record)
    return record


def sharing_note(machines: Machines, n: int) -> str:
    """Which stages of a split-n share a core, the same ones in both systems: stage 0 is
    llama-server or meshpipe's stage 0, stage k llama.cpp's k-th RPC server or meshpipe's stage k
    ("" when none share)."""
    def llama(k: int) -> str:
        return "llama-server" if k == 0 else f"RPC server {k}"

    return "; ".join(
        f"split-{n}: stages {' and '.join(map(str, group))} share CPUs {cpus}, in both systems alike "
        f"(llama.cpp's {' and '.join(map(llama, group))}, meshpipe's stages {' and '.join(map(str, group))}; "
        "one thread each, taking turns on the core)" for cpus, group in machines.shared(n))


@dataclass(frozen=True)
class At:
    """A split-n at one delay, its servers writing under `tmp`."""

    delay: float
    split: Split
    tmp: Path


@contextlib.contextmanager
def _split_units(pair: Pair, bins: Binaries | None, at: At, record: Record) -> Iterator[dict[str, str]]:
    """A split-n's servers at one delay; llama.cpp's get the cuts meshpipe's no-draft split chose."""
    setup, delay, split, tmp = pair.setup, at.delay, at.split, at.tmp
    with contextlib.ExitStack() as stack:
        units = {split.plain: stack.enter_context(serve(setup, tmp, split.n, ServeOptions(delay_ms=delay))).url,
                 split.default: stack.enter_context(serve(setup, tmp, split.n,
                                                          ServeOptions(draft=True, delay_ms=delay))).url}
        cuts = mesh_cuts(units[split.plain])
        record.note(split.n, cuts_note(delay, cuts, mesh_cuts(units[split.default])))
        if bins:
            units |= _rpc_units(stack, pair, bins, at, cuts, record)
        yield units


def _rpc_units(stack: contextlib.ExitStack, pair: Pair, bins: Binaries, at: At, cuts: tuple[int, ...],
               record: Record) -> dict[str, str]:
    """llama-server on stage 0's CPUs with one ggml-rpc-server, behind its own delay proxy,
    on each later stage's; without and with its speculation. It raises unless its log shows
    each RPC device holding its stage's layers."""
    setup, delay, split, tmp = pair.setup, at.delay, at.split, at.tmp
    assert setup.machines is not None
    first, *rest = setup.machines.for_stages(split.n)
    units, said = {}, ""
    for unit, draft in ((split.rpc, None), (split.rpc_spec, pair.draft)):
        links = tuple(stack.enter_context(llama_cpp.rpc_link(bins, cpus, delay, tmp)) for cpus in rest)
        rpc = RpcSplit(links, cuts, setup.manifest.layer_count)
        started = stack.enter_context(llama_cpp.llama_server(bins, ServerSpec(pair.target, first, setup.ctx,
                                                                              rpc, draft), tmp))
        units[unit], said = started.url, said or started.split
    record.note(split.n, f"{delay:g} ms: llama.cpp RPC split-{split.n} as meshpipe's: {rpc_layers(rpc)} "
                         f"({' '.join(rpc.flags()[2:])}); its log: {said}")
    return units


def rpc_layers(rpc: RpcSplit) -> str:
    """Which layers each RPC device holds, in words."""
    spans = [f"{start}-{start + n - 1}" if n > 1 else f"{start}" for start, n in zip(rpc.cuts, rpc.layers, strict=True)]
    spans[-1] += " and the head"
    if len(spans) == 1:
        return f"layers {spans[0]} on the RPC device"
    return "layers " + ", ".join(f"{span} on RPC device {k + 1}" for k, span in enumerate(spans))


def cuts_note(delay: float, plain: tuple[int, ...], default: tuple[int, ...]) -> str:
    """Where meshpipe's two split-n servers cut: each re-cuts at start on its own
    calibrations, so servers started alike may cut apart, and their ratio then compares
    two cuts as well as speculation."""
    n = len(plain) + 1

    def at(cuts: tuple[int, ...]) -> str:
        return f"layer{'s' if len(cuts) > 1 else ''} {' and '.join(map(str, cuts))}"

    if plain == default:
        return f"{delay:g} ms: meshpipe's split-{n} servers both cut at {at(plain)}"
    return (f"{delay:g} ms: meshpipe's split-{n} cut at {at(plain)} without a draft and at {at(default)} "
            "with its defaults (each re-cut on its own calibrations at start)")


def _interleave(setup: Setup, urls: dict[str, str], prompts: list[str], repeats: int, delay: float,
                record: Record) -> None:
    for url in urls.values():  # a first request pays for lazy loading and warms caches
        stream_chat(url, setup.model_id, prompts[0], 2)
    names = [u for u in UNITS if u in urls]
    defaults = {s.default for s in SPLITS.values()}
    for rep in range(repeats):
        for unit in names[rep % len(names):] + names[: rep % len(names)]:
            for p in prompts:
                timing = stream_chat(urls[unit], setup.model_id, p, setup.tokens)
                record.tps.setdefault((delay, unit), []).append(timing.decode_tps)
                if unit in defaults and (choice := controller_choice(timing)):
                    record.choices.setdefault((delay, unit), Counter())[choice] += 1


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
    """One table for the one-node and split-2 servers and one for split-3, as asked: decode
    tok/s, one line per delay and one column per server; then the ratios and the notes."""
    parts = [("", tuple(n for n in record.stages if n < 3)), ("split-3 ", tuple(n for n in record.stages if n == 3))]
    return "\n\n".join(_table(record, delays, title, stages) for title, stages in parts if stages)


def _table(record: Record, delays: list[float], title: str, stages: tuple[int, ...]) -> str:
    fmt: Callable[[float | None], str] = lambda v: f"{v:.1f}" if v is not None else "skipped"  # noqa: E731
    units = units_of(stages)
    ratios = [r for r in RATIOS if r[1] in units and r[2] in units]
    lines = [f"peers, {record.label}: {title}decode tok/s", "",
             "| one-way delay | " + " | ".join(units) + " |", "|---" * (len(units) + 1) + "|"]
    lines += [f"| {d:g} ms | " + " | ".join(fmt(record.median(d, u)) for u in units) + " |" for d in delays]
    lines += ["", "| one-way delay | " + " | ".join(name for name, _, _ in ratios) + " |",
              "|---" * (len(ratios) + 1) + "|"]
    for d in delays:
        cells = []
        for name, top, bottom in ratios:
            num, den = record.median(d, top), record.median(d, bottom)
            want = goal(name, d, record.costly)
            cells.append(f"{num / den:.2f}" + (f" (goal {want})" if want else "") if num is not None and den
                         else "skipped")
        lines.append(f"| {d:g} ms | " + " | ".join(cells) + " |")
    notes = [note for n in stages for note in record.notes.get(n, [])]
    picks = [f"{d:g} ms: the defaults' controller ended " + ", ".join(f"{c} in {k}" for c, k in count.most_common())
             + f" of {sum(count.values())} requests" for n in stages if n in SPLITS for d in delays
             if (count := record.choices.get((d, SPLITS[n].default)))]
    return "\n".join(lines + [f"- {n}" for n in notes + picks])


def run(asked: Asked) -> Outcome:
    """The package's pair and the cost-realistic one (pairs.py), in a directory of their own."""
    setup = asked.setup
    draft = package_draft(setup)
    if draft is None:
        raise SystemExit("mesh bench: peers needs a package that ships its draft (the embedded model does)")
    stages = tuple(sorted({int(n) for n in asked.args.stages.split(",")}))
    if not stages or not set(stages) <= {1, 2, 3}:
        raise SystemExit(f"mesh bench: peers measures 1 node, split-2 and split-3 (--stages 1,2,3), not {stages}")
    say: Callable[[str], None] = lambda m: print(f"bench: {m}", file=sys.stderr)  # noqa: E731
    pairs = [same_cost_pair(setup, draft), cost_realistic_pair(setup, draft, say)]
    with tempfile.TemporaryDirectory(prefix="mesh-bench-peers-") as tmp:
        rows, table = peer_rows(pairs, PeerRun(asked.bins, asked.prompts, asked.delays, asked.args.repeats,
                                               Path(tmp), stages))
    return Outcome(rows, [table])
