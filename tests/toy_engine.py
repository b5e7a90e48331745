"""A model-free range engine and a polling helper, for stage and pipeline tests."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import numpy as np

from stage.engine import Step


class ToyEngine:
    """No model: a token enters as the hidden row [token, 0, 0, 0], and the final stage's
    logits pick the token after it, so every row predicts its input + 1."""

    width, n_vocab, lanes, ctx_per_lane, graph_rows = 4, 32, 2, 64, 48

    def __init__(self, first: bool, final: bool) -> None:
        self.first, self.final = first, final
        self.positions = [0] * self.lanes

    def step(self, steps: list[Step]) -> list[np.ndarray]:
        return [self._one(s) for s in steps]

    def _one(self, step: Step) -> np.ndarray:
        self.positions[step.lane] = step.start + step.n  # the start is authoritative: KV past it goes
        if step.tokens is not None:
            hidden = np.zeros((step.n, self.width), np.float32)
            hidden[:, 0] = step.tokens
        else:
            assert step.hidden is not None
            hidden = step.hidden
        if not self.final:
            return hidden
        rows = hidden if step.all_logits else hidden[-1:]
        logits = np.zeros((len(rows), self.n_vocab), np.float32)
        logits[np.arange(len(rows)), (rows[:, 0].astype(int) + 1) % self.n_vocab] = 10.0
        return logits

    def trim(self, lane: int, position: int) -> None:
        self.positions[lane] = min(self.positions[lane], position)

    def position(self, lane: int) -> int:
        return self.positions[lane]

    def close(self) -> None:
        pass


async def until(condition: Callable[[], bool], seconds: float = 2.0) -> None:
    for _ in range(int(seconds / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")
