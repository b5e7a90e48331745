"""The sampler finds the tokens a draw needs without sorting the vocabulary, and draws exactly
what sorting it would have drawn (stage/best_first.py, stage/sampling.py)."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from common.sampling import SamplingParams
from stage import best_first
from stage.sampling import sample_rows

RNG = np.random.default_rng(11)


def _rows(n: int) -> list[np.ndarray]:
    """Plain, full of ties, signed zeros, and infinities."""
    ties = np.round(RNG.standard_normal(n) * 2, 1)
    zeros = np.zeros(n)
    zeros[::3], zeros[1::5] = -0.0, 1.0
    inf = RNG.standard_normal(n)
    inf[n // 2], inf[: n // 4] = np.inf, -np.inf
    return [RNG.standard_normal(n) * 3, ties, zeros, inf]


@pytest.mark.parametrize("n", [1, 7, 400, 5000])
def test_the_best_tokens_come_in_the_order_of_a_stable_sort(n: int):
    for row in _rows(n):
        order = np.argsort(-row, kind="stable")
        ordered = best_first.values(row)
        assert np.array_equal(ordered, row[order])
        for k in {1, 2, 3, n // 10 + 1, n // 2 + 1, n}:
            assert np.array_equal(best_first.best(row, k), order[:k])
        assert [best_first.nth(row, ordered, i) for i in range(0, n, max(n // 50, 1))] == \
               list(order[:: max(n // 50, 1)])


def _sorted_draw(row: np.ndarray, params: SamplingParams, position: int) -> int:
    """The draw as the sampler defines it: the whole row sorted, then top-k, then top-p."""
    scaled = row.astype(np.float64) / params.temperature
    order = np.argsort(-scaled, kind="stable")
    if 0 < params.top_k < len(order):
        order = order[: params.top_k]
    probs = np.exp(scaled[order] - scaled[order[0]])
    probs /= probs.sum()
    if params.top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(probs), params.top_p)) + 1
        order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
    rng = np.random.default_rng([params.seed & 0xFFFFFFFF, params.seed >> 32, position])
    return int(order[rng.choice(len(order), p=probs)])


def _sampled(row: np.ndarray, params: SamplingParams, position: int) -> int:
    """The sampler's token for `position` (a row fed at position - 1)."""
    return sample_rows(row[None, :], params, position - 1, 1)[0].token


def _outcome(draw: Callable[[], int]) -> int | str:
    try:
        return draw()
    except ValueError:  # infinities make NaN probabilities: both must refuse
        return "refused"


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_a_draw_equals_the_draw_from_the_sorted_vocabulary():
    n = 2000
    rows = [r.astype(np.float32) for r in _rows(n)]
    rows.append(rows[0].copy())
    rows[-1][5] = np.nan  # the sampler sorts all of a row with NaN
    for row, temperature, top_k, top_p in itertools.product(
            rows, (0.5, 1.0), (0, 3, 40, 499, 1500, n), (1.0, 0.9, 0.3, 1e-9)):
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=int(RNG.integers(1 << 63)))
        for position in range(4):
            want = _outcome(functools.partial(_sorted_draw, row, params, position))
            got = _outcome(functools.partial(_sampled, row, params, position))
            assert got == want, (temperature, top_k, top_p, position)


def test_a_draw_sorts_no_whole_vocabulary(monkeypatch: pytest.MonkeyPatch):
    n = 49152
    logits = RNG.standard_normal((2, n)).astype(np.float32)
    logits[:, RNG.integers(0, n, 30)] += 12.0  # a few likely tokens, as a model's rows have
    sorted_sizes: list[int] = []
    argsort = np.argsort

    def counting(a: np.ndarray, *args: Any, **kwargs: Any) -> np.ndarray:
        sorted_sizes.append(len(a))
        return argsort(a, *args, **kwargs)

    monkeypatch.setattr(np, "argsort", counting)
    for params in (SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=0.7, top_p=0.9, seed=2),
                   SamplingParams(temperature=0.7, top_k=40, top_p=0.95, seed=3)):
        sample_rows(logits, params, 10, 2)
    assert max(sorted_sizes, default=0) < n // 4
