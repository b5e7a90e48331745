"""The small interface every layer-range engine implements (llama.cpp now, MLX later).

An engine runs layers [start, end) of one model for many sessions. Each session owns a
lane (a llama.cpp seq_id) with its own KV. Stage 0 feeds token ids; later stages feed
hidden states. The final stage returns logits, the others return hidden states.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


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
