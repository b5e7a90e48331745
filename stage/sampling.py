"""Token sampling at the final stage, keyed by absolute position.

The random draw for position p depends only on (seed, p), never on how the tokens were
batched. So a speculative window and plain decoding sample the same token at the same
position from the same logits: speculation is lossless even at temperature > 0.

Before the draw each row's logits get the request's logit_bias, then the OpenAI presence
and frequency penalties over the completion generated before that row. A frame carries
that completion as `committed` (everything before its first logits row, the token fed at
that row included) and `drafts` (the tokens fed at the later rows): row i counts
committed + drafts[:i], exactly what plain decoding would have counted at that position.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from common.sampling import Sampled, SamplingParams
from stage.masks import apply_masks


def sample_rows(logits: np.ndarray, params: SamplingParams, start: int, rows: int,
                committed: Sequence[int] = (), drafts: Sequence[int] = (),
                masks: Sequence[bytes] = ()) -> list[Sampled]:
    """The tokens for the last len(logits) of `rows` input rows fed at `start`; a grammar's
    `masks` (one per logits row, or none) apply after bias and penalties.

    Input row i sits at position start + i, so its logits pick the token at start + i + 1.
    """
    first = start + rows - len(logits) + 1
    processed = _processed(logits, params, committed, drafts)
    if masks:
        processed = apply_masks(processed, masks)
    tokens = [_draw(row, params, first + i) for i, row in enumerate(processed)]
    if params.logprobs < 0:
        return [Sampled(t) for t in tokens]
    logprobs = _log_softmax(processed)
    return [Sampled(t, float(lp[t]), _top(lp, params.logprobs)) for t, lp in zip(tokens, logprobs, strict=True)]


def _processed(logits: np.ndarray, params: SamplingParams, committed: Sequence[int],
               drafts: Sequence[int]) -> np.ndarray:
    """Logits after bias and penalties; the raw rows (no copy) when neither is asked."""
    if not params.logit_bias and not params.penalised:
        return logits
    out = logits.astype(np.float64)
    if params.logit_bias:
        ids, bias = zip(*params.logit_bias, strict=True)
        np.add.at(out.T, np.asarray(ids), np.asarray(bias)[:, None])  # column by column: repeated ids add up
    if params.penalised and (committed or drafts):
        _penalise(out, params, committed, drafts)
    return out


def _penalise(out: np.ndarray, params: SamplingParams, committed: Sequence[int], drafts: Sequence[int]) -> None:
    """Subtract the penalties in place; row i counts committed + drafts[:i]."""
    ids, inverse = np.unique(np.asarray([*committed, *drafts], dtype=np.int64), return_inverse=True)
    # only the tokens seen get a column: the cost follows the history, not the vocabulary
    steps = np.zeros((len(out), len(ids)))
    steps[0] = np.bincount(inverse[: len(committed)], minlength=len(ids))
    late = inverse[len(committed):][: len(out) - 1]
    steps[np.arange(1, len(late) + 1), late] = 1
    counts = np.cumsum(steps, axis=0)
    out[:, ids] -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)


def _draw(row: np.ndarray, params: SamplingParams, position: int) -> int:
    if params.greedy:
        return int(np.argmax(row))
    scaled = row.astype(np.float64) / params.temperature
    order = np.argsort(-scaled, kind="stable")
    if 0 < params.top_k < len(order):
        order = order[: params.top_k]
    probs = np.exp(scaled[order] - scaled[order[0]])
    probs /= probs.sum()
    if params.top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(probs), params.top_p)) + 1
        order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
    # all 64 bits of the seed count, and nothing but the position varies the draw
    rng = np.random.default_rng([params.seed & 0xFFFFFFFF, params.seed >> 32, position])
    return int(order[rng.choice(len(order), p=probs)])


def _log_softmax(rows: np.ndarray) -> np.ndarray:
    x = rows.astype(np.float64)
    peak = x.max(axis=1, keepdims=True)
    return x - (peak + np.log(np.exp(x - peak).sum(axis=1, keepdims=True)))


def _top(logprobs: np.ndarray, n: int) -> tuple[tuple[int, float], ...]:
    if n == 0:
        return ()
    best = np.argpartition(-logprobs, n - 1)[:n] if n < len(logprobs) else np.arange(len(logprobs))
    best = best[np.lexsort((best, -logprobs[best]))]  # best first; ties by token id, as argmax
    best = best[np.isfinite(logprobs[best])]  # a token a grammar masks out is no alternative
    return tuple((int(t), float(logprobs[t])) for t in best)
