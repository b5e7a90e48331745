"""A row's sampling distribution over the whole vocabulary, as `stage.sampling` draws from it.

Rejection sampling (stage/rejection.py, DESIGN.md §6) needs p(x) for a draft token x and the
residual max(p - q, 0) on a rejection, so the target's distribution is materialised here: the
same temperature, top-k (ties to the lower id) and top-p as the sampler's draw, over logits
already processed (bias, penalties, a grammar's mask). The draft proposes from its own row
made the same way, truncated to its `top` tokens so that q travels exactly in a few pairs.
"""

from __future__ import annotations

import numpy as np

from common.sampling import SamplingParams
from stage import best_first
from stage.sampling import support

TOP = 64  # pairs of q a drafted row carries: about 400 bytes on the wire (DESIGN.md §6 has the sweep)


def probabilities(row: np.ndarray, params: SamplingParams) -> np.ndarray:
    """p over the vocabulary (float64, summing to 1) for processed logits `row`."""
    dense = np.zeros(len(row))
    if params.greedy:
        dense[int(np.argmax(row))] = 1.0
        return dense
    if not 0 < params.top_k < len(row) and params.top_p >= 1.0:  # every token: no order needed
        scaled = row.astype(np.float64) / params.temperature
        weights = np.exp(scaled - scaled.max())
        return weights / weights.sum()
    s = support(row, params)
    assert s.order is not None, "top-k or top-p names the tokens"
    dense[s.order] = s.probs
    return dense


def truncated(dist: np.ndarray, top: int = TOP) -> tuple[np.ndarray, np.ndarray]:
    """The `top` likeliest tokens of `dist` with their probabilities renormalised: the
    distribution a draft samples from, which is then exactly what the frame says q is."""
    k = min(top, int(np.count_nonzero(dist)))
    ids = best_first.best(dist, k)
    probs = dist[ids]
    return ids.astype(np.int64), probs / probs.sum()
