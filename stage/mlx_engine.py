"""Run layers [start, end) of a stage GGUF on MLX (issue 17), as `LlamaRangeEngine` does on llama.cpp.

The same contract (`stage.engine.RangeEngine`) and the same input: the stage GGUF that
`packages.materialize` writes for the range, read by `mx.load` with no second download
format. Token ids in at the first stage, hidden states in and out in between (float32
[n, width], as llama.cpp's), logits at the final stage. Each lane has its own KV per layer
(`stage.mlx_models.cache`), trimmed to a step's authoritative start before it runs.

Steps of several sessions with the same number of rows (decodes, equal verify windows)
run as one forward pass; others run one after another. Activations are float32, as llama.cpp's on
a CPU; the numbers still differ from llama.cpp's in the last bits (its matmuls quantize
activations to 8 bits, and its KV is q8_0 and f16), so hidden states agree to a tolerance and
greedy tokens agree (tests/test_mlx_engine.py).
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np

from common.errors import EngineError
from stage.cpu_lock import CpuLock
from stage.engine import EngineConfig, Step, check_step
from stage.mlx_models import RangeModel, builder
from stage.mlx_models.cache import LayerCache
from stage.mlx_tensors import MLX_GGUF_TYPES, unsupported_tensor


class MlxRangeEngine:
    def __init__(self, gguf: Path, cfg: EngineConfig) -> None:
        self.first, self.final = cfg.first, cfg.final
        self.lanes, self.ctx_per_lane, self.cfg = cfg.lanes, cfg.ctx_per_lane, cfg
        # each session is its own batch row of a forward pass (`passes`), so a decode of several
        # sessions keeps their rows apart whatever its size; the batcher's cap is just the batch
        self.graph_rows = cfg.batch
        bad = unsupported_tensor(gguf)
        if bad is not None:
            raise EngineError(f"MLX cannot read tensor {bad[0]} of type {bad[1]} in {gguf.name} "
                              f"(it reads {', '.join(MLX_GGUF_TYPES)}); run this range on llama.cpp")
        # the engine's own stream: MLX streams belong to the thread that made them, and the
        # engine thread's are destroyed at close (release_streams), so a later engine there
        # must not rely on the thread's default stream
        self.stream = mx.new_stream(mx.cpu)
        with mx.stream(self.stream):
            self.model = _load(gguf, cfg)
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
        """Steps with the same number of rows run as one forward pass, one batch row per
        session: the matmuls batched, attention per lane (stage.mlx_models.llama.Attention)."""
        for s in steps:
            self._prepare(s)
        out: list[np.ndarray] = [np.empty(0)] * len(steps)
        with self.cpu_lock.held() if self.cpu_lock else contextlib.nullcontext(), mx.stream(self.stream):
            for group in passes(steps):
                for i, result in zip(group, self._forward([steps[i] for i in group]), strict=True):
                    out[i] = result
        return out

    def _prepare(self, s: Step) -> None:
        check_step(self, s, self._pos[self._check_lane(s.lane)])
        self.trim(s.lane, s.start)

    def _forward(self, steps: list[Step]) -> list[np.ndarray]:
        lanes = [self.caches[s.lane] for s in steps]
        for s, caches in zip(steps, lanes, strict=True):
            for cache in caches:  # a forward pass that failed midway may have left some layers ahead
                cache.trim(s.start)
        try:
            out = self._run(steps, lanes)
        except (RuntimeError, ValueError) as exc:
            raise EngineError(f"MLX forward pass failed: {exc}") from exc
        for s in steps:
            self._pos[s.lane] = s.start + s.n
        return out

    def _run(self, steps: list[Step], lanes: list[list[LayerCache]]) -> list[np.ndarray]:
        if self.first:
            h = self.model.embed(mx.array(np.stack([np.asarray(s.tokens, np.int32) for s in steps])))
        else:
            h = mx.array(np.stack([np.asarray(s.hidden, np.float32) for s in steps]))
        h = self.model(h, lanes)
        every_row = any(s.all_logits for s in steps)
        out = h if not self.final else self.model.logits(h if every_row else h[:, -1:, :])
        mx.eval(out, *[a for caches in lanes for cache in caches for a in cache.state])
        rows = np.array(out.astype(mx.float32), copy=True)
        # the final stage returns the last row's logits unless the step asked for every row's
        return [rows[b] if not self.final or s.all_logits or not every_row else rows[b, -1:]
                for b, s in enumerate(steps)]

    def _check_lane(self, lane: int) -> int:
        if not 0 <= lane < self.lanes:
            raise EngineError(f"lane {lane} outside [0,{self.lanes})")
        return lane

    def close(self) -> None:
        """Called on the thread that ran the steps (stage.batcher.close_engine)."""
        self.caches = []
        if threading.current_thread() is not threading.main_thread():
            release_streams()  # the main thread's are torn down at exit without harm
        if self.cpu_lock:
            self.cpu_lock.close()
            self.cpu_lock = None


def _load(gguf: Path, cfg: EngineConfig) -> RangeModel:
    try:
        loaded = mx.load(str(gguf), return_metadata=True)
    except (RuntimeError, ValueError) as exc:
        raise EngineError(f"MLX could not load {gguf}: {exc}") from exc
    if not isinstance(loaded, tuple):
        raise EngineError(f"MLX read {gguf} as a single array, not a GGUF")
    weights, meta = loaded
    try:
        model = builder(str(meta.get("general.architecture", "")))(meta, weights, cfg.first, cfg.final)
    except (KeyError, ValueError) as exc:
        raise EngineError(f"{gguf.name}: {exc.args[0]}") from exc
    # the casts and renames are lazy: compute them now, so a bad file fails at load and
    # not at the first step, and the engine holds its memory from the start
    mx.eval(model.parameters())
    return model


def release_streams() -> None:
    """Finish and destroy the MLX streams of the calling thread. MLX (0.32) gives every thread
    its own streams, each served by a C++ thread, and an array made on one thread cannot be
    computed on another: so an engine is built, stepped and closed on the engine thread
    (`stage.batcher.on_engine_thread`). Left to that thread's exit at process exit, the
    streams' teardown aborted the process ("terminate called without an active exception")
    in 4 of 10 runs of a test that stepped an engine there."""
    mx.synchronize()
    mx.clear_streams()


def passes(steps: list[Step]) -> list[list[int]]:
    """Indexes of the steps that run as one forward pass: the same number of rows, one step
    per lane (a lane's rows follow its own earlier ones)."""
    groups: list[list[int]] = []
    for i, s in enumerate(steps):
        group = next((g for g in groups if steps[g[0]].n == s.n and all(steps[j].lane != s.lane for j in g)), None)
        if group is None:
            groups.append([i])
        else:
            group.append(i)
    return groups
