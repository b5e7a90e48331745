"""Token sampling at the final stage, keyed by absolute position.

The random draw for position p depends only on (seed, p), never on how the tokens were
batched. So a speculative window and plain decoding sample the same token at the same
position from the same logits: speculation is lossless even at temperature > 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no limit
    seed: int = 0  # any uint64
    presence_penalty: float = 0.0  # OpenAI semantics, over the tokens generated so far
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, bias) added to the logits
    logprobs: int = -1  # -1: none; n >= 0: the sampled token's logprob and the top n

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1


def sample(logits: np.ndarray, params: SamplingParams, position: int) -> int:
    """Pick the token for `position` from one row of logits."""
    if params.greedy:
        return int(np.argmax(logits))
    scaled = logits.astype(np.float64) / params.temperature
    order = np.argsort(-scaled, kind="stable")
    if params.top_k > 0:
        order = order[: params.top_k]
    probs = np.exp(scaled[order] - scaled[order[0]])
    probs /= probs.sum()
    if params.top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(probs), params.top_p)) + 1
        order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
    rng = np.random.default_rng([params.seed & 0xFFFFFFFF, position])
    return int(order[rng.choice(len(order), p=probs)])


def sample_tail(logits: np.ndarray, params: SamplingParams, start: int, rows: int) -> list[int]:
    """Tokens for the last len(logits) of `rows` input rows fed at `start`.

    Input row i sits at position start + i, so its logits pick the token at start + i + 1.
    """
    first = start + rows - len(logits) + 1
    return [sample(row, params, first + i) for i, row in enumerate(logits)]
