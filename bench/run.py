"""`mesh bench`: the mesh measured side by side with single-node llama.cpp, in one run.

Every scenario shares the invocation with the baseline and their repeats are interleaved,
so ratios hold on a noisy machine; medians are quoted. EOS is ignored so every run decodes
the same number of tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

from bench.harness.breakdown import measure
from bench.harness.busy import Busy, busy_during
from bench.harness.client import StreamTiming, stream_chat
from bench.harness.harness import Baseline, Row, Setup, baseline_worker, serve, weight_share
from bench.harness.llama_cpp import Binaries
from bench.harness.local_server import LocalServer, stage_pids
from bench.harness.machines import Machines
from bench.harness.pairs import cost_realistic_pair, package_draft, same_cost_pair
from bench.harness.shape_model import LLAMA_3_1_8B, SHAPES
from bench.scenarios import numerics
from bench.scenarios.agreement import agreement_rows
from bench.scenarios.chat import chat_rows
from bench.scenarios.constrained import constrained_rows
from bench.scenarios.engines import engine_rows
from bench.scenarios.ngram import ngram_rows
from bench.scenarios.peers import peer_rows
from bench.scenarios.shapes import Plan as ShapesPlan
from bench.scenarios.shapes import shapes_rows
from bench.scenarios.sweep import sweep_rows
from config.paths import cache_dir
from mesh.api.responses import SpeculativeUsage
from mesh.cli.bearer import KEY_ENV, auth_headers
from mesh.model.source import resolve_model
from mesh.model.tokenizer import Tokenizer
from mesh.reports.health import Health
from mesh.reports.proc_memory import peak_rss
from packages.materialize import materialize_stage
from packages.speculative import declared, verify_draft
from stage.llama_model import flash_attn, use_extra_bufts

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "List ten things to pack for a week of hiking in the mountains.",
    "Write a Python function that checks whether a string is a palindrome, with tests.",
    "Why is the sky blue? Explain it to a curious ten-year-old.",
    "Tell a story about a robot learning to paint.",
    "List the planets of the solar system with one fact about each.",
    "Write a JavaScript function that debounces another function, and explain it.",
    "What are the main causes of inflation, and how do central banks respond?",
]
LONG_PROMPT_TOKENS = 512
MESH_SCENARIOS = {"split", "spec", "concurrency", "memory", "return"}  # these share the baseline and split servers
# each starts what it needs, after the others are done
ALONE_SCENARIOS = {"numerics", "agreement", "chat", "ngram", "engines", "constrained", "peers", "sweep", "shapes"}
# --tokens, --prompts and --stages when not given. Engines alone defaults to less: MLX on a CPU
# decodes at a few tok/s. Its stages are only what the header describes: it runs 1 and 2.
DEFAULTS = {"tokens": 128, "prompts": len(PROMPTS), "stages": "1,2,3"}
ENGINES_DEFAULTS = {"tokens": 64, "prompts": 2, "stages": "1,2"}
PEERS_DEFAULTS = {"tokens": 64, "prompts": 3, "stages": "1,2"}  # 6 servers x 2 pairs x 4 delays: kept short
SWEEP_DEFAULTS = {"tokens": 64, "prompts": 2, "stages": "2"}  # 14 servers x 4 delays
SHAPES_DEFAULTS = {"tokens": 16, "prompts": 1, "stages": "2"}  # an 8B decodes a few tok/s on one core


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmark the mesh against single-node llama.cpp")
    p.add_argument("--model", default=None, help="package dir or GGUF (default: the embedded SmolLM2)")
    p.add_argument("--scenarios", default="split,spec,concurrency,memory",
                   help="comma-separated: split, spec, concurrency, memory, return (split-3 without the draft "
                        "at each --wire-delays: replies straight from the final stage against relayed up the "
                        "chain) (the baseline runs with any of these), numerics (a window in one pass against "
                        "row by row), agreement (how often the draft's top-1 and top-2, and the target's own first "
                        "layers and head, name the target's greedy token), chat (TTFT over 4 turns of a growing "
                        "chat, with the prefix cache and "
                        "without), ngram (prompt lookup against no speculation on copy-heavy and novel text at "
                        "each --wire-delays), engines (decode rate of llama.cpp, MLX and meshes mixing "
                        "them, without the draft), constrained (JSON-schema output on split-2: no speculation, "
                        "forced tokens, the draft, both, at each --wire-delays), peers (meshpipe against "
                        "llama-server and llama.cpp's RPC split, with and without speculation, at each "
                        "--wire-delays, for the package's pair and a cost-realistic F32 target; always with "
                        "--machines), sweep (split-2: the cost-aware window against every fixed window and "
                        "frames in flight, and no draft, at each --wire-delays; always with --machines), "
                        "shapes (a random-weight Q4_0 model of --shape at full size: package writing, peer "
                        "transfer, stage load, resident memory, and split-2 against llama.cpp's RPC split-2 at "
                        "each --wire-delays; always with --machines, and only alone); "
                        "numerics, agreement, chat, ngram, engines, constrained, peers and sweep run alone if "
                        "asked alone")
    p.add_argument("--numerics-gguf", action="append", type=Path, default=[],
                   help="another GGUF for the numerics scenario (repeatable); the package's target and "
                        "draft are always measured")
    p.add_argument("--wire-delays", default=None,
                   help="one-way ms on every hop for the spec and return scenarios (default: 0,20; with "
                        "--machines 0,5,20,50)")
    p.add_argument("--machines", action="store_true",
                   help="emulate separate machines: pin each local stage to its own CPU set (--cpu-sets), "
                        "one engine thread per CPU and no CPU lock; the baseline runs on the first set; "
                        "spec runs on 2 and 3 stages, concurrency sets split-2 against split-1 on one set")
    p.add_argument("--cpu-sets", nargs="+", default=None, metavar="LIST",
                   help="with --machines: one CPU list per emulated machine (default: one per CPU)")
    p.add_argument("--stages", default=None, help="split-N scenarios to run (default 1,2,3)")
    p.add_argument("--streams", default="1,4,8", help="concurrent streams for the concurrency scenario")
    p.add_argument("--tokens", type=int, default=None,
                   help=f"tokens decoded per request (default {DEFAULTS['tokens']}; engines alone "
                        f"{ENGINES_DEFAULTS['tokens']})")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats; the median is quoted")
    p.add_argument("--prompts", type=int, default=None,
                   help=f"how many built-in prompts to use (default {DEFAULTS['prompts']}; engines alone "
                        f"{ENGINES_DEFAULTS['prompts']})")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="engine threads per process")
    p.add_argument("--breakdown", action="store_true",
                   help="also show where a frame's time goes, per stage and part (one more pass)")
    p.add_argument("--llama-cpp-bin", type=Path, default=None, metavar="DIR",
                   help="for peers: a directory holding llama-server and ggml-rpc-server "
                        "(deploy/build-llama-cpp.sh); without it the llama.cpp rows are skipped")
    p.add_argument("--cost-realistic", action="store_true",
                   help="for sweep: the cost-realistic pair of peers (the package's target in F32, with its "
                        "draft) instead of the package's own")
    p.add_argument("--shape", choices=sorted(SHAPES), default=LLAMA_3_1_8B.name,
                   help="for shapes: the model shape written (default: Llama-3.1-8B's, about 4.6 GB on disk "
                        "while it runs)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument("--cache-dir", type=Path, default=None)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    scenarios = set(args.scenarios.split(","))
    if unknown := scenarios - MESH_SCENARIOS - ALONE_SCENARIOS:  # before the model loads, not after
        raise SystemExit(f"mesh bench: unknown scenarios: {', '.join(sorted(unknown))}")
    fill_defaults(args, scenarios)
    bins = _llama_cpp_bins(args, scenarios)
    if "shapes" in scenarios:
        return _shapes(args, scenarios, bins)
    # every server the bench starts inherits it, and every request the bench sends carries it:
    # a key from the user's config can then never lock the bench out of its own servers
    os.environ.setdefault(KEY_ENV, secrets.token_hex(16))
    setup = _setup(args)
    delays = [float(d) for d in (args.wire_delays or ("0,5,20,50" if setup.machines else "0,20")).split(",")]
    rows: list[Row] = []
    tables: list[str] = []
    if "numerics" in scenarios:
        rows += _numerics_rows(setup, args.numerics_gguf)
    if "agreement" in scenarios:
        rows += agreement_rows(setup, PROMPTS[: args.prompts])
    if scenarios & MESH_SCENARIOS:
        rows += _mesh_rows(setup, args, scenarios, delays)
    if "chat" in scenarios:
        rows += chat_rows(setup, args.repeats)
    if "ngram" in scenarios:
        rows += ngram_rows(setup, delays, args.repeats)
    if "constrained" in scenarios:
        rows += constrained_rows(setup, delays, args.repeats)
    if "engines" in scenarios:
        rows += engine_rows(setup, PROMPTS[: args.prompts], args.repeats)
    if "peers" in scenarios:
        peers, table = _peers_rows(setup, bins, args, delays)
        rows, tables = rows + peers, [*tables, table]
    pair = ""
    if "sweep" in scenarios:
        sweep, pair = _sweep_rows(setup, args, delays)
        rows += sweep
    header = _header(setup, args)
    if pair:  # model and quant above are the package's own, which the sweep did not run
        header["sweep"] = pair
    return _report(args, header, rows, tables)


def _report(args: argparse.Namespace, header: dict[str, Any], rows: list[Row], tables: list[str]) -> int:
    """The results table and any scenario's own tables on stdout, and the JSON where --json says."""
    print("\n\n".join([format_table(header, rows), *tables]))
    if args.json:
        args.json.write_text(json.dumps({"setup": header, "rows": [asdict(r) | {"ratio": r.ratio} for r in rows]},
                                        indent=2))
    return 0


