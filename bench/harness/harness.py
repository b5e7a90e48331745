"""What every `mesh bench` scenario builds on: the run's setup, a result row, the single-node
llama.cpp baseline and `mesh serve --local-stages N`.

The scenarios (bench/scenarios/) import it; the runner (bench/run.py) imports the scenarios.
So nothing here knows a scenario, and no scenario imports the runner.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from bench.harness.llama_cpp import Binaries
from bench.harness.local_server import LocalServer, local_serve
from bench.harness.machines import Machines
from mesh.model.source import resolve_model
from mesh.model.tokenizer import Tokenizer
from packages.manifest import Manifest
from packages.materialize import materialize_stage


@dataclass
class Row:
    """One line of the results table; `ratio` is against `baseline` when there is one."""

    scenario: str
    metric: str
    value: float
    baseline: float | None = None
    goal: str = ""
    samples: list[float] = field(default_factory=list)

    @property
    def ratio(self) -> float | None:
        return self.value / self.baseline if self.baseline else None


@dataclass(frozen=True)
class Setup:
    """What every scenario of one run shares: the model, its stage GGUF and the run's options."""

    model: str | None
    model_id: str
    quant: str
    package: Path
    gguf: Path
    manifest: Manifest
    tokens: int
    threads: int
    ctx: int
    cache: Path
    machines: Machines | None = None  # --machines: each stage pinned to its own CPU set


def setup_for(setup: Setup, model: Path, say: Callable[[str], None]) -> Setup:
    """The same run on another model (a GGUF or a package): its package, whole-model stage
    GGUF and id, as the run's own were made (bench/run.py)."""
    package, manifest, sha, model_id = resolve_model(str(model), setup.cache, say=say)
    gguf = materialize_stage(package, manifest, sha, 0, manifest.layer_count, setup.cache)
    return replace(setup, model=str(model), model_id=model_id, quant=manifest.quantization, package=package,
                   gguf=gguf, manifest=manifest)


@dataclass(frozen=True)
class Asked:
    """What a scenario that starts its own servers is given: the setup, the command line, the
    per-hop delays, the prompts asked for (--prompts) and llama.cpp's binaries (--llama-cpp-bin)."""

    setup: Setup
    args: argparse.Namespace
    delays: list[float]
    prompts: list[str]
    bins: Binaries | None = None


@dataclass
class Outcome:
    """What a scenario gives back: its rows, any tables of its own, and any words for the header."""

    rows: list[Row]
    tables: list[str] = field(default_factory=list)
    header: dict[str, str] = field(default_factory=dict)
    failed: bool = False  # the run exits 1 (the guard scenario, when a check fell)


class Baseline:
    """The single-node llama.cpp process (`bench.harness.baseline`): one JSON line asked, one answered."""

    def __init__(self, proc: subprocess.Popen[str], tokenizer: Tokenizer) -> None:
        self.proc, self.tokenizer = proc, tokenizer

    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the baseline process died")
        return dict(json.loads(line))

    def chat(self, prompt: str, n: int, fresh: bool = False) -> dict[str, Any]:
        """Timings and the reply's token ids; `fresh` prefills all of the prompt, as a mesh
        without the prefix cache does, where llama-cpp-python would keep what the last one shares."""
        text = self.tokenizer.render_chat([{"role": "user", "content": prompt}])
        return self.ask({"tokens": self.tokenizer.tokenize(text, True), "n": n, "fresh": fresh})


@dataclass(frozen=True)
class Shared:
    """What the mesh scenarios share, started once for all of them: the baseline, and one split
    server per --stages (no draft, 8 lanes); `stack` holds what a scenario starts beside them."""

    asked: Asked
    tmp: Path
    stack: contextlib.ExitStack
    base: Baseline
    servers: dict[int, LocalServer]


