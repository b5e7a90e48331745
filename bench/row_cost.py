"""`python -m bench.row_cost`: what a row costs at the final stage, decode against verify.

The final stage runs in this process behind a `StageCore`, as a stage runs frames: the
batcher, the engine thread, the sampler. Each round times, at the same position, a
single-row decode (the last row's logits, one token sampled) and a verify window of
`--window` drafts (window + 1 rows, every row's logits, every row sampled), in alternating
order, and reads the times a stage stamps on its Hop: compute (the decode, logits to Python
included: the /metrics `compute` part) and sample; `round trip` is submit to sampled, the
event loop and the engine thread's hops included; `engine CPU` is the engine thread's CPU
time in the step, steadier than wall time when other processes share the core. With `--cut N` the final stage is layers
[N, end) fed the hidden states of [0, N) (computed beforehand, untimed); 0 is one node.

Run it pinned, one engine thread, as the bench's emulated machines do:
`taskset -c 1 python -m bench.row_cost --threads 1`.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.harness.prompts import PROMPTS
from common.ids import SessionId
from common.sampling import SamplingParams
from config.paths import cache_dir
from mesh.model.source import resolve_model
from mesh.model.tokenizer import Tokenizer
from packages.materialize import materialize_stage
from stage.core import StageCore
from stage.engine import EngineConfig, Step
from stage.frames import FrameSampling
from stage.llama_engine import LlamaRangeEngine


@dataclass(frozen=True)
class Timing:
    """One step's times in ms, as its Hop reports them, and from submit to sampled."""

    rows: int
    compute: float
    sample: float
    round_trip: float
    cpu: float


@dataclass(frozen=True)
class Inputs:
    """A frame's rows at the final stage: token ids at one node, hidden states after a cut."""

    tokens: np.ndarray
    hidden: np.ndarray | None

    def step(self, lane: int, start: int, end: int, all_logits: bool) -> Step:
        if self.hidden is None:
            return Step(lane, start, tokens=self.tokens[start:end], all_logits=all_logits)
        return Step(lane, start, hidden=self.hidden[start:end], all_logits=all_logits)


class _CpuTimed(LlamaRangeEngine):
    """Keeps the engine thread's CPU time of its last step."""

    cpu_s = 0.0

    def step(self, steps: list[Step]) -> list[np.ndarray]:
        began = time.thread_time()
        try:
            return super().step(steps)
        finally:
            self.cpu_s = time.thread_time() - began


def _stage(cut: int, threads: int, ctx: int) -> tuple[_CpuTimed, LlamaRangeEngine | None, Path]:
    """The final stage's engine, after a cut the engine of the layers before it, and the model."""
    cache = cache_dir()
    package, manifest, sha, _ = resolve_model(None, cache, print)
    end = manifest.layer_count

    def engine(start: int, stop: int) -> _CpuTimed:
        gguf = materialize_stage(package, manifest, sha, start, stop, cache)
        cfg = EngineConfig(first=start == 0, final=stop == end, lanes=1, ctx_per_lane=ctx, threads=threads)
        return _CpuTimed(gguf, cfg)

    return engine(cut, end), engine(0, cut) if cut else None, materialize_stage(package, manifest, sha, 0, end, cache)