def fill_defaults(args: argparse.Namespace, scenarios: set[str]) -> None:
    """--tokens, --prompts and --stages where not given: the engines scenario's own when it runs alone."""
    alone = {frozenset({"engines"}): ENGINES_DEFAULTS, frozenset({"peers"}): PEERS_DEFAULTS,
             frozenset({"sweep"}): SWEEP_DEFAULTS, frozenset({"shapes"}): SHAPES_DEFAULTS}
    for name, value in alone.get(frozenset(scenarios), DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def _llama_cpp_bins(args: argparse.Namespace, scenarios: set[str]) -> Binaries | None:
    """peers and sweep always emulate machines; a --llama-cpp-bin that lacks a binary fails now, not an hour in."""
    if scenarios & {"peers", "sweep", "shapes"}:
        args.machines = True
    if not scenarios & {"peers", "shapes"}:
        return None
    bins = Binaries(args.llama_cpp_bin) if args.llama_cpp_bin else None
    if bins and (missing := bins.missing()):
        raise SystemExit(f"mesh bench: --llama-cpp-bin {bins.dir} lacks {', '.join(missing)}")
    return bins


def _shapes(args: argparse.Namespace, scenarios: set[str], bins: Binaries | None) -> int:
    """The shapes scenario, alone: it brings its own model, so no other scenario's setup is made."""
    if scenarios != {"shapes"}:
        raise SystemExit("mesh bench: shapes runs alone (it writes and serves its own model)")
    os.environ.setdefault(KEY_ENV, secrets.token_hex(16))
    machines = Machines.parse(args.cpu_sets)
    delays = [float(d) for d in (args.wire_delays or "0,20").split(",")]
    plan = ShapesPlan(SHAPES[args.shape], machines, args.tokens, args.repeats, delays, bins)
    rows, goals = shapes_rows(plan)
    header = {"model": f"random-weight {args.shape} Q4_0", "threads": 1, "machines": machines.describe([2]),
              "wire delays (ms, one way)": ",".join(f"{d:g}" for d in delays), "page cache": "warm",
              "extra buffer types": "on" if use_extra_bufts() else "off",
              "flash attn": "on" if flash_attn() else "off", "tokens": args.tokens, "repeats": args.repeats,
              "machine": f"{platform.node()}, {_cpu_name()}, {os.cpu_count()} cores"}
    return _report(args, header, rows, [goals])


def _peers_rows(setup: Setup, bins: Binaries | None, args: argparse.Namespace,
                delays: list[float]) -> tuple[list[Row], str]:
    draft = package_draft(setup)
    if draft is None:
        raise SystemExit("mesh bench: peers needs a package that ships its draft (the embedded model does)")
    say: Callable[[str], None] = lambda m: print(f"bench: {m}", file=sys.stderr)  # noqa: E731
    pairs = [same_cost_pair(setup, draft), cost_realistic_pair(setup, draft, say)]
    with tempfile.TemporaryDirectory(prefix="mesh-bench-peers-") as tmp:
        return peer_rows(setup, pairs, bins, PROMPTS[: args.prompts], delays, args.repeats, Path(tmp))


def _sweep_rows(setup: Setup, args: argparse.Namespace, delays: list[float]) -> tuple[list[Row], str]:
    """The package's own pair, or with --cost-realistic the one peers tables beside it, named."""
    label = ""
    if args.cost_realistic:
        draft = package_draft(setup)
        if draft is None:
            raise SystemExit("mesh bench: --cost-realistic needs a package that ships its draft (the embedded "
                             "model does)")
        pair = cost_realistic_pair(setup, draft, lambda m: print(f"bench: {m}", file=sys.stderr))
        setup, label = pair.setup, pair.label
    with tempfile.TemporaryDirectory(prefix="mesh-bench-sweep-") as tmp:
        return sweep_rows(setup, PROMPTS[: args.prompts], delays, args.repeats, Path(tmp), label), label


def _mesh_rows(setup: Setup, args: argparse.Namespace, scenarios: set[str], delays: list[float]) -> list[Row]:
    stages = [int(s) for s in args.stages.split(",")]
    prompts = PROMPTS[: args.prompts]
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="mesh-bench-") as tmp, contextlib.ExitStack() as stack:
        base = stack.enter_context(baseline_worker(setup))
        servers = {n: stack.enter_context(serve(setup, Path(tmp), n)) for n in stages}
        rows += _decode_rows(setup, base, servers, prompts, args.repeats)
        rows += _busy_rows(setup, servers, prompts[:2])
        if "spec" in scenarios:
            spec_stages = [n for n in stages if n in (2, 3)] if setup.machines else [2]
            rows += _spec_rows(setup, Path(tmp), prompts, spec_stages, delays, args.repeats, args.breakdown)
        if "return" in scenarios:
            rows += _return_rows(setup, stack, Path(tmp), prompts, delays, args.repeats)
        if "concurrency" in scenarios and 2 in servers:
            one_set = servers.get(1) if setup.machines else None
            rows += _concurrency_rows(setup, servers[2], one_set, prompts,
                                      [int(s) for s in args.streams.split(",")], args.repeats)
        if "memory" in scenarios:
            rows += _memory_rows(setup, base, servers, lanes=8)
            single = {n: stack.enter_context(serve(setup, Path(tmp), n, lanes=1)) for n in stages if n > 1}
            long = long_prompt(base.tokenizer)
            for server in single.values():
                stream_chat(server.url, setup.model_id, long, setup.tokens)
            rows += _memory_rows(setup, base, single, lanes=1)
        if args.breakdown:
            streams = max(int(s) for s in args.streams.split(",")) if "concurrency" in scenarios else 0
            rows += _breakdown_rows(setup, servers, prompts, streams)
    return rows


