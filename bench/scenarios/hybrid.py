"""`mesh bench --scenarios hybrid`: speculation on a hybrid model split in two (issue 43).

It runs alone, on its own model: a random-weight Q4_0 `qwen35` of Qwen3.5's layer pattern at
about 1.1B parameters (bench/harness/hybrid_model.py), written once into the cache. Rows:

- what a rollback costs on it, in one process with one engine thread: saving a lane's
  recurrent state before a verify frame of 4 rows, loading it back, the bytes a lane, and
  both against that frame's decode (stage/checkpoints.py; issue 43's goal: at most 0.1);
- at each per-hop delay (0 and 20 ms unless --wire-delays says), three split-2 servers
  interleaved: no speculation, the model drafting for itself (the target's own GGUF) with
  `--draft`'s adaptive window, and the same with the cost-aware window. Greedy, every draft is
  accepted: the mechanism's ceiling. Sampled (temperature 1, seeded), the target draws from a
  nearly flat distribution over 151,936 tokens while the draft proposes its greedy pick, so
  nearly every window is rejected at its first draft and every stage restores and replays on
  every frame: the rejection path's price, which the adaptive window keeps paying and the
  cost-aware one should decline. Each against no speculation decoding the same way, with the
  accept rates and whether the text stayed the same.

A requantized draft shows no rejection here: this random model's greedy reply is one token
over and over, which an IQ4_NL copy names too (accepted 1.00), and so did a copy with 60% of
its rows drawn again.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from bench.harness.client import StreamTiming
from bench.harness.harness import Asked, Outcome, Row, split2_per_delay
from bench.harness.hybrid_model import QWEN35_1B, write_hybrid_gguf
from bench.harness.versus import interleaved, plain_row, versus_rows
from stage.checkpoints import Restore
from stage.engine import EngineConfig, Step
from stage.llama_engine import LlamaRangeEngine

GOALS = {"checkpoint": "<= 0.1", "self": ">= 1.8"}  # issue 43's; the self-draft's at 20 ms
COST_AWARE = "self cost-aware"
FRAME = 4  # rows of the verify frame a checkpoint is priced against
SAMPLES = 5


def model_path(cache: Path) -> Path:
    """The hybrid GGUF, written on first use (about 0.7 GB, seconds)."""
    path = cache / "bench" / f"{QWEN35_1B.name}-q4_0.gguf"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_hybrid_gguf(path.with_suffix(".part"), QWEN35_1B).rename(path)
    return path


def run(asked: Asked) -> Outcome:
    setup = asked.setup
    rows = checkpoint_rows(setup.gguf)
    config = setup.cache / "bench" / "hybrid-cost-aware.toml"
    config.write_text('[defaults.speculative]\nwindow_policy = "cost-aware"\n')
    draft = ("--draft", str(setup.gguf))
    modes: dict[str, dict[str, Any]] = {"none": {}, "self": {"draft": True, "extra": draft},
                                        COST_AWARE: {"draft": True, "extra": (*draft, "--config", str(config))}}
    for d, urls in split2_per_delay(setup, "mesh-bench-hybrid-", asked.delays, modes):
        timings = interleaved(setup, urls, asked.prompts, asked.args.repeats, SAMPLINGS)
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
            lanes.rings[0].dropped.append(state)  # as a rollback lets a checkpoint go: its buffer is reused
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


SAMPLED = {"temperature": 1.0, "seed": 7}
SAMPLINGS = {"": None, " sampled": SAMPLED}  # "none", "self", "none sampled", "self sampled", ...


def speed_rows(scenario: str, timings: dict[str, list[StreamTiming]], goal: str) -> list[Row]:
    """The self-draft against none, greedy (held to `goal`) and sampled (the rejection path)."""
    rows = []
    for how, suffix in (("greedy", ""), ("sampled", " sampled")):
        none = timings[f"none{suffix}"]
        rows.append(plain_row(scenario, f"{how}: no speculation decode tok/s", none))
        for mode, label in (("self", "self-draft"), (COST_AWARE, "self-draft, cost-aware")):
            rows += versus_rows(scenario, f"{how}: {label}", timings[f"{mode}{suffix}"], none,
                                goal if how == "greedy" and mode == "self" else "")
    return rows
