"""`mesh bench`: the mesh measured side by side with single-node llama.cpp, in one run.

Every scenario shares the invocation with the baseline and their repeats are interleaved,
so ratios hold on a noisy machine; medians are quoted. EOS is ignored so every run decodes
the same number of tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.harness.breakdown import breakdown_rows
from bench.harness.harness import Asked, Outcome, Row, Setup, Shared, baseline_worker, serve
from bench.harness.llama_cpp import Binaries
from bench.harness.machines import Machines
from bench.harness.prompts import LONG_PROMPT_TOKENS, PROMPTS
from bench.harness.report import format_table, header
from bench.harness.shape_model import LLAMA_3_1_8B
from bench.scenarios import (
    agreement,
    chat,
    concurrency,
    constrained,
    corpus,
    engines,
    front_doors,
    guard,
    hybrid,
    kv_tier,
    machines,
    memory,
    mtp,
    ngram,
    numerics,
    peers,
    prompt_lookup,
    return_,
    sampling,
    shapes,
    spec,
    split,
    sweep,
)
from config.paths import cache_dir
from mesh.cli.bearer import KEY_ENV
from mesh.model.source import resolve_model
from packages.materialize import materialize_stage

# The table of contents: every scenario by its --scenarios name, in the order a run measures them.
# bench/scenarios/ holds one module of each name (tests/test_bench_scenarios.py holds them equal).
# These share the baseline and one split server per --stages, started once; split runs with any of them.
MESH_SCENARIOS: dict[str, Callable[[Shared], list[Row]]] = {
    "split": split.rows, "spec": spec.rows, "return": return_.rows, "concurrency": concurrency.rows,
    "memory": memory.rows, "machines": machines.rows}
# Each of these starts what it needs: these two before the mesh scenarios, the next ones after.
BEFORE_MESH: dict[str, Callable[[Asked], Outcome]] = {"numerics": numerics.run, "agreement": agreement.run}
AFTER_MESH: dict[str, Callable[[Asked], Outcome]] = {
    "chat": chat.run, "ngram": ngram.run, "prompt_lookup": prompt_lookup.run, "constrained": constrained.run,
    "engines": engines.run, "peers": peers.run, "sweep": sweep.run, "guard": guard.run, "hybrid": hybrid.run,
    "mtp": mtp.run, "sampling": sampling.run, "front_doors": front_doors.run, "kvtier": kv_tier.run,
    "corpus": corpus.run}
# Each of these runs alone, on a model it writes into the cache: the one the run's setup serves
OWN_MODEL: dict[str, Callable[[Path], Path]] = {"hybrid": hybrid.model_path, "mtp": mtp.model_path}
# shapes brings its own model and runs only alone (shapes.run)
SCENARIOS = (*BEFORE_MESH, *MESH_SCENARIOS, *AFTER_MESH, "shapes")
# --tokens, --prompts and --stages when not given. Engines alone defaults to less: MLX on a CPU
# decodes at a few tok/s. Its stages are only what the header describes: it runs 1 and 2.
DEFAULTS = {"tokens": 128, "prompts": len(PROMPTS), "stages": "1,2,3"}
ENGINES_DEFAULTS = {"tokens": 64, "prompts": 2, "stages": "1,2"}
# 6 servers x 2 pairs x 4 delays: kept short; --stages 1,2,3 adds split-3's 4 servers
PEERS_DEFAULTS = {"tokens": 64, "prompts": 3, "stages": "1,2"}
SWEEP_DEFAULTS = {"tokens": 64, "prompts": 2, "stages": "2"}  # 14 servers x 4 delays
SHAPES_DEFAULTS = {"tokens": 16, "prompts": 1, "stages": "2"}  # an 8B decodes a few tok/s on one core
PROMPT_LOOKUP_DEFAULTS = {"tokens": 200, "prompts": 1, "stages": "2"}  # what issue 42 measured
MACHINES_DEFAULTS = {"tokens": 64, "prompts": 3, "stages": "1,2"}  # split-2 against one node
GUARD_DEFAULTS = {"tokens": 64, "prompts": 1, "stages": "1,2"}  # the guard's own sizes, under 10 minutes
HYBRID_DEFAULTS = {"tokens": 48, "prompts": 2, "stages": "2"}  # a 1.1B hybrid decodes tens of tok/s
MTP_DEFAULTS = {"tokens": 64, "prompts": 2, "stages": "2"}  # 3-4 split-2 servers x 2 models x 2 delays
SAMPLING_DEFAULTS = {"tokens": 64, "prompts": 3, "stages": "2"}  # 3 servers x 2 temperatures x 2 pairs
FRONT_DOORS_DEFAULTS = {"tokens": 64, "prompts": 4, "stages": "2"}  # one stage daemon, two coordinators
KVTIER_DEFAULTS = {"tokens": 16, "prompts": 1, "stages": "1,2"}  # short replies: a chat turn's TTFT is the point
CORPUS_DEFAULTS = {"tokens": 128, "prompts": 1, "stages": "2"}  # 72 requests x 4 split-2 servers x 2 delays
# --wire-delays when not given, for a scenario run alone that has its own (else 0,20; --machines 0,5,20,50)
ALONE_DELAYS = {frozenset({"prompt_lookup"}): "0,20", frozenset({"hybrid"}): "0,20",  # the issues' delays
                frozenset({"mtp"}): "0,20", frozenset({"corpus"}): "0,20",
                frozenset({"sampling"}): "20"}

# --scenarios' help: each scenario, what it measures
SCENARIOS_HELP = (
    "comma-separated: split, spec, concurrency, memory, return (split-3 without the draft at each --wire-delays: "
    "replies straight from the final stage against relayed up the chain), machines (split-2 against one node without a "
    "draft, a token's time part by part: engine, codec, queue, wire, outside the pipeline; always with --machines) "
    "(the baseline runs with any of these), "
    "numerics (a window in one pass against row by row), agreement (how often the draft's top-1 and top-2, and the "
    "target's own first layers and head, name the target's greedy token), chat (TTFT over 4 turns of a growing "
    "chat, with the prefix cache and without), ngram (prompt lookup against no speculation on copy-heavy and novel "
    "text at each --wire-delays), prompt_lookup (the copy-heavy chat case alone: n-gram against no speculation on "
    "split-2 at each --wire-delays, 200 tokens and 0,20 ms alone), engines (decode rate of llama.cpp, MLX and "
    "meshes mixing them, without the draft), constrained (JSON-schema output, a film and a nested recipe, on "
    "split-2: no speculation, forced tokens, the draft, both, at each --wire-delays), peers (meshpipe against "
    "llama-server and llama.cpp's RPC split, with and without speculation, at each --wire-delays, for the package's"
    " pair and a cost-realistic F32 target; --stages picks 1 node, split-2 and split-3, default 1,2; always with "
    "--machines), sweep (split-2: the cost-aware window against "
    "every fixed window and frames in flight, and no draft, at each --wire-delays; always with --machines), shapes "
    "(a random-weight Q4_0 model of --shape at full size: package writing, peer transfer, stage load, resident "
    "memory, and split-2 against llama.cpp's RPC split-2 at each --wire-delays; always with --machines, and only "
    "alone), guard (issue 42's ratios in one run, interleaved, against BENCHMARKS.md's guard figures; exits 1 when "
    "one is more than 15%% worse; always with --machines; run it before a release), hybrid (a random Qwen3.5-like 1.1B "
    "hybrid: what a rollback's checkpoint costs, and split-2 with a self-draft against none, greedy and sampled, "
    "at 0,20 ms; always with --machines, and only alone), mtp (the model's own MTP layer drafting at the final "
    "stage, on a random Qwen3.5-like 1.1B hybrid with one MTP block: an MTP step against a decode, and split-2 "
    "with --strategy mtp against none at 0,20 ms, for a model whose MTP layer always agrees (the ceiling) and one "
    "whose MTP head is random (the floor, with the default strategy too); always with --machines, and only "
    "alone), sampling (unseeded requests at temperatures 0.7 and 1.0 "
    "on split-2, for the package's pair and the cost-realistic one: no draft, the draft accepted by exact match and "
    "by rejection sampling, at each --wire-delays, 20 ms alone; and the teacher-forced sum of min(p, q) the "
    "rejection rule can reach, per size of q's top K), front_doors (8 streams through two coordinators that share "
    "one stage daemon, against the same streams through one of them; with --machines each on its own CPU set), "
    "kvtier (16 chats of 4 turns round robin on 4 lanes: TTFT of later turns against the first on split-2 with the "
    "KV tier and with lanes only, a 5th turn after the tier server's restart, and meshpipe's one node against "
    "llama-server's prompt cache with --llama-cpp-bin; 16 tokens alone), corpus (a seeded held-out corpus, 12 "
    "requests each of copy-heavy, free, code, nested-schema, flat-schema and tool-call, on split-2 with no "
    "speculation, ngram, the defaults and ngram+draft at each --wire-delays, 0,20 ms alone: per kind the median "
    "and worst whole-request speed-up over none); "
    "numerics, agreement, chat, ngram, prompt_lookup, engines, constrained, peers, sweep, guard, sampling, "
    "front_doors, kvtier and corpus run alone if asked alone")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmark the mesh against single-node llama.cpp")
    p.add_argument("--model", default=None, help="package dir or GGUF (default: the embedded SmolLM2)")
    p.add_argument("--scenarios", default="split,spec,concurrency,memory", help=SCENARIOS_HELP)
    p.add_argument("--numerics-gguf", action="append", type=Path, default=[],
                   help="another GGUF for the numerics scenario (repeatable); the package's target and "
                        "draft are always measured")
    p.add_argument("--wire-delays", default=None,
                   help="one-way ms on every hop for the spec and return scenarios (default: 0,20; with "
                        "--machines 0,5,20,50; prompt_lookup and corpus alone 0,20, sampling alone 20, either way)")
    p.add_argument("--machines", action="store_true",
                   help="emulate separate machines: pin each local stage to its own CPU set (--cpu-sets), "
                        "one engine thread per CPU and no CPU lock; the baseline runs on the first set; "
                        "spec runs on 2 and 3 stages, concurrency sets split-2 against split-1 on one set")
    p.add_argument("--cpu-sets", nargs="+", default=None, metavar="LIST",
                   help="with --machines: one CPU list per emulated machine (default: one per CPU)")
    p.add_argument("--stages", default=None,
                   help="split-N scenarios to run (default 1,2,3; peers alone 1,2, and 3 adds its split-3)")
    p.add_argument("--streams", default="1,4,8", help="concurrent streams for the concurrency scenario")
    p.add_argument("--tokens", type=int, default=None,
                   help=f"tokens decoded per request (default {DEFAULTS['tokens']}; engines alone "
                        f"{ENGINES_DEFAULTS['tokens']}, prompt_lookup alone {PROMPT_LOOKUP_DEFAULTS['tokens']})")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats; the median is quoted")
    p.add_argument("--prompts", type=int, default=None,
                   help=f"how many built-in prompts to use (default {DEFAULTS['prompts']}; engines alone "
                        f"{ENGINES_DEFAULTS['prompts']})")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="engine threads per process")
    p.add_argument("--breakdown", action="store_true",
                   help="also show where a frame's time goes, per stage and part (one more pass)")
    p.add_argument("--llama-cpp-bin", type=Path, default=None, metavar="DIR",
                   help="for peers and kvtier: a directory holding llama-server and ggml-rpc-server "
                        "(deploy/build-llama-cpp.sh); without it the llama.cpp rows are skipped")
    p.add_argument("--cost-realistic", action="store_true",
                   help="for sweep: the cost-realistic pair of peers (the package's target in F32, with its "
                        "draft) instead of the package's own")
    p.add_argument("--shape", choices=sorted(shapes.SHAPES), default=LLAMA_3_1_8B.name,
                   help="for shapes: the model shape written (default: Llama-3.1-8B's, about 4.6 GB on disk "
                        "while it runs; qwen3.5-moe-35b-a3b-8-layers: 8 of Qwen3.5-35B-A3B's MoE layers, 4.4 GB)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument("--cache-dir", type=Path, default=None)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    scenarios = set(args.scenarios.split(","))
    if unknown := scenarios - set(SCENARIOS):  # before the model loads, not after
        raise SystemExit(f"mesh bench: unknown scenarios: {', '.join(sorted(unknown))}")
    fill_defaults(args, scenarios)
    bins = _llama_cpp_bins(args, scenarios)
    if "shapes" in scenarios:
        return _shapes(args, scenarios, bins)
    for name, written in OWN_MODEL.items():
        if name in scenarios:
            if scenarios != {name}:
                raise SystemExit(f"mesh bench: {name} runs alone (it writes and serves its own model)")
            args.model = str(written(args.cache_dir or cache_dir()))
    # every server the bench starts inherits it, and every request the bench sends carries it:
    # a key from the user's config can then never lock the bench out of its own servers
    os.environ.setdefault(KEY_ENV, secrets.token_hex(16))
    setup = _setup(args)
    default = ALONE_DELAYS.get(frozenset(scenarios)) or ("0,5,20,50" if setup.machines else "0,20")
    delays = [float(d) for d in (args.wire_delays or default).split(",")]
    asked = Asked(setup, args, delays, PROMPTS[: args.prompts], bins)
    outcome = Outcome([])
    for name, scenario in BEFORE_MESH.items():
        outcome = _joined(outcome, scenario(asked)) if name in scenarios else outcome
    if scenarios & set(MESH_SCENARIOS):
        outcome.rows += _mesh_rows(asked, scenarios)
    for name, scenario in AFTER_MESH.items():
        outcome = _joined(outcome, scenario(asked)) if name in scenarios else outcome
    code = _report(args, header(setup, args) | outcome.header, outcome.rows, outcome.tables)
    return 1 if outcome.failed else code


def _joined(a: Outcome, b: Outcome) -> Outcome:
    return Outcome(a.rows + b.rows, a.tables + b.tables, a.header | b.header, a.failed or b.failed)


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
             frozenset({"sweep"}): SWEEP_DEFAULTS, frozenset({"shapes"}): SHAPES_DEFAULTS,
             frozenset({"prompt_lookup"}): PROMPT_LOOKUP_DEFAULTS, frozenset({"guard"}): GUARD_DEFAULTS,
             frozenset({"machines"}): MACHINES_DEFAULTS, frozenset({"hybrid"}): HYBRID_DEFAULTS,
             frozenset({"mtp"}): MTP_DEFAULTS, frozenset({"sampling"}): SAMPLING_DEFAULTS,
             frozenset({"front_doors"}): FRONT_DOORS_DEFAULTS, frozenset({"kvtier"}): KVTIER_DEFAULTS,
             frozenset({"corpus"}): CORPUS_DEFAULTS}
    for name, value in alone.get(frozenset(scenarios), DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def _llama_cpp_bins(args: argparse.Namespace, scenarios: set[str]) -> Binaries | None:
    """peers, sweep, guard, machines, hybrid and mtp always emulate machines; for peers and shapes a
    --llama-cpp-bin that lacks a binary fails now, not an hour in."""
    if scenarios & {"peers", "sweep", "shapes", "guard", "machines", "hybrid", "mtp"}:
        args.machines = True
    if not scenarios & {"peers", "shapes", "kvtier"}:
        return None
    bins = Binaries(args.llama_cpp_bin) if args.llama_cpp_bin else None
    # kvtier needs llama-server alone, and says so as it skips it
    if bins and scenarios & {"peers", "shapes"} and (missing := bins.missing()):
        raise SystemExit(f"mesh bench: --llama-cpp-bin {bins.dir} lacks {', '.join(missing)}")
    return bins


def _shapes(args: argparse.Namespace, scenarios: set[str], bins: Binaries | None) -> int:
    """The shapes scenario, alone: it brings its own model, so no other scenario's setup is made."""
    if scenarios != {"shapes"}:
        raise SystemExit("mesh bench: shapes runs alone (it writes and serves its own model)")
    os.environ.setdefault(KEY_ENV, secrets.token_hex(16))
    head, outcome = shapes.run(args, bins)
    return _report(args, head, outcome.rows, outcome.tables)


def _mesh_rows(asked: Asked, scenarios: set[str]) -> list[Row]:
    """The baseline and the split servers, started once; then each mesh scenario asked (split always)."""
    setup, args = asked.setup, asked.args
    stages = [int(s) for s in args.stages.split(",")]
    with tempfile.TemporaryDirectory(prefix="mesh-bench-") as tmp, contextlib.ExitStack() as stack:
        base = stack.enter_context(baseline_worker(setup))
        servers = {n: stack.enter_context(serve(setup, Path(tmp), n)) for n in stages}
        shared = Shared(asked, Path(tmp), stack, base, servers)
        rows = [row for name, scenario in MESH_SCENARIOS.items() if name == "split" or name in scenarios
                for row in scenario(shared)]
        if args.breakdown:
            streams = max(int(s) for s in args.streams.split(",")) if "concurrency" in scenarios else 0
            rows += breakdown_rows(setup, servers, asked.prompts, streams)
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