def _setup(args: argparse.Namespace) -> Setup:
    cache = args.cache_dir or cache_dir()
    say: Callable[[str], None] = lambda m: print(f"bench: {m}", file=sys.stderr)  # noqa: E731
    package, manifest, sha, model_id = resolve_model(args.model, cache, say=say)
    gguf = materialize_stage(package, manifest, sha, 0, manifest.layer_count, cache)
    machines = Machines.parse(args.cpu_sets) if args.machines else None
    threads = machines.threads if machines else args.threads
    return Setup(args.model, model_id, manifest.quantization, package, gguf, manifest, args.tokens, threads,
                 ctx=max(1024, LONG_PROMPT_TOKENS + args.tokens + 64), cache=cache, machines=machines)


def _numerics_rows(setup: Setup, extra: list[Path]) -> list[Row]:
    """The package's target and in-package drafts, and any GGUF given, flash attention on and off."""
    models = [(f"{setup.model_id} {setup.quant}", setup.gguf)]
    _, strategies = declared(setup.manifest.generation)
    models += [(f"draft {s.name}", verify_draft(setup.package, s)) for s in strategies.values() if s.in_package]
    models += [(gguf.stem, gguf) for gguf in extra]
    text = " ".join(PROMPTS * 8)
    rows = []
    for name, gguf in models:
        tokens = Tokenizer(gguf, name).tokenize(text, False)
        for flash in (True, False):
            n = numerics.measure(name, gguf, tokens, setup.threads, flash)
            fa = f"flash attn {'on' if flash else 'off'}"
            culprit = f"; first differing node {n.first_node}" if n.first_node else ""
            rows.append(Row(f"numerics {name}", f"{fa}: max logit diff, {numerics.WINDOW}-row window vs "
                                                f"row by row{culprit}", n.max_diff))
            rows.append(Row(f"numerics {name}", f"{fa}: max logit diff, row 0", n.row0_diff))
            rows += [Row(f"numerics {name}", f"{fa}: ms per decode of {k} rows at position "
                                             f"{numerics.POSITION}", ms) for k, ms in n.decode_ms.items()]
    return rows


