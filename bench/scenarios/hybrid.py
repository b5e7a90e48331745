"""`mesh bench --scenarios hybrid`: speculation on a hybrid model split in two (issue 43).

It runs alone, on its own model: a random-weight Q4_0 `qwen35` of Qwen3.5's layer pattern at
about 1.1B parameters (bench/harness/hybrid_model.py), written once into the cache. Rows:

- what a rollback costs on it, in one process with one engine thread: saving a lane's
  recurrent state before a verify frame of 4 rows, loading it back, the bytes a lane, and
  both against that frame's decode (stage/checkpoints.py; issue 43's goal: at most 0.1);
- at each per-hop delay (0 and 20 ms unless --wire-delays says), three split-2 servers
  interleaved: no speculation, the model drafting for itself (the target's own GGUF: every
  draft accepted, the mechanism's ceiling) and a requantized draft (IQ4_NL: rejected now and
  then, so lanes roll back), with tok/s against none, each draft's accept rate, and whether
  the greedy text stayed the same.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from bench.harness.client import StreamTiming, stream_chat
from bench.harness.harness import Asked, Outcome, Row, Setup, split2_per_delay
from bench.harness.hybrid_model import QWEN35_1B, write_hybrid_gguf
from packages.requantize import requantize
from stage.checkpoints import Restore
from stage.engine import EngineConfig, Step
from stage.llama_engine import LlamaRangeEngine

GOALS = {"checkpoint": "<= 0.1", "self": ">= 1.8"}  # issue 43's; the self-draft's at 20 ms
FRAME = 4  # rows of the verify frame a checkpoint is priced against
SAMPLES = 5


def model_path(cache: Path) -> Path:
    """The hybrid GGUF, written on first use (about 0.7 GB, seconds)."""
    path = cache / "bench" / f"{QWEN35_1B.name}-q4_0.gguf"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_hybrid_gguf(path.with_suffix(".part"), QWEN35_1B).rename(path)
    return path


def draft_path(model: Path) -> Path:
    """The requantized draft beside the model, made on first use (IQ4_NL: minutes on 2 cores)."""
    path = model.with_name(model.name.replace("q4_0", "iq4_nl"))
    if not path.is_file():
        requantize(model, path, "IQ4_NL")  # written whole, then moved into place
    return path


def run(asked: Asked) -> Outcome:
    setup = asked.setup
    rows = checkpoint_rows(setup.gguf)
    draft = draft_path(model_path(setup.cache))
    modes: dict[str, dict[str, Any]] = {
        "none": {}, "self": {"draft": True, "extra": ("--draft", str(setup.gguf))},
        "requantized": {"draft": True, "extra": ("--draft", str(draft))}}
    for d, urls in split2_per_delay(setup, "mesh-bench-hybrid-", asked.delays, modes):
        timings = _measure(setup, urls, asked.prompts, asked.args.repeats)
        rows += speed_rows(f"hybrid split-2 {d:g} ms", timings, GOALS["self"] if d >= 20 else "")
    return Outcome(rows, header={"hybrid model": f"{QWEN35_1B.name}, random Q4_0, "
                                                 f"{QWEN35_1B.state_bytes() / 1e6:.1f} MB of state a lane"})


def checkpoint_rows(gguf: Path) -> list[Row]:
    """Save and load a lane's recurrent state around a verify frame, one engine thread."""
    cfg = EngineConfig(first=True, final=True, lanes=1, ctx_per_lane=256, threads=1)
    engine = LlamaRangeEngine(gguf, cfg)
    lanes, engine.recurrent = engine.recurrent, None  # timed by hand: the engine's own would add to the decode
    try:
        assert lanes is not None, f"{gguf.name} keeps no recurrent state"
        engine.step([Step(0, 0, tokens=np.arange(1, 33, dtype=np.int32))])
        frame = np.arange(5, 5 + FRAME, dtype=np.int32)
        times: dict[str, list[float]] = defaultdict(list)
        for _ in range(SAMPLES):
            began = time.perf_counter()
            state = lanes.save(0)
            saved = time.perf_counter()
            engine.step([Step(0, 32, tokens=frame, all_logits=True)])
            decoded = time.perf_counter()
            lanes.restore(0, Restore(32, state))  # the next frame starts at 32 again
            times["save"].append(saved - began)
            times["decode"].append(decoded - saved)
            times["restore"].append(time.perf_counter() - decoded)
        med = {k: statistics.median(v) for k, v in times.items()}
        name = f"hybrid checkpoint, {FRAME}-row frame, 1 thread"
        return [Row(name, "state saved (ms)", med["save"] * 1e3, samples=[t * 1e3 for t in times["save"]]),
                Row(name, "state loaded (ms)", med["restore"] * 1e3, samples=[t * 1e3 for t in times["restore"]]),
                Row(name, "frame decoded (ms)", med["decode"] * 1e3, samples=[t * 1e3 for t in times["decode"]]),
                Row(name, "state a lane (MB)", len(state) / 1e6),
                Row(name, "save + load (vs the frame's decode)", med["save"] + med["restore"], med["decode"],
                    GOALS["checkpoint"])]
    finally:
        engine.close()


def _measure(setup: Setup, urls: dict[str, str], prompts: list[str], repeats: int) -> dict[str, list[StreamTiming]]:
    """Every mode per prompt and repeat; which goes first rotates, to spread drift."""
    timings: dict[str, list[StreamTiming]] = defaultdict(list)
    modes = list(urls)
    for rep in range(repeats):
        for i, prompt in enumerate(prompts):
            turn = (rep + i) % len(modes)
            for mode in modes[turn:] + modes[:turn]:
                timings[mode].append(stream_chat(urls[mode], setup.model_id, prompt, setup.tokens))
    return timings


def speed_rows(scenario: str, timings: dict[str, list[StreamTiming]], goal: str) -> list[Row]:
    tps = {mode: [t.decode_tps for t in runs] for mode, runs in timings.items()}
    none = statistics.median(tps["none"])
    rows = [Row(scenario, "no speculation decode tok/s", none, samples=tps["none"])]
    for mode in ("self", "requantized"):
        stats = [t.speculative for t in timings[mode] if t.speculative]
        proposed, accepted = sum(s.proposed for s in stats), sum(s.accepted for s in stats)
        same = all(t.text == ref.text for t, ref in zip(timings[mode], timings["none"], strict=True))
        rows += [Row(scenario, f"{mode} draft tok/s (vs none)", statistics.median(tps[mode]), none,
                     goal if mode == "self" else "", tps[mode]),
                 Row(scenario, f"{mode} draft accept rate", accepted / proposed if proposed else 0.0),
                 Row(scenario, f"{mode} draft: outputs identical to none (1 = yes)", float(same), goal="1")]
    return rows
