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
from dataclasses import dataclass

import numpy as np

from common.sampling import Sampled, SamplingParams
from stage import best_first
from stage.masks import apply_masks

_NUCLEUS_HEAD = 256  # tokens summed before the whole row, for top-p


def sample_rows(logits: np.ndarray, params: SamplingParams, start: int, rows: int,
                committed: Sequence[int] = (), drafts: Sequence[int] = (),
                masks: Sequence[bytes] = ()) -> list[Sampled]:
    """The tokens for the last len(logits) of `rows` input rows fed at `start`; a grammar's
    `masks` (one per logits row, or none) apply after bias and penalties.

    Input row i sits at position start + i, so its logits pick the token at start + i + 1.
    """
    first = start + rows - len(logits) + 1
    processed = processed_rows(logits, params, committed, drafts, masks)
    tokens = [_draw(row, params, first + i) for i, row in enumerate(processed)]
    return with_logprobs(tokens, processed, params)


def score_rows(logits: np.ndarray, targets: Sequence[int], params: SamplingParams) -> list[Sampled]:
    """Each row's logprob of its given next token (a prompt's own), with the top ones: the rows
    as a draw would read them, so after logit_bias; the penalties count the completion only,
    which has no token yet at a prompt's rows."""
    return with_logprobs(targets, processed_rows(logits, params), params)


def processed_rows(logits: np.ndarray, params: SamplingParams, committed: Sequence[int] = (),
                   drafts: Sequence[int] = (), masks: Sequence[bytes] = ()) -> np.ndarray:
    """The logits a draw reads: bias, then penalties, then a grammar's masks."""
    processed = _processed(logits, params, committed, drafts)
    return apply_masks(processed, masks) if masks else processed


def with_logprobs(tokens: Sequence[int], processed: np.ndarray, params: SamplingParams) -> list[Sampled]:
    """`tokens`, one per processed row, with their logprobs and the top ones when asked."""
    if params.logprobs < 0:
        return [Sampled(t) for t in tokens]
    logprobs = log_softmax(processed)
    return [Sampled(t, float(lp[t]), top_logprobs(lp, params.logprobs)) for t, lp in zip(tokens, logprobs, strict=True)]


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
    """The token at `position`: from the tokens best first (ties to the lower id), the first
    top_k, then the shortest prefix reaching top_p, drawn by the position's own generator."""
    if params.greedy:
        return int(np.argmax(row))
    s = support(row, params)
    # all 64 bits of the seed count, and nothing but the position varies the draw
    rng = np.random.default_rng([params.seed & 0xFFFFFFFF, params.seed >> 32, position])
    pick = int(rng.choice(len(s.probs), p=s.probs))
    if s.order is not None:
        return int(s.order[pick])
    return int(s.whole[pick]) if s.whole is not None else best_first.nth(s.scaled, s.ordered, pick)


@dataclass(frozen=True)
class Support:
    """What a sampled (not greedy) draw picks from: `probs` over the tokens best first (ties
    to the lower id), after top-k and top-p. Those tokens are `order`; None means every token,
    whose order is `whole` (a full sort, when a NaN leaves only it exact) or else found by
    `best_first.nth` from the `scaled` row and its values best first, `ordered`."""

    scaled: np.ndarray
    whole: np.ndarray | None
    order: np.ndarray | None
    ordered: np.ndarray
    probs: np.ndarray


def support(row: np.ndarray, params: SamplingParams) -> Support:
    """The draw's tokens and probabilities for processed logits `row`: one computation for the
    exact draw (`_draw`) and for rejection sampling's p (stage/distribution.py)."""
    scaled = row.astype(np.float64) / params.temperature
    # Sorting the whole vocabulary cost more than a decode row: stage.best_first finds the
    # tokens a draw needs, in the same order, unless a NaN leaves only the sort exact.
    whole = None if best_first.sorted_exactly(scaled) else np.argsort(-scaled, kind="stable")
    n = len(scaled)
    order = _first(scaled, params.top_k, whole) if 0 < params.top_k < n else None  # None: all n
    ordered = scaled[order] if order is not None else _values(scaled, whole)
    probs = np.exp(ordered - ordered[0])
    probs /= probs.sum()
    if params.top_p < 1.0:
        keep = _nucleus(probs, params.top_p)
        probs = probs[:keep] / probs[:keep].sum()
        order = order[:keep] if order is not None else _first(scaled, keep, whole)
    return Support(scaled, whole, order, ordered, probs)


def _nucleus(probs: np.ndarray, top_p: float) -> int:
    """`searchsorted(cumsum(probs), top_p) + 1`: how many of the best tokens top-p keeps.

    A running sum's first values do not depend on the rest, and a model's row usually
    reaches top_p within its first few tokens, so the sum is run over a prefix first.
    """
    head = np.cumsum(probs[:_NUCLEUS_HEAD])
    sums = head if head[-1] >= top_p or len(head) == len(probs) else np.cumsum(probs)
    return int(np.searchsorted(sums, top_p)) + 1


def _first(scaled: np.ndarray, k: int, whole: np.ndarray | None) -> np.ndarray:
    return whole[:k] if whole is not None else best_first.best(scaled, k)


def _values(scaled: np.ndarray, whole: np.ndarray | None) -> np.ndarray:
    return scaled[whole] if whole is not None else best_first.values(scaled)


def log_softmax(rows: np.ndarray) -> np.ndarray:
    x = rows.astype(np.float64)
    peak = x.max(axis=1, keepdims=True)
    return x - (peak + np.log(np.exp(x - peak).sum(axis=1, keepdims=True)))


def top_logprobs(logprobs: np.ndarray, n: int) -> tuple[tuple[int, float], ...]:
    if n == 0:
        return ()
    best = np.argpartition(-logprobs, n - 1)[:n] if n < len(logprobs) else np.arange(len(logprobs))
    best = best[np.lexsort((best, -logprobs[best]))]  # best first; ties by token id, as argmax
    best = best[np.isfinite(logprobs[best])]  # a token a grammar masks out is no alternative
    return tuple((int(t), float(logprobs[t])) for t in best)