# -- scenarios ------------------------------------------------------------------------------

def long_prompt(tokenizer: Tokenizer) -> str:
    """A chat prompt of about LONG_PROMPT_TOKENS tokens, for time to first token."""
    words = " ".join(PROMPTS).split()
    text, i = "Summarize the following notes.\n", 0
    while len(tokenizer.tokenize(text, False)) < LONG_PROMPT_TOKENS - 40:
        text += words[i % len(words)] + " "
        i += 1
    return text


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
    rows = [Row("baseline", "decode tok/s", b_tps, b_tps, samples=tps["baseline"]),
            Row("baseline", "TTFT 512-token prompt (s)", b_ttft, b_ttft, samples=ttft["baseline"])]
    goals = {2: (">= 0.95", "<= 1.15"), 3: (">= 0.90", "")}
    for n in servers:
        unit = f"split-{n}"
        g_tps, g_ttft = goals.get(n, ("", ""))
        rows.append(Row(unit, "decode tok/s", statistics.median(tps[unit]), b_tps, g_tps, tps[unit]))
        rows.append(Row(unit, "TTFT 512-token prompt (s)", statistics.median(ttft[unit]), b_ttft, g_ttft,
                        ttft[unit]))
    return rows


def _busy_rows(setup: Setup, servers: dict[int, LocalServer], prompts: list[str]) -> list[Row]:
    """How busy each stage of each split is while one stream decodes."""
    rows = []
    for n, server in servers.items():
        _, busy = busy_during(server.url, functools.partial(_run_batches, server.url, setup, [[p] for p in prompts]))
        rows += _busy_of(f"split-{n}", "1 stream", busy)
    return rows


