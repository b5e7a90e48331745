"""The small interface every layer-range engine implements (llama.cpp, MLX).

An engine runs layers [start, end) of one model for many sessions. Each session owns a
lane (a llama.cpp seq_id) with its own KV. Stage 0 feeds token ids; later stages feed
hidden states. The final stage returns logits, the others return hidden states.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from common.errors import EngineError
from stage.checkpoints import DEPTH


@dataclass(frozen=True)
class EngineConfig:
    """How to run a range; every engine takes it (`batch`, `flash_attn` and `kv_cache` matter to llama.cpp only)."""

    first: bool  # the range starts at layer 0: inputs are token ids
    final: bool  # the range ends at the last layer: outputs are logits
    lanes: int = 4
    ctx_per_lane: int = 2048
    batch: int = 256  # rows per llama_decode; one ubatch, so tap rows keep batch order
    threads: int = 2
    cpu_lock: Path | None = None  # take turns on the cores with engines in other processes
    flash_attn: bool | None = None  # None: stage.llama_model's choice for every process
    kv_cache: tuple[str, str] | None = None  # llama.cpp's K and V cache types; None: stage.llama_model's
    # Copies of a lane's recurrent state kept to roll back to (stage.checkpoints): a rejection
    # reaches back at most the frames a session keeps in flight.
    checkpoints: int = DEPTH
    checkpoint_every_row: bool = False  # a draft's lanes (stage.checkpoints.DRAFT_DEPTH)
    mtp: bool = False  # a final stage drafts with the model's MTP layers (stage/mtp_head.py)


@dataclass(frozen=True)
class Step:
    """One session's slice of a batched decode.

    `start` is the authoritative position of the first input row: any KV the lane holds at
    or past it is dropped first, which is how speculative rollback reaches every stage.
    """

    lane: int
    start: int
    tokens: np.ndarray | None = None  # int32 [n]          (first stage)
    hidden: np.ndarray | None = None  # float32 [n, width] (later stages)
    all_logits: bool = False  # final stage: logits for every row, not just the last
    fed: np.ndarray | None = None  # int32 [n]: a later stage's rows' tokens, which an MTP layer reads

    @property
    def n(self) -> int:
        data = self.tokens if self.tokens is not None else self.hidden
        assert data is not None
        return len(data)


class RangeEngine(Protocol):
    first: bool  # takes token ids
    final: bool  # produces logits
    width: int  # hidden-state width (n_embd)
    n_vocab: int
    lanes: int
    ctx_per_lane: int
    # The most rows one decode may hold across sessions: more, and llama.cpp splits the batch
    # into per-session slices whose hidden states come back out of batch order, and past
    # INVARIANT_ROWS its kernels change (stage/llama_model.py). One session's step may be
    # longer: llama.cpp splits it in order.
    graph_rows: int

    def step(self, steps: list[Step]) -> list[np.ndarray]:
        """Run one batched forward pass; per step: hidden [n, width] or logits [rows, vocab]."""
        ...

    def trim(self, lane: int, position: int) -> None:
        """Drop the lane's KV from `position` on."""
        ...

    def position(self, lane: int) -> int:
        """How many positions the lane's KV holds."""
        ...

    def close(self) -> None: ...


def check_step(engine: RangeEngine, s: Step, held: int) -> None:
    """What every engine checks before running a step on a lane that holds `held` positions
    (the lane itself checked already); raises EngineError, with the same messages everywhere."""
    if s.start > held:
        raise EngineError(f"lane {s.lane} holds {held} positions; frame starts at {s.start}")
    if s.n == 0 or s.start + s.n > engine.ctx_per_lane:
        raise EngineError(f"lane {s.lane}: {s.n} rows at {s.start} exceed context {engine.ctx_per_lane}")
    if engine.first:
        if s.tokens is None or s.tokens.min() < 0 or s.tokens.max() >= engine.n_vocab:
            raise EngineError("first stage needs token ids within the vocabulary")
    elif s.hidden is None or s.hidden.shape[1:] != (engine.width,):
        raise EngineError(f"stage needs hidden states of width {engine.width}")
