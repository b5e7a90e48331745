"""The accept rate rejection sampling can reach with a draft, teacher-forced: mean Σ min(p, q).

A token the draft draws from q, kept with probability min(1, p/q), is kept with probability
Σ_x min(p(x), q(x)) (stage/rejection.py). Averaged over the positions the target really
samples, that is the per-draft accept rate a served rejection rule can reach with this draft,
before a rejection voids the window's later drafts. The sampling scenario quotes it beside
the served rate. Here, in one process: the target samples each continuation at the asked
temperature, both models are fed the same tokens, and at each position p is the target's
distribution and q the draft's, both made as the server makes them (stage/distribution.py),
q cut to its best K tokens as a frame carries it (the server's K is `TOP`) or whole. Beside
each K, the bytes one drafted row's `Proposed` takes: what a larger K costs on the wire.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import numpy as np

from common.sampling import SamplingParams
from proto import meshpipe_pb2 as pb
from stage.distribution import TOP, probabilities, truncated
from stage.engine import EngineConfig, Step
from stage.llama_engine import LlamaRangeEngine

FULL = None  # q over the whole vocabulary, uncut
TOPS: tuple[int | None, ...] = (*sorted({8, 16, 32, 64, 128, TOP}), FULL)  # always the server's own K


@dataclass(frozen=True)
class Overlap:
    positions: int
    accept: Mapping[int | None, float]  # K -> mean Σ min(p, q cut to K)
    row_bytes: Mapping[int | None, float]  # K -> mean bytes of a drafted row's Proposed


def top_name(top: int | None) -> str:
    return "full vocabulary" if top is FULL else f"top {top}"


def teacher_forced(target: Path, draft: Path, prompts: list[list[int]], tokens: int, params: SamplingParams,
                   threads: int) -> Overlap:
    """`tokens` target samples after each prompt (seeded alike every run), and at each position
    Σ min(p, q_K) per K in TOPS."""
    tops = TOPS
    ctx = max(len(p) for p in prompts) + tokens + 8
    cfg = EngineConfig(first=True, final=True, lanes=1, ctx_per_lane=ctx, threads=threads)
    rng = np.random.default_rng(0)
    sums = np.zeros((len(tops), 2))
    engines = [LlamaRangeEngine(target, cfg)]
    try:
        engines.append(LlamaRangeEngine(draft, cfg))
        for prompt in prompts:
            sums += _follow(engines, prompt, tokens, params, tops, rng)
    finally:
        for engine in engines:
            engine.close()
    positions = len(prompts) * tokens
    means = sums / positions
    return Overlap(positions, MappingProxyType({k: float(m[0]) for k, m in zip(tops, means, strict=True)}),
                   MappingProxyType({k: float(m[1]) for k, m in zip(tops, means, strict=True)}))


def _follow(engines: list[LlamaRangeEngine], prompt: list[int], tokens: int, params: SamplingParams,
            tops: tuple[int | None, ...], rng: np.random.Generator) -> np.ndarray:
    """One prompt, both models fed the target's samples: per K, the sums of Σ min and of bytes."""
    rows = [e.step([Step(lane=0, start=0, tokens=np.asarray(prompt, dtype=np.int32))])[0][-1] for e in engines]
    sums = np.zeros((len(tops), 2))
    for position in range(len(prompt), len(prompt) + tokens):
        # no bias, penalties or grammar: the logits are already what a draw reads
        p, q = (probabilities(row, params) for row in rows)
        if len(p) != len(q):
            raise ValueError(f"the target's vocabulary has {len(p)} tokens and the draft's {len(q)}")
        sums += [at_top(p, q, top) for top in tops]
        token = np.asarray([rng.choice(len(p), p=p)], dtype=np.int32)
        rows = [e.step([Step(lane=0, start=position, tokens=token)])[0][-1] for e in engines]
    return sums


def at_top(p: np.ndarray, q: np.ndarray, top: int | None) -> tuple[float, int]:
    """Σ min(p, q cut to its best `top` and renormalised), and the bytes of that cut as a
    drafted row. The row names the draft's likeliest token: which one it drew changes its
    size by a byte or two at most."""
    ids, probs = truncated(q, len(q) if top is FULL else top)
    row = pb.Proposed(token=int(ids[0]), ids=ids.tolist(), weights=probs.astype(np.float32).tolist())
    return float(np.minimum(p[ids], probs).sum()), row.ByteSize()
