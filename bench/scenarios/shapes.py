"""`mesh bench --scenarios shapes`: meshpipe on a real model's shape at full size (issue 40, part 7).

It writes a random-weight Q4_0 GGUF of the shape (bench/harness/shape_model.py; Llama-3.1-8B's
by default, about 4.6 GB) into a fresh directory and measures, each step pinned to its
emulated machine (one CPU set each, `--cpu-sets`; every step runs in its own process,
bench/harness/shapes_io.py):

- `mesh package write` on it and sha256 of every layer file, in GB/s, next to `cp` of the file;
- stage 1 pulling its layers from the artifact server of a peer (stage/prepare.py over gRPC,
  fetched and each file verified), next to the same files over one plain loopback socket;
- llama.cpp loading each stage's GGUF, next to it loading the whole file;
- what a verify window's row costs against a one-row decode, the whole model on one machine
  (on an MoE a window's rows route to different experts, so its rows share fewer weights);
- each stage's peak resident memory in a `mesh serve --local-stages 2 --lanes 1`, next to its
  share of the weights;
- decode tok/s of that split-2 against llama.cpp's RPC split-2 at the same cut
  (bench/harness/llama_cpp.py), at each one-way link delay.

Every file is written, copied and read with the page cache warm: the model was just written
and this scenario measures the software, not the disk. The directory and everything in it
is deleted when the run ends, failed or interrupted too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench.harness import llama_cpp
from bench.harness.client import mesh_cuts, stream_chat
from bench.harness.harness import Outcome, Row, ServeOptions, Setup, serve, weight_share
from bench.harness.hybrid_model import QWEN35_MOE_35B_8, HybridShape
from bench.harness.llama_cpp import Binaries, RpcSplit, ServerSpec
from bench.harness.local_server import LocalServer, stage_pids, stop
from bench.harness.machines import Machines
from bench.harness.report import machine
from bench.harness.shape_model import SHAPES as LLAMA_SHAPES
from bench.harness.shape_model import Shape
from mesh.cli.bearer import auth_headers
from mesh.reports.health import Health
from mesh.reports.proc_memory import peak_rss
from mesh.routing.planner import StageRange, plan_ranges
from packages.manifest import Manifest
from packages.materialize import materialize_stage
from packages.parameters import layer_parameters
from packages.validate import validate_package
from stage.llama_model import flash_attn, use_extra_bufts

PROMPT = "Say hello."  # short: a random model's prefill of a long one would cost more than its decode
CTX = 512
LOAD_ROUNDS = 2
GB = 1e9
# Every shape --shape takes: llama's dense ones, and a frontier MoE's layers (Qwen3.5-MoE).
SHAPES: dict[str, Shape | HybridShape] = {**LLAMA_SHAPES, QWEN35_MOE_35B_8.name: QWEN35_MOE_35B_8}


@dataclass(frozen=True)
class Plan:
    """What one run measures: the shape, the machines, and the decode comparison's settings."""

    shape: Shape | HybridShape
    machines: Machines
    tokens: int
    repeats: int
    delays: list[float]
    bins: Binaries | None
    parent: Path | None = None  # where the generated directory goes (default: the temp dir)
    say: Callable[[str], None] = lambda m: print(f"bench: {m}", file=sys.stderr)


@contextlib.contextmanager
def generated_dir(parent: Path | None = None) -> Iterator[Path]:
    """A fresh directory for everything the scenario writes; removed however the block ends."""
    root = Path(tempfile.mkdtemp(prefix="mesh-bench-shapes-", dir=parent))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def shapes_rows(plan: Plan) -> tuple[list[Row], str]:
    """The rows for the results table and JSON, and a table of the issue's goals."""
    with generated_dir(plan.parent) as root:
        gguf = root / "model.gguf"
        rows = [written_row(gguf, plan.shape)]
        plan.say(f"wrote {gguf.stat().st_size / GB:.2f} GB of {plan.shape.name} in {rows[0].value:.1f} s")
        rows += _package_rows(root, gguf, plan.machines.sets[0])
        package = root / "package"
        manifest, sha = validate_package(package)
        ranges = first_plan(package, manifest)
        plan.say(f"packaged; split-2 by parameters: {ranges[0].end}/{ranges[1].layers} layers")
        rows += _transfer_rows(root, package, manifest, ranges[1], plan.machines.for_stages(2))
        rows += _load_rows(root, gguf, package, (manifest, sha), ranges, plan.machines.for_stages(2))
        rows += row_cost_rows(gguf, plan.shape.vocab, plan.machines.sets[0])
        setup = Setup(str(package), manifest.model_id, manifest.quantization, package, gguf, manifest,
                      plan.tokens, 1, CTX, root / "cache", plan.machines)
        rows += _decode_rows(setup, plan, root)
    return rows, goals_table(rows)


