"""Run layers [start, end) of a stage GGUF on MLX (issue 17), as `LlamaRangeEngine` does on llama.cpp.

The same contract (`stage.engine.RangeEngine`) and the same input: the stage GGUF that
`packages.materialize` writes for the range, read by `mx.load` with no second download
format. Token ids in at the first stage, hidden states in and out in between (float32
[n, width], as llama.cpp's), logits at the final stage. Each lane has its own KV per layer
(`stage.mlx_models.cache`), trimmed to a step's authoritative start before it runs.

Steps run one after another inside `step`, one forward pass each; batching several
sessions' rows into one pass is not done yet. Activations are float32, as llama.cpp's on
a CPU; the numbers still differ from llama.cpp's in the last bits (its matmuls quantize
activations to 8 bits, and its KV is float16), so hidden states agree to a tolerance and
greedy tokens agree (tests/test_mlx_engine.py).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import mlx.core as mx
import numpy as np

from stage.cpu_lock import CpuLock
from stage.engine import EngineConfig, EngineError, Step, check_step
from stage.engine_choice import MLX_GGUF_TYPES, unsupported_tensor
from stage.mlx_models import builder
from stage.mlx_models.cache import KVCache


class MlxRangeEngine:
    def __init__(self, gguf: Path, cfg: EngineConfig) -> None:
        self.first, self.final = cfg.first, cfg.final
        self.lanes, self.ctx_per_lane, self.cfg = cfg.lanes, cfg.ctx_per_lane, cfg
        # each step is its own forward pass, so a decode of several sessions keeps their rows
        # apart whatever its size; the batcher's cap is just the configured batch
        self.graph_rows = cfg.batch
        bad = unsupported_tensor(gguf)
        if bad is not None:
            raise EngineError(f"MLX cannot read tensor {bad[0]} of type {bad[1]} in {gguf.name} "
                              f"(it reads {', '.join(MLX_GGUF_TYPES)}); run this range on llama.cpp")
        try:
            loaded = mx.load(str(gguf), return_metadata=True)
        except (RuntimeError, ValueError) as exc:
            raise EngineError(f"MLX could not load {gguf}: {exc}") from exc
        if not isinstance(loaded, tuple):
            raise EngineError(f"MLX read {gguf} as a single array, not a GGUF")
        weights, meta = loaded
        try:
            build = builder(str(meta.get("general.architecture", "")))
            self.model = build(meta, weights, cfg.first, cfg.final)
        except (KeyError, ValueError) as exc:
            raise EngineError(f"{gguf.name}: {exc.args[0]}") from exc
        # the casts and renames are lazy: compute them now, so a bad file fails at load and
        # not at the first step, and the engine holds its memory from the start
        mx.eval(self.model.parameters())
        self.width, self.n_vocab, self.n_layer = self.model.width, self.model.n_vocab, self.model.n_layer
        self.caches = [self.model.make_caches() for _ in range(cfg.lanes)]
        self._pos = [0] * cfg.lanes
        self.cpu_lock = CpuLock(cfg.cpu_lock) if cfg.cpu_lock else None

    def position(self, lane: int) -> int:
        return self._pos[self._check_lane(lane)]

    def trim(self, lane: int, position: int) -> None:
        self._check_lane(lane)
        if position < self._pos[lane]:
            for cache in self.caches[lane]:
                cache.trim(position)
            self._pos[lane] = max(position, 0)

    def step(self, steps: list[Step]) -> list[np.ndarray]:
        """Each step is one forward pass of its rows; a verify window of k drafts is k+1 rows."""
        for s in steps:
            self._prepare(s)
        with self.cpu_lock.held() if self.cpu_lock else contextlib.nullcontext():
            return [self._forward(s) for s in steps]

    def _prepare(self, s: Step) -> None:
        check_step(self, s, self._pos[self._check_lane(s.lane)])
        self.trim(s.lane, s.start)

    def _forward(self, s: Step) -> np.ndarray:
        caches = self.caches[s.lane]
        for cache in caches:  # a forward pass that failed midway may have left some layers ahead
            cache.trim(s.start)
        try:
            out = self._run(s, caches)
        except (RuntimeError, ValueError) as exc:
            raise EngineError(f"MLX forward pass failed: {exc}") from exc
        self._pos[s.lane] = s.start + s.n
        return out

    def _run(self, s: Step, caches: list[KVCache]) -> np.ndarray:
        if self.first:
            h = self.model.embed(mx.array(np.asarray(s.tokens, dtype=np.int32))[None])
        else:
            h = mx.array(np.asarray(s.hidden, dtype=np.float32))[None]
        h = self.model(h, caches)
        out = h if not self.final else self.model.logits(h if s.all_logits else h[:, -1:, :])
        mx.eval(out, *[a for cache in caches for a in cache.state])
        return np.array(out[0].astype(mx.float32), copy=True)

    def _check_lane(self, lane: int) -> int:
        if not 0 <= lane < self.lanes:
            raise EngineError(f"lane {lane} outside [0,{self.lanes})")
        return lane

    def close(self) -> None:
        self.caches = []
        if self.cpu_lock:
            self.cpu_lock.close()
            self.cpu_lock = None