def _busy_of(scenario: str, what: str, busy: Busy) -> list[Row]:
    rows = [Row(scenario, f"busy fraction stage {i}, {what}", f) for i, f in enumerate(busy.stages)]
    return rows + ([Row(scenario, f"busy fraction of the draft, {what}", busy.draft)] if busy.draft is not None
                   else [])


SPEC_MODES: dict[str, tuple[bool, int | None]] = {"plain": (False, None), "one": (True, 1), "default": (True, None)}


def _spec_rows(setup: Setup, tmp: Path, prompts: list[str], stages: list[int], delays: list[float],
               repeats: int, breakdown: bool) -> list[Row]:
    """At each split and per-hop delay, three servers interleaved: --no-draft, the package's draft
    one window at a time, and the draft with the default frames in flight. One split and
    delay at a time: loading every combination at once would not fit in memory."""
    rows = []
    for n in stages:
        for d in delays:
            with contextlib.ExitStack() as stack:
                servers = {mode: stack.enter_context(serve(setup, tmp, n, draft=draft, delay_ms=d, in_flight=depth))
                           for mode, (draft, depth) in SPEC_MODES.items()}
                rows += _spec_group(setup, f"spec split-{n} {d:g} ms", servers, prompts, repeats, d)
                if breakdown:  # verify frames next to plain decode frames, on the server with the draft
                    url = servers["default"].url
                    run = functools.partial(_run_batches, url, setup, [[p] for p in prompts])
                    rows += [Row(f"breakdown spec split-{n} {d:g} ms", what, value)
                             for what, value in measure(url, 1, run)]
    return rows


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
            *_busy_of(scenario, "draft, default in flight", busy)]