def written_row(gguf: Path, shape: Shape | HybridShape) -> Row:
    start = time.perf_counter()
    shape.write(gguf)
    return Row("shapes write", f"random {shape.name} Q4_0 GGUF written, {gguf.stat().st_size / GB:.2f} GB (s)",
               time.perf_counter() - start)


def first_plan(package: Path, manifest: Manifest) -> list[StageRange]:
    """The split-2 a mesh starts with: cut by parameters, the head counted (mesh/routing/route.py)."""
    layers, head = layer_parameters(package, manifest)
    return plan_ranges(manifest.layer_count, manifest.allowed_cuts, [1.0, 1.0], layers, head)


# -- steps, each in its own pinned process ------------------------------------------------

def _command(cpus: str, *args: str) -> list[str]:
    return ["taskset", "-c", cpus, sys.executable, "-m", "bench.harness.shapes_io", *args]


def _step(cpus: str, *args: str) -> dict[str, Any]:
    os.sync()  # what the last step left dirty is written back before this one, not during it
    done = subprocess.run(_command(cpus, *args), capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"shapes step {args[0]} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


@contextlib.contextmanager
def _serving(cpus: str, *args: str) -> Iterator[tuple[subprocess.Popen[bytes], dict[str, Any]]]:
    """A step that serves: its process and its first line (the port it listens on)."""
    proc = subprocess.Popen(_command(cpus, *args), stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"shapes step {args[0]} exited with {proc.wait()} before it listened")
        yield proc, dict(json.loads(line))
    finally:
        stop(proc)


def _timed_cp(cpus: str, src: Path, dest: Path) -> float:
    os.sync()
    start = time.perf_counter()
    subprocess.run(["taskset", "-c", cpus, "cp", str(src), str(dest)], check=True)
    seconds = time.perf_counter() - start
    dest.unlink()
    return seconds


def _package_rows(root: Path, gguf: Path, cpus: str) -> list[Row]:
    size = gguf.stat().st_size
    cp = size / _timed_cp(cpus, gguf, root / "cp-copy.gguf") / GB
    written = size / _step(cpus, "package", str(gguf), str(root / "package"))["seconds"] / GB
    hashed = _step(cpus, "hash", str(root / "package"))
    return [Row("shapes package", "cp of the GGUF (GB/s)", cp),
            Row("shapes package", "mesh package write, hashing included (GB/s, vs cp)", written, cp, ">= 0.5"),
            Row("shapes package", "sha256 of every layer file (GB/s, vs cp)", hashed["bytes"] / hashed["seconds"] / GB,
                cp)]


def _transfer_rows(root: Path, package: Path, manifest: Manifest, last: StageRange, cpus: list[str]) -> list[Row]:
    """Stage 1's files from a peer on machine 0 to machine 1: gRPC as a stage pulls, then a plain socket."""
    files = [package / a.path for a in [*manifest.shared.values(), *manifest.layers[last.start:last.end]]]
    with _serving(cpus[0], "artifacts", str(package)) as (_, served):
        _warm(files)
        pulled = _step(cpus[1], "pull", f"127.0.0.1:{served['port']}", served["sha"], str(last.start),
                       str(last.end), str(root / "pull-cache"))
    shutil.rmtree(root / "pull-cache")
    with _serving(cpus[1], "socket-recv", str(root / "socket-copy"), str(len(files))) as (proc, served):
        _warm(files)
        _step(cpus[0], "socket-send", str(served["port"]), *map(str, files))
        assert proc.stdout is not None
        copied = json.loads(proc.stdout.readline())
    shutil.rmtree(root / "socket-copy")
    plain = copied["bytes"] / copied["seconds"] / GB
    what = f"stage 1 [{last.start},{last.end}): {pulled['bytes'] / GB:.2f} GB"
    return [Row("shapes transfer", f"plain loopback socket copy, {what} (GB/s)", plain),
            Row("shapes transfer", f"peer pull over gRPC, fetched and verified, {what} (GB/s, vs socket)",
                pulled["bytes"] / pulled["transfer_seconds"] / GB, plain, ">= 0.7"),
            Row("shapes transfer", "peer pull, fetch to stage GGUF materialized (s)", pulled["prepare_seconds"])]


def _warm(files: list[Path]) -> None:
    """Read `files` into the page cache before a transfer: both send from memory, whatever the
    steps before them left cached, and neither times the disk."""
    for path in files:
        with path.open("rb") as f:
            while f.read(8 << 20):
                pass


def _load_rows(root: Path, gguf: Path, package: Path, pinned: tuple[Manifest, str], ranges: list[StageRange],
               cpus: list[str]) -> list[Row]:
    """llama.cpp loading each stage's GGUF (materialized into the cache `mesh serve` then uses) and the
    whole file, each on its machine, LOAD_ROUNDS rounds in turn: the fastest counts, as the first
    load of a file can pay for what another process left in the page cache."""
    manifest, sha = pinned
    stages, made = [], []
    for r in ranges:
        start = time.perf_counter()
        stages.append(materialize_stage(package, manifest, sha, r.start, r.end, root / "cache"))
        made.append(time.perf_counter() - start)
    files = [(gguf, cpus[0]), *zip(stages, cpus, strict=True)]
    loads = [[_step(cpu, "load", str(f), str(CTX)) for f, cpu in files] for _ in range(LOAD_ROUNDS)]
    best = [min(rounds, key=lambda x: x["seconds"]) for rounds in zip(*loads, strict=True)]
    whole = best[0]
    rows = [Row("shapes load", "llama.cpp loads the whole GGUF (s)", whole["seconds"],
                samples=[x[0]["seconds"] for x in loads]),
            Row("shapes load", "llama.cpp whole-GGUF load, peak RSS (MB, vs all weights)", whole["peak_rss"] / 1e6,
                weight_share(manifest, 0, manifest.layer_count) / 1e6)]
    for i, (r, seconds, loaded) in enumerate(zip(ranges, made, best[1:], strict=True)):
        rows += [Row("shapes load", f"stage {i} [{r.start},{r.end}): stage GGUF materialized (s)", seconds),
                 Row("shapes load", f"stage {i} [{r.start},{r.end}): llama.cpp loads it (s, vs whole)",
                     loaded["seconds"], whole["seconds"], samples=[x[i + 1]["seconds"] for x in loads])]
    return rows


def row_cost_rows(gguf: Path, vocab: int, cpus: str) -> list[Row]:
    """A verify window's rows against a one-row decode at one position, one engine thread."""
    cost = _step(cpus, "rowcost", str(gguf), str(vocab))
    rows, at = cost["rows"], cost["at"]
    return [Row("shapes row cost", f"one-row decode at position {at}, whole model (ms)", cost["decode_ms"]),
            Row("shapes row cost", f"verify of {rows} rows, all logits (ms)", cost["verify_ms"]),
            Row("shapes row cost", "verify, ms per row (vs a one-row decode)", cost["verify_ms"] / rows,
                cost["decode_ms"])]


# -- decode and memory, on served meshes -----------------------------------------------------

def _decode_rows(setup: Setup, plan: Plan, root: Path) -> list[Row]:
    logs = root / "logs"
    logs.mkdir()
    if skip := skipped(plan.bins):
        plan.say(f"shapes: {skip}")
    rows: list[Row] = []
    for d in plan.delays:
        with contextlib.ExitStack() as stack:
            mesh = stack.enter_context(serve(setup, logs, 2, ServeOptions(delay_ms=d, lanes=1)))
            urls = {"meshpipe split-2": mesh.url}
            (cut,) = mesh_cuts(mesh.url)
            if plan.bins and not skip:
                urls["llama.cpp RPC split-2"] = _rpc_split(stack, plan.bins, setup, cut, d, logs)
            plan.say(f"{d:g} ms: decoding on {', '.join(urls)} (cut at layer {cut})")
            tps = _interleave(setup, urls, plan.repeats)
            rows += _tps_rows(f"shapes decode {d:g} ms", tps, cut, skip)
            if d == plan.delays[0]:
                rows += memory_rows(setup.manifest, mesh) + llama_cpp_memory_rows(setup.manifest, cut)
    return rows


def skipped(bins: Binaries | None) -> str:
    """Why llama.cpp's RPC split-2 is left out ("" when it runs)."""
    if bins is None:
        return f"skipped: no --llama-cpp-bin given ({llama_cpp.BUILD_HINT})"
    if missing := bins.missing():
        return f"skipped: {bins.dir} lacks {', '.join(missing)} ({llama_cpp.BUILD_HINT})"
    return ""


def _rpc_split(stack: contextlib.ExitStack, bins: Binaries, setup: Setup, cut: int, delay: float, logs: Path) -> str:
    assert setup.machines is not None
    first, second = setup.machines.for_stages(2)
    link = stack.enter_context(llama_cpp.rpc_link(bins, second, delay, logs))
    spec = ServerSpec(setup.gguf, first, setup.ctx, RpcSplit((link,), (cut,), setup.manifest.layer_count))
    return stack.enter_context(llama_cpp.llama_server(bins, spec, logs)).url


def _interleave(setup: Setup, urls: dict[str, str], repeats: int) -> dict[str, list[float]]:
    for url in urls.values():  # the first request pays for lazy loading
        stream_chat(url, setup.model_id, PROMPT, 2)
    tps: dict[str, list[float]] = {unit: [] for unit in urls}
    names = list(urls)
    for rep in range(repeats):
        for unit in names[rep % len(names):] + names[: rep % len(names)]:
            tps[unit].append(stream_chat(urls[unit], setup.model_id, PROMPT, setup.tokens).decode_tps)
    return tps


def _tps_rows(scenario: str, tps: dict[str, list[float]], cut: int, skip: str) -> list[Row]:
    mesh = statistics.median(tps["meshpipe split-2"])
    rows = [Row(scenario, f"meshpipe split-2 decode tok/s (cut at {cut})", mesh, samples=tps["meshpipe split-2"])]
    if samples := tps.get("llama.cpp RPC split-2"):
        rpc = statistics.median(samples)
        rows += [Row(scenario, "llama.cpp RPC split-2 decode tok/s (same cut)", rpc, samples=samples),
                 Row(scenario, "meshpipe split-2 ÷ llama.cpp RPC split-2", mesh, rpc, ">= 1.0")]
    else:
        rows.append(Row(scenario, f"llama.cpp RPC split-2: {skip}", 0.0))
    return rows


def memory_rows(manifest: Manifest, server: LocalServer) -> list[Row]:
    """Each stage's peak RSS in a 1-lane split-2 (stage 0 is the coordinator's process) against
    its share of the weights; the goal is the share + 15%."""
    health = Health.model_validate_json(httpx.get(f"{server.url}/health", timeout=10, headers=auth_headers()).content)
    pids = [server.process.pid, *stage_pids(server.process.pid)]
    rows = []
    for stage, pid in zip(health.stages, pids, strict=False):
        assert stage.start is not None
        assert stage.end is not None
        share = weight_share(manifest, stage.start, stage.end)
        scenario = f"shapes memory stage {stage.stage}"
        rows.append(Row(scenario, f"peak RSS, layers [{stage.start},{stage.end}), 1 lane, ctx {CTX} "
                        "(MB, vs its weights)", peak_rss(pid) / 1e6, share / 1e6, "<= 1.15"))
        parts = resident_parts(pid)
        rows += [Row(scenario, f"resident now, {kind} (MB)", parts.get(key, 0) / 1e6)
                 for key, kind in (("RssAnon", "anonymous"), ("RssFile", "file-backed (the mmapped GGUF)"))]
    return rows


def llama_cpp_memory_rows(manifest: Manifest, cut: int) -> list[Row]:
    """The same for llama.cpp's RPC split-2, where it runs: llama-server holds [0, cut) and the
    embeddings, ggml-rpc-server the rest and the head (the shares meshpipe's stages hold)."""
    shares = {llama_cpp.SERVER: weight_share(manifest, 0, cut),
              llama_cpp.RPC_SERVER: weight_share(manifest, cut, manifest.layer_count)}
    rows = []
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error, IndexError):
            name = Path(child.cmdline()[0]).name
            if name in shares:
                rows.append(Row(f"shapes memory {name}", "peak RSS, llama.cpp RPC split-2, same layers (MB, vs its "
                                "weights)", peak_rss(child.pid) / 1e6, shares[name] / 1e6))
    return rows