def _inputs(gguf: Path, before: LlamaRangeEngine | None, length: int) -> Inputs:
    """The bench's prompts as one text: a model's rows on text are as peaked as in use, which
    sets what top-p keeps and so what sampling costs."""
    text = " ".join(PROMPTS * (1 + length // 100))
    tokens = np.asarray(Tokenizer(gguf, "row-cost").tokenize(text)[:length], dtype=np.int32)
    if before is None:
        return Inputs(tokens, None)
    hidden = before.step([Step(0, 0, tokens=tokens)])[0]
    return Inputs(tokens, hidden)


@dataclass(frozen=True)
class _Bench:
    """The final stage behind its core, the rows it is fed, and how it samples them."""

    core: StageCore
    engine: _CpuTimed
    inputs: Inputs
    params: SamplingParams
    lane: int

    async def timed(self, start: int, rows: int, all_logits: bool) -> Timing:
        began = time.perf_counter()
        work = self.core.submit(self.inputs.step(self.lane, start, start + rows, all_logits))
        logits = await work.output
        _, hop = self.core.sample(work, logits, FrameSampling(self.params), start, rows)
        trip = (time.perf_counter() - began) * 1e3
        await self.core.batcher.trim(self.lane, start)  # every round at the same position
        return Timing(rows, hop.compute_us / 1e3, hop.sample_us / 1e3, trip, self.engine.cpu_s * 1e3)

    async def rounds(self, prompt: int, window: int, rounds: int) -> tuple[list[Timing], list[Timing]]:
        """(decodes, verifies) at position `prompt`, after a warm-up round."""
        await self.core.submit(self.inputs.step(self.lane, 0, prompt, False)).output
        decodes: list[Timing] = []
        verifies: list[Timing] = []
        for r in range(rounds + 1):
            order = [False, True] if r % 2 else [True, False]  # interleaved, each first half the time
            for verify in order:
                t = await self.timed(prompt, window + 1 if verify else 1, verify)
                if r:
                    (verifies if verify else decodes).append(t)
        return decodes, verifies


def _report(decodes: list[Timing], verifies: list[Timing], say: Callable[[str], None]) -> None:
    def med(ts: list[Timing], part: Callable[[Timing], float]) -> float:
        return statistics.median(part(t) for t in ts)

    def spread(ts: list[Timing], part: Callable[[Timing], float]) -> str:
        q = statistics.quantiles([part(t) for t in ts], n=4)
        return f"{q[0]:.2f}-{q[2]:.2f}"

    rows = verifies[0].rows
    say(f"{'ms, median (IQR)':34} {'decode, 1 row':>20} {f'verify, {rows} rows':>20} {'verify per row':>15}")
    for name, part in _parts():
        d, v = med(decodes, part), med(verifies, part)
        say(f"{name:34} {d:8.2f} ({spread(decodes, part):>11}) {v:8.2f} ({spread(verifies, part):>11})"
            f" {v / rows:15.2f}")
    ratio = [v.compute / rows / d.compute for d, v in zip(decodes, verifies, strict=True)]
    say(f"verify row / decode, compute: {med(verifies, _compute) / rows / med(decodes, _compute):.3f} "
        f"(per round: median {statistics.median(ratio):.3f}, {len(ratio)} rounds); engine CPU: "
        f"{med(verifies, _cpu) / rows / med(decodes, _cpu):.3f}")


def _compute(t: Timing) -> float:
    return t.compute


def _cpu(t: Timing) -> float:
    return t.cpu


def _parts() -> Iterator[tuple[str, Callable[[Timing], float]]]:
    yield "compute (decode + logits out)", _compute
    yield "sample", lambda t: t.sample
    yield "round trip (submit to sampled)", lambda t: t.round_trip
    yield "engine CPU (the step's thread time)", _cpu


async def _main(args: argparse.Namespace) -> None:
    final, before, whole = _stage(args.cut, args.threads, args.prompt + args.window + 8)
    inputs = _inputs(whole, before, args.prompt + args.window + 1)
    if before is not None:
        before.close()
    core = StageCore(final, index=1)
    core.start()
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=1,
                            logprobs=args.logprobs)
    bench = _Bench(core, final, inputs, params, core.lane_for(SessionId(1)))
    try:
        decodes, verifies = await bench.rounds(args.prompt, args.window, args.rounds)
    finally:
        await core.stop()
        final.close()
    where = f"layers [{args.cut}, end)" if args.cut else "one node"
    p = params
    sampling = "greedy" if p.greedy else f"temperature {p.temperature} top_p {p.top_p} top_k {p.top_k}"
    print(f"final stage {where}, {args.threads} thread(s), position {args.prompt}, {args.rounds} rounds, {sampling}"
          f"{f', logprobs {params.logprobs}' if params.logprobs >= 0 else ''}")
    _report(decodes, verifies, print)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.row_cost", description=__doc__.splitlines()[0])
    parser.add_argument("--cut", type=int, default=0, help="the final stage starts at this layer (0: one node)")
    parser.add_argument("--window", type=int, default=4, help="drafts per verify window (rows = window + 1)")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--prompt", type=int, default=200, help="the position every step runs at")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--logprobs", type=int, default=-1)
    asyncio.run(_main(parser.parse_args(argv)))


if __name__ == "__main__":
    main()