def _return_rows(setup: Setup, stack: contextlib.ExitStack, tmp: Path, prompts: list[str], delays: list[float],
                 repeats: int) -> list[Row]:
    """split-3 without the draft: replies straight from the final stage against relayed by stage 1."""
    servers = {(d, relay): stack.enter_context(serve(setup, tmp, 3, delay_ms=d, relay=relay))
               for d in delays for relay in (False, True)}
    tps: dict[tuple[float, bool], list[float]] = {key: [] for key in servers}
    for _ in range(repeats):
        for key, server in servers.items():
            tps[key] += [stream_chat(server.url, setup.model_id, p, setup.tokens).decode_tps for p in prompts]
    rows = []
    for d in delays:
        relayed, direct = statistics.median(tps[(d, True)]), statistics.median(tps[(d, False)])
        rows.append(Row(f"return split-3 {d:g} ms", "relayed replies decode tok/s", relayed,
                        samples=tps[(d, True)]))
        rows.append(Row(f"return split-3 {d:g} ms", "direct return decode tok/s (vs relayed)", direct, relayed,
                        ">= 1.2" if d >= 20 else "", tps[(d, False)]))
    return rows


def _concurrency_rows(setup: Setup, server: LocalServer, single: LocalServer | None, prompts: list[str],
                      streams: list[int], repeats: int) -> list[Row]:
    """Aggregate tok/s at each stream count on split-2, against split-1 on one CPU set when
    given (--machines), else against one stream; and how busy split-2's stages are. Each
    server first runs one round unmeasured, so every measured round finds the prompts in
    the prefix cache: the steady state."""
    units = {"split-2": server, **({"split-1": single} if single else {})}
    agg: dict[tuple[str, int], list[float]] = {(u, n): [] for u in units for n in streams}
    gaps: dict[int, list[float]] = {n: [] for n in streams}
    for s in units.values():  # unmeasured: a server's first round prefills cold and runs 20-30% slower
        _parallel(s.url, setup, _cycled(prompts, max(streams)))
    for _ in range(repeats):
        for n in streams:
            for unit, s in units.items():
                total, wall, timings = _parallel(s.url, setup, _cycled(prompts, n))
                agg[(unit, n)].append(total / wall)
                gaps[n] += [g for t in timings for g in t.gaps()] if unit == "split-2" else []
    one = statistics.median(agg[("split-2", streams[0])])
    rows = []
    for n in streams:
        value, samples = statistics.median(agg[("split-2", n)]), agg[("split-2", n)]
        if single:
            base = statistics.median(agg[("split-1", n)])
            rows.append(Row(f"concurrency-{n}", "split-1 on one CPU set, aggregate tok/s", base,
                            samples=agg[("split-1", n)]))
            rows.append(Row(f"concurrency-{n}", "split-2 aggregate tok/s (vs split-1)", value, base,
                            ">= 1.6" if n == 8 else "", samples))
        else:
            rows.append(Row(f"concurrency-{n}", "aggregate tok/s (vs 1 stream)", value, one,
                            ">= 3.0" if n == 8 else "", samples))
        q = statistics.quantiles(gaps[n], n=20)
        rows.append(Row(f"concurrency-{n}", "inter-token p50 (ms)", statistics.median(gaps[n]) * 1e3))
        rows.append(Row(f"concurrency-{n}", "inter-token p95 (ms)", q[18] * 1e3))
    most = max(streams)
    _, busy = busy_during(server.url, lambda: _parallel(server.url, setup, _cycled(prompts, most)))
    return rows + _busy_of(f"concurrency-{most}", f"split-2, {most} streams", busy)