def resident_parts(pid: int) -> dict[str, int]:
    """Bytes resident now by kind (RssAnon, RssFile, RssShmem), from /proc; {} where it is not there."""
    parts = {}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.startswith("Rss"):
                parts[key] = int(value.split()[0]) * 1024
    return parts


def goals_table(rows: list[Row]) -> str:
    """The rows that carry a goal, with whether each is met."""
    lines = ["shapes: the goals of issue 40", "", "| metric | value | against | ratio | goal | met |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        if not r.goal or r.ratio is None or r.baseline is None:
            continue
        op, bound = r.goal.split()
        met = r.ratio >= float(bound) if op == ">=" else r.ratio <= float(bound)
        lines.append(f"| {r.scenario}: {r.metric} | {r.value:.2f} | {r.baseline:.2f} | {r.ratio:.2f} | {r.goal} | "
                     f"{'yes' if met else 'NO'} |")
    return "\n".join(lines)


def run(args: argparse.Namespace, bins: Binaries | None) -> tuple[dict[str, Any], Outcome]:
    """The header and the outcome of a run of --shape: it brings its own model, so no other
    scenario's setup is made."""
    machines = Machines.parse(args.cpu_sets)
    delays = [float(d) for d in (args.wire_delays or "0,20").split(",")]
    rows, goals = shapes_rows(Plan(SHAPES[args.shape], machines, args.tokens, args.repeats, delays, bins))
    header = {"model": f"random-weight {args.shape} Q4_0", "threads": 1, "machines": machines.describe([2]),
              "wire delays (ms, one way)": ",".join(f"{d:g}" for d in delays), "page cache": "warm",
              "extra buffer types": "on" if use_extra_bufts() else "off",
              "flash attn": "on" if flash_attn() else "off", "tokens": args.tokens, "repeats": args.repeats,
              "machine": machine()}
    return header, Outcome(rows, [goals])
