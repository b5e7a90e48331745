"""`mesh bench --scenarios front_doors`: streams through two coordinators that share the
stages (issue 45), against the same streams through one of them.

One `mesh stage` holds the layers past stage 0's, and two `mesh serve` claim it, each a stage
0 of its own (the second takes the first's cut: the range is loaded once). Each repeat sends
8 streams to coordinator A alone, then the same 8 split between A and B; the two are
interleaved. Stage 0 (the draft off) is the busiest stage on SmolLM2's cut, so a second
coordinator should carry more where it has cores of its own: with --machines, A, B and the
stage each get a CPU set (three sets; with fewer they share, and the row says so).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.harness.client import stream_chat
from bench.harness.harness import Asked, Outcome, Row, Setup
from bench.harness.local_server import LocalServer, local_serve
from bench.harness.streams import cycled

STREAMS = 8
GOAL = ">= 1.3"  # issue 45's, where the cores allow


def run(asked: Asked) -> Outcome:
    setup, token = asked.setup, secrets.token_hex(16)
    sets = setup.machines.for_stages(3) if setup.machines else [None, None, None]  # A, B, the stage
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="mesh-bench-front-doors-")))
        stage = stack.enter_context(_stage(setup, tmp, token, sets[2]))
        a, b = (stack.enter_context(_coordinator(setup, tmp, token, stage, cpus)) for cpus in sets[:2])
        prompts = cycled(asked.prompts, STREAMS)
        for urls in ([a.url], [a.url, b.url]):  # unmeasured: every prompt prefilled once where it will run
            _aggregate(setup, urls, prompts)
        one: list[float] = []
        two: list[float] = []
        for _ in range(asked.args.repeats):
            one.append(_aggregate(setup, [a.url], prompts))
            two.append(_aggregate(setup, [a.url, b.url], prompts))
    shared = len(set(sets)) < 3 if setup.machines else True
    where = "shared cores: contention, not machines" if shared else "each on its own CPU set"
    scenario = f"front_doors {STREAMS} streams ({where})"
    base = statistics.median(one)
    return Outcome([Row(scenario, "one coordinator, aggregate tok/s", base, samples=one),
                    Row(scenario, "two coordinators sharing the stage, aggregate tok/s (vs one)",
                        statistics.median(two), base, GOAL, two)])


def _aggregate(setup: Setup, urls: list[str], prompts: list[str]) -> float:
    """Completion tokens a second of `prompts` streamed at once, dealt over `urls` in turn."""
    started = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        timings = list(pool.map(lambda i: stream_chat(urls[i % len(urls)], setup.model_id, prompts[i], setup.tokens),
                                range(len(prompts))))
    return sum(t.completion_tokens for t in timings) / (time.perf_counter() - started)


@contextlib.contextmanager
def _stage(setup: Setup, tmp: Path, token: str, cpus: str | None) -> Iterator[str]:
    """A `mesh stage` with lanes for both coordinators; yields its control address."""
    cmd = [sys.executable, "-m", "mesh.cli", "stage", "--listen", "127.0.0.1:0", "--cache-dir", str(tmp / "stage"),
           "--lanes", str(2 * STREAMS)]
    cmd += ["--cpus", cpus] if cpus else ["--threads", str(setup.threads)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, env={**os.environ, "MESHPIPE_TOKEN": token})
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode().strip()
        if not line.startswith("listening "):
            raise SystemExit(f"mesh bench: front_doors: the stage did not start (it said {line!r})")
        yield line.split()[1]
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
        proc.kill()


def _coordinator(setup: Setup, tmp: Path, token: str, stage: str, cpus: str | None
                 ) -> contextlib.AbstractContextManager[LocalServer]:
    args = ["--peer", stage, "--advertise", "127.0.0.1", "--artifact-listen", "127.0.0.1:0", "--no-draft",
            "--lanes", str(STREAMS), "--ctx-size", str(setup.ctx), "--cache-dir", str(setup.cache),
            "--cut-on", "parameters", "--no-warm-up"]
    args += ["--stage-cpus", cpus] if cpus else ["--threads", str(setup.threads)]
    args += ["--model", setup.model] if setup.model else []
    return local_serve(args, tmp, env={"MESHPIPE_TOKEN": token})
