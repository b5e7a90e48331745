"""Run layers [start, end) of a stage GGUF on unmodified llama.cpp (DESIGN.md §3)."""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp.llama_cpp_ext as ext
import numpy as np
from llama_cpp import llama_cpp as L

from common.errors import EngineError
from common.sampling import Proposed
from packages.architectures import hidden_input_scale, tap_name
from stage.cpu_lock import CpuLock
from stage.engine import EngineConfig, Step, check_step  # EngineConfig re-exported for callers
from stage.llama_model import INVARIANT_ROWS, KV_TYPES, architecture, flash_attn_type, kv_cache_for, load_model
from stage.mtp_head import Choose, open_head
from stage.native_tap import open_tap
from stage.recurrent_lanes import RecurrentLanes

_silence = L.llama_log_callback(lambda level, text, user: None)
_backend_ready = False


def _init_backend(quiet: bool) -> None:
    global _backend_ready
    if not _backend_ready:
        if quiet:
            L.llama_log_set(_silence, None)
        L.llama_backend_init()
        _backend_ready = True


def _pos_per_embd(model: Any) -> int:
    """llama_hparams::n_pos_per_embd: 4 for M-RoPE (and interleaved M-RoPE), else 1."""
    return 4 if L.llama_model_rope_type(model) in (L.LLAMA_ROPE_TYPE_MROPE, L.LLAMA_ROPE_TYPE_IMROPE) else 1