@contextlib.contextmanager
def baseline_worker(setup: Setup) -> Iterator[Baseline]:
    cmd = [sys.executable, "-m", "bench.harness.baseline", str(setup.gguf), str(setup.ctx), str(setup.threads)]
    cmd += [setup.machines.sets[0]] if setup.machines else []
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        baseline = Baseline(proc, Tokenizer(setup.gguf, setup.model_id))
        assert proc.stdout is not None
        if not proc.stdout.readline():
            raise RuntimeError("the baseline process failed to load the model")
        yield baseline
    finally:
        proc.kill()
        proc.wait()


@dataclass(frozen=True)
class ServeOptions:
    """How `serve` runs `mesh serve`, besides the setup and the stage count."""

    draft: bool = False  # speculate with the package's draft alone (`--strategy draft`); `strategy` overrides
    delay_ms: float = 0.0  # --wire-delay-ms
    lanes: int = 8
    relay: bool = False  # --relay-replies
    in_flight: int | None = None  # --frames-in-flight
    strategy: str | None = None  # --strategy
    prefix_cache: bool = True
    engines: tuple[str, ...] = ()  # --engine, one for all stages or one per stage (default: mesh serve's)
    extra: tuple[str, ...] = ()  # a scenario's own flags
    port: int | None = None  # the API port (None: a free one); the same again is the same coordinator


def serve(setup: Setup, tmp: Path, stages: int, opts: ServeOptions = ServeOptions()
          ) -> contextlib.AbstractContextManager[LocalServer]:
    """`mesh serve --local-stages N`; without speculation unless a draft or a `--strategy` is asked
    for. With --machines each stage is pinned to its set and runs one engine thread per CPU of it."""
    draft, delay_ms, lanes, relay, in_flight = opts.draft, opts.delay_ms, opts.lanes, opts.relay, opts.in_flight
    strategy, prefix_cache, engines, extra = opts.strategy, opts.prefix_cache, opts.engines, opts.extra
    args = ["--local-stages", str(stages), "--lanes", str(lanes),
            "--ctx-size", str(setup.ctx), "--cache-dir", str(setup.cache), "--wire-delay-ms", str(delay_ms)]
    if setup.machines:
        args += ["--stage-cpus", *setup.machines.for_stages(stages)]
    else:
        args += ["--threads", str(setup.threads)]
    if strategy:
        args += ["--strategy", strategy]
    else:  # the draft alone, as every scenario measured it before `auto` asked prompt lookup first
        args += ["--strategy", "draft"] if draft else ["--no-draft"]
    args += [] if prefix_cache else ["--no-prefix-cache"]
    args += ["--relay-replies"] if relay else []
    args += ["--frames-in-flight", str(in_flight)] if in_flight is not None else []
    args += ["--engine", *engines] if engines else []
    args += list(extra)  # a scenario's own flags
    if setup.model:
        args += ["--model", setup.model]
    return local_serve(args, tmp, port=opts.port)


def split2_per_delay(setup: Setup, prefix: str, delays: list[float], modes: dict[str, dict[str, Any]]
                     ) -> Iterator[tuple[float, dict[str, str]]]:
    """Each delay in turn with one split-2 server per mode (its serve() keywords), up while the
    caller measures them: (delay, mode -> URL). One delay at a time is what fits in memory."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        for d in delays:
            with contextlib.ExitStack() as stack:
                yield d, {mode: stack.enter_context(serve(setup, Path(tmp), 2, ServeOptions(delay_ms=d, **kw))).url
                          for mode, kw in modes.items()}


def weight_share(m: Manifest, start: int, end: int) -> int:
    """Bytes of the package a stage of [start, end) holds: its layers, the metadata, and the
    embeddings at stage 0 and the output head at the final stage."""
    share = sum(a.artifact_bytes for a in m.layers[start:end])
    share += m.shared["metadata"].artifact_bytes if "metadata" in m.shared else 0
    if start == 0 and "embeddings" in m.shared:
        share += m.shared["embeddings"].artifact_bytes
    if end == m.layer_count and "output" in m.shared:
        share += m.shared["output"].artifact_bytes
    return share