def _breakdown_rows(setup: Setup, servers: dict[int, LocalServer], prompts: list[str],
                    streams: int) -> list[Row]:
    """One more pass per split server, one stream (and `streams` at once on split-2)."""
    units = [(f"split-{n}", server, 1) for n, server in servers.items()]
    if streams > 1 and 2 in servers:
        units.append((f"concurrency-{streams}", servers[2], streams))
    rows = []
    for unit, server, n in units:
        asked = _cycled(prompts, max(n, len(prompts)))
        batches = [asked[i : i + n] for i in range(0, len(asked), n)]
        run = functools.partial(_run_batches, server.url, setup, batches)
        rows += [Row(f"breakdown {unit}", what, value) for what, value in measure(server.url, n, run)]
    return rows


def _cycled(prompts: list[str], n: int) -> list[str]:
    """`n` prompts, the given ones over again as often as it takes."""
    return [prompts[i % len(prompts)] for i in range(n)]


def _run_batches(url: str, setup: Setup, batches: list[list[str]]) -> int:
    return sum(_parallel(url, setup, batch)[0] for batch in batches)


def _parallel(url: str, setup: Setup, prompts: list[str]) -> tuple[int, float, list[StreamTiming]]:
    start = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        timings = list(pool.map(lambda p: stream_chat(url, setup.model_id, p, setup.tokens), prompts))
    wall = time.perf_counter() - start
    return sum(t.completion_tokens for t in timings), wall, timings


def _memory_rows(setup: Setup, base: Baseline, servers: dict[int, LocalServer], lanes: int) -> list[Row]:
    """Peak RSS per stage process. KV is lanes x ctx, so only the 1-lane run holds what the
    baseline holds (one sequence of the same context); that run is held to the goal."""
    base_rss = float(base.ask({"memory": True})["peak_rss"])
    single = lanes == 1
    label = "1 lane, as the baseline" if single else f"{lanes} lanes"
    rows = [] if single else [Row("memory", "baseline peak RSS (MB)", base_rss / 1e6, base_rss / 1e6)]
    for n, server in servers.items():
        if n == 1:
            continue
        stages = Health.model_validate_json(httpx.get(f"{server.url}/health", timeout=10,
                                                             headers=auth_headers()).content).stages
        pids = [server.process.pid, *stage_pids(server.process.pid)]
        for stage, pid in zip(stages, pids, strict=False):
            assert stage.start is not None
            assert stage.end is not None
            share = weight_share(setup.manifest, stage.start, stage.end)
            rows.append(Row(f"split-{n} stage {stage.stage}", f"peak RSS (MB), {label}, layers "
                            f"[{stage.start},{stage.end}), weights {share / 1e6:.0f} MB",
                            peak_rss(pid) / 1e6, base_rss / 1e6,
                            f"<= {(share + 200e6) / 1e6:.0f} MB" if single else ""))
    return rows


# -- output ---------------------------------------------------------------------------------

def _header(setup: Setup, args: argparse.Namespace) -> dict[str, Any]:
    machines = {"machines": setup.machines.describe([int(n) for n in args.stages.split(",")])} \
        if setup.machines else {}
    return {"model": setup.model_id, "quant": setup.quant, "threads": setup.threads, **machines,
            "extra buffer types": "on" if use_extra_bufts() else "off",
            "flash attn": "on" if flash_attn() else "off",
            "tokens": setup.tokens, "repeats": args.repeats, "prompts": args.prompts,
            "machine": f"{platform.node()}, {_cpu_name()}, {os.cpu_count()} cores"}


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