class LlamaRangeEngine:
    def __init__(self, gguf: Path, cfg: EngineConfig, quiet: bool = True,
                 observe: Any = None) -> None:
        """`observe`, a ggml eval callback, sees every node of a final stage's graph (diagnostics)."""
        _init_backend(quiet)
        self.first, self.final = cfg.first, cfg.final
        self.lanes, self.ctx_per_lane, self.cfg = cfg.lanes, cfg.ctx_per_lane, cfg
        self.model = load_model(gguf, mtp=cfg.final and cfg.mtp)
        if not self.model:
            raise EngineError(f"llama.cpp could not load {gguf}")
        self.width = L.llama_model_n_embd(self.model)
        self.n_layer = L.llama_model_n_layer(self.model)
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        self.graph_rows = min(cfg.batch, INVARIANT_ROWS)
        self.kv_cache = cfg.kv_cache or kv_cache_for(gguf)  # stage.llama_model: the type that keeps rows exact
        # 1.0 except where the graph scales hidden-state input as it scales token input (gemma2)
        self.input_scale = 1.0 if cfg.first else hidden_input_scale(architecture(self.model), self.width)
        self.tap = None if cfg.final else open_tap(tap_name(architecture(self.model), self.n_layer - 1),
                                                           self.width, cfg.batch)
        self.ctx = _new_context(self.model, context_params(cfg, self.graph_rows, self.kv_cache),
                                self.tap.callback if self.tap else observe, self.tap.user if self.tap else None)
        self.mem = L.llama_get_memory(self.ctx)
        self.mtp = open_head(self.model, self.ctx, context_params(cfg, self.graph_rows, self.kv_cache), self.n_vocab) \
            if cfg.final and cfg.mtp else None
        # An M-RoPE model reads 4 positions a row of embedding input, section-major (llama_batch
        # to llama_batch_ext in llama-batch.cpp); its token input is widened by llama.cpp itself.
        self.pos_sections = 1 if cfg.first else _pos_per_embd(self.model)
        self.batch = L.llama_batch_init(cfg.batch * self.pos_sections, 0 if cfg.first else self.width, cfg.lanes)
        self._pos = [0] * cfg.lanes
        # a lane's recurrent state rolls back by checkpoint, where attention KV is trimmed
        recurrent = L.llama_model_is_recurrent(self.model) or L.llama_model_is_hybrid(self.model)
        self.recurrent = RecurrentLanes(self.ctx, self.mem, cfg.lanes, cfg.checkpoints, cfg.checkpoint_every_row) \
            if recurrent else None
        self.cpu_lock = CpuLock(cfg.cpu_lock) if cfg.cpu_lock else None

    def position(self, lane: int) -> int:
        return self._pos[self._check_lane(lane)]

    def trim(self, lane: int, position: int) -> None:
        """Drop the lane's KV from `position` on (an END, a lane given back): the MTP layer's too,
        and the drafts it chained there."""
        self._roll_back(lane, position)
        if self.mtp is not None:
            self.mtp.trim(lane, max(position, 0))

    def _roll_back(self, lane: int, position: int) -> None:
        """The target's KV from `position` on, as a step's start drops it (the MTP layer's feed
        trims its own)."""
        self._check_lane(lane)
        position = max(position, 0)
        if self.recurrent is not None:
            self._pos[lane] = self.recurrent.rollback(lane, position)
        elif position < self._pos[lane]:
            L.llama_memory_seq_rm(self.mem, lane, position, -1)
            self._pos[lane] = position

    def reachable(self, lane: int, position: int) -> bool:
        """Whether the lane can roll back to `position`: always, unless recurrent state has
        no checkpoint at or before it (stage.checkpoints)."""
        return self.recurrent is None or self.recurrent.reachable(self._check_lane(lane), position)

    def step(self, steps: list[Step]) -> list[np.ndarray]:
        """One decode per row count: a verify window of k drafts is one pass of k+1 rows."""
        outputs: list[list[np.ndarray]] = [[] for _ in steps]
        nextn: list[list[np.ndarray]] | None = [[] for _ in steps] if self.mtp is not None else None
        try:
            for s in steps:
                check_step(self, s, self._pos[self._check_lane(s.lane)])
                self._roll_back(s.lane, s.start)
            if self.recurrent is not None:
                self._replay(steps, self.recurrent)
                self.recurrent.checkpoint(steps)
            for call in _pack(steps, self.cfg.batch):
                self._decode(steps, call, outputs, nextn)
            if nextn is not None:
                assert self.mtp is not None
                with self.cpu_lock.held() if self.cpu_lock else contextlib.nullcontext():
                    self.mtp.feed_steps(steps, nextn, self.first)
        except BaseException:
            self._settle(steps, ok=False)
            raise
        self._settle(steps, ok=True)
        return [o[0] if len(o) == 1 else np.concatenate(o) for o in outputs]

    def export_lane(self, lane: int) -> bytes:
        """The lane's whole sequence state (attention KV, and recurrent state where the range
        has it) as llama.cpp serialises it: what the KV tier keeps (stage/kv_tier.py)."""
        self._check_lane(lane)
        size = L.llama_state_seq_get_size_ext(self.ctx, lane, 0)
        buf = (ctypes.c_uint8 * size)()
        if L.llama_state_seq_get_data_ext(self.ctx, buf, size, lane, 0) != size:
            raise EngineError(f"lane {lane}: llama.cpp could not save its state")
        return bytes(buf)

    def import_lane(self, lane: int, data: bytes, positions: int) -> None:
        """Load a state `export_lane` gave into `lane`, which then holds `positions` positions.
        The MTP layer's KV is not part of it: it starts over there (drafts, never output)."""
        self.trim(self._check_lane(lane), 0)
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        if L.llama_state_seq_set_data_ext(self.ctx, buf, len(data), lane, 0) != len(data):
            L.llama_memory_seq_rm(self.mem, lane, -1, -1)
            raise EngineError(f"lane {lane}: llama.cpp could not load a saved state")
        self._pos[lane] = positions
        if self.recurrent is not None:
            self.recurrent.loaded(lane, positions)

    def mtp_draft(self, lane: int, position: int, token: int, k: int, choose: Choose) -> list[Proposed]:
        """Up to `k` drafts from the MTP layer after `token` at `position` (none without one)."""
        if self.mtp is None:
            return []
        with self.cpu_lock.held() if self.cpu_lock else contextlib.nullcontext():
            return self.mtp.draft(self._check_lane(lane), position, token, k, choose)

    def _replay(self, steps: list[Step], recurrent: RecurrentLanes) -> None:
        """Decode the rows a restore left pending on the steps' lanes, their outputs dropped,
        just before the steps: each graph at most graph_rows, computed as the rows first were."""
        replays = recurrent.replays(steps, self.first)
        for r in replays:
            self._pos[r.lane] = r.start
        for call in _pack(replays, self.graph_rows):
            self._decode(replays, call, [[] for _ in replays])
        recurrent.replayed(replays)

    def _settle(self, steps: list[Step], ok: bool) -> None:
        if self.recurrent is not None:
            self.recurrent.settle(steps, ok)
            for s in steps:
                if 0 <= s.lane < self.lanes:
                    self._pos[s.lane] = self.recurrent.position(s.lane)

    def _decode(self, steps: Sequence[Step], call: list[_Segment], outputs: list[list[np.ndarray]],
                nextn: list[list[np.ndarray]] | None = None) -> None:
        b = self.batch
        row = 0
        logit_rows: list[tuple[int, int, int]] = []  # (step index, first output, outputs)
        n_out = 0  # llama.cpp keeps the outputs' logits in batch order, one after another
        for seg in call:
            s = steps[seg.step]
            for i in range(seg.count):
                r = row + i
                if self.first:
                    b.token[r] = int(s.tokens[seg.offset + i])  # type: ignore[index]
                b.pos[r] = s.start + seg.offset + i
                b.n_seq_id[r] = 1
                b.seq_id[r][0] = s.lane
                last = seg.offset + i == s.n - 1
                b.logits[r] = (not self.final) or s.all_logits or last
            if not self.first:
                embd = np.ctypeslib.as_array(b.embd, shape=(self.cfg.batch * self.width,))
                block = s.hidden[seg.offset : seg.offset + seg.count]  # type: ignore[index]
                if self.input_scale != 1.0:
                    block = block * np.float32(self.input_scale)
                embd[row * self.width : (row + seg.count) * self.width] = block.reshape(-1)
            if self.final and (s.all_logits or seg.offset + seg.count == s.n):
                count = seg.count if s.all_logits else 1
                logit_rows.append((seg.step, n_out, count))
                n_out += count
            row += seg.count
        b.n_tokens = row
        if self.pos_sections > 1:
            pos = np.ctypeslib.as_array(b.pos, shape=(self.pos_sections * self.cfg.batch,))
            # text positions: the same in the time, height and width sections, 0 in the 4th
            pos[row : 3 * row] = np.tile(pos[:row], 2)
            pos[3 * row : 4 * row] = 0
        if self.tap is not None:  # a decode that failed after some ubatches left their rows there
            self.tap.clear()
        with self.cpu_lock.held() if self.cpu_lock else contextlib.nullcontext():
            rc = L.llama_decode(self.ctx, b)
        if rc != 0:
            raise EngineError(f"llama_decode failed with code {rc}")
        for seg in call:
            self._pos[steps[seg.step].lane] += seg.count
        self._collect(call, logit_rows, n_out, outputs)
        if nextn is not None:  # the rows an MTP layer pairs with the next positions' tokens
            kept = np.ctypeslib.as_array(ext.llama_get_embeddings_nextn(self.ctx), shape=(row, self.width)).copy()
            for seg, at in zip(call, np.cumsum([0, *(seg.count for seg in call)]), strict=False):
                nextn[seg.step].append(kept[at : at + seg.count])

    def _collect(self, call: list[_Segment], logit_rows: list[tuple[int, int, int]], n_out: int,
                 outputs: list[list[np.ndarray]]) -> None:
        if self.tap is not None:
            hidden = self.tap.take()
            row = 0
            for seg in call:
                outputs[seg.step].append(hidden[row : row + seg.count])
                row += seg.count
            return
        if not n_out:
            return
        # One copy of every output row: llama.cpp reuses its buffer at the next decode, which
        # may run while the event loop samples these.
        logits = np.ctypeslib.as_array(L.llama_get_logits(self.ctx), shape=(n_out, self.n_vocab)).copy()
        for step_index, first, count in logit_rows:
            outputs[step_index].append(logits[first : first + count])

    def _check_lane(self, lane: int) -> int:
        if not 0 <= lane < self.lanes:
            raise EngineError(f"lane {lane} outside [0,{self.lanes})")
        return lane

    def close(self) -> None:
        if self.mtp is not None:
            self.mtp.close()
        if self.ctx:
            L.llama_batch_free(self.batch)
            L.llama_free(self.ctx)
            L.llama_model_free(self.model)
            self.ctx = None  # type: ignore[assignment]
            if self.cpu_lock:
                self.cpu_lock.close()


def set_threads(engine: LlamaRangeEngine, threads: int) -> None:
    """Run the engine's later decodes on `threads` threads (the numerics bench times one engine at several)."""
    L.llama_set_n_threads(engine.ctx, threads, threads)


def _new_context(model: Any, p: L.llama_context_params, eval_callback: Any, user: ctypes.c_void_p | None
                 ) -> ctypes.c_void_p:
    if eval_callback is not None:
        p.cb_eval = eval_callback
    if user is not None:
        p.cb_eval_user_data = user
    ctx = L.llama_init_from_model(model, p)
    if not ctx:
        raise EngineError("llama.cpp could not create a context")
    return ctx


def context_params(cfg: EngineConfig, graph_rows: int, kv_cache: tuple[str, str]) -> L.llama_context_params:
    """A context for `cfg`'s range (the MTP context copies it but for its type)."""
    p = L.llama_context_default_params()
    p.n_ctx = cfg.ctx_per_lane * cfg.lanes
    p.n_batch, p.n_ubatch = cfg.batch, graph_rows  # stage.llama_model says why
    p.n_seq_max = cfg.lanes
    # A KV stream per lane: a session's attention then reads the same contiguous cells
    # whatever else is batched with it, so batched output equals solo output bit for bit.
    p.kv_unified = False
    # The same attention kernels as every other model in the project (stage.llama_model):
    # a verify window is then computed as plain decoding computes its rows.
    p.flash_attn_type = flash_attn_type() if cfg.flash_attn is None else int(cfg.flash_attn)
    # and a cache type whose attention gives every row one kernel at any thread count
    p.type_k, p.type_v = (KV_TYPES[t] for t in kv_cache)
    p.n_threads = p.n_threads_batch = cfg.threads
    return p


@dataclass(frozen=True)
class _Segment:
    step: int
    offset: int
    count: int


def _pack(steps: Sequence[Step], capacity: int) -> list[list[_Segment]]:
    """Plan decode calls of at most `capacity` rows.

    Each call holds steps of one row count only: with a KV stream per lane, llama.cpp splits
    a batch into equal-length ubatches, and equal-length steps keep it to one ubatch. Longer
    steps are chunked.
    """
    calls: list[list[_Segment]] = []
    by_rows: dict[int, list[int]] = {}
    # Sorted by lane too: the ubatch lists sequences in seq_id order, and the tap's rows
    # must line up with the batch's.
    for index in sorted(range(len(steps)), key=lambda i: steps[i].lane):
        by_rows.setdefault(steps[index].n, []).append(index)
    for rows, indices in by_rows.items():
        if rows > capacity:
            for index in indices:
                calls += [[_Segment(index, off, min(capacity, rows - off))]
                          for off in range(0, rows, capacity)]
            continue
        per_call = capacity // rows
        for i in range(0, len(indices), per_call):
            calls.append([_Segment(index, 0, rows) for index in indices[i : i + per_call]])
    return calls
