"""top-k and top-p truncation in the sampler (tests/test_sampling.py covers bias, penalties, seeds)."""

from __future__ import annotations

import numpy as np
import pytest

from common.sampling import SamplingParams
from stage.sampling import sample_rows


def _draws(logits: np.ndarray, params: SamplingParams, n: int = 300) -> list[int]:
    return [sample_rows(logits, params, p, 1)[0].token for p in range(n)]


def test_top_k_keeps_only_the_k_most_likely_tokens():
    logits = np.array([[0.0, 3.0, 1.0, 2.5, -1.0, 2.9]], dtype=np.float32)
    for k, allowed in [(2, {1, 5}), (3, {1, 5, 3})]:
        got = set(_draws(logits, SamplingParams(temperature=5.0, top_k=k, seed=1)))
        assert got == allowed


def test_top_k_one_is_greedy_at_any_temperature():
    logits = np.random.default_rng(0).standard_normal((1, 40)).astype(np.float32)
    assert SamplingParams(temperature=2.0, top_k=1).greedy
    assert set(_draws(logits, SamplingParams(temperature=2.0, top_k=1, seed=4), 50)) == {int(np.argmax(logits))}


def test_top_k_ties_keep_the_lower_token_id():
    logits = np.array([[1.0, 5.0, 5.0, 5.0, 0.0]], dtype=np.float32)
    assert set(_draws(logits, SamplingParams(temperature=1.0, top_k=2, seed=2))) == {1, 2}


def _probs(*p: float) -> np.ndarray:
    return np.log(np.array([p], dtype=np.float64)).astype(np.float32)


def test_top_p_keeps_the_smallest_prefix_that_reaches_p():
    logits = _probs(0.5, 0.3, 0.15, 0.05)
    assert set(_draws(logits, SamplingParams(temperature=1.0, top_p=0.45, seed=3))) == {0}
    assert set(_draws(logits, SamplingParams(temperature=1.0, top_p=0.6, seed=3))) == {0, 1}
    assert set(_draws(logits, SamplingParams(temperature=1.0, top_p=0.85, seed=3))) == {0, 1, 2}
    assert set(_draws(logits, SamplingParams(temperature=1.0, top_p=0.9, seed=3))) == {0, 1, 2}
    assert set(_draws(logits, SamplingParams(temperature=1.0, top_p=1.0, seed=3), 2000)) == {0, 1, 2, 3}


def test_a_tiny_top_p_still_keeps_the_best_token():
    logits = _probs(0.1, 0.6, 0.3)
    assert set(_draws(logits, SamplingParams(temperature=1.0, top_p=1e-9, seed=5), 50)) == {1}


def test_top_p_applies_after_top_k_and_temperature():
    logits = _probs(0.4, 0.3, 0.2, 0.1)
    # top_k=3 renormalises to 4/9, 3/9, 2/9: top_p=0.7 then needs the first two (7/9)
    assert set(_draws(logits, SamplingParams(temperature=1.0, top_k=3, top_p=0.7, seed=6))) == {0, 1}
    # a low temperature sharpens the distribution so token 0 alone passes top_p
    assert set(_draws(logits, SamplingParams(temperature=0.1, top_p=0.9, seed=6), 100)) == {0}


def test_kept_tokens_are_drawn_in_proportion():
    logits = _probs(0.5, 0.3, 0.15, 0.05)
    draws = _draws(logits, SamplingParams(temperature=1.0, top_p=0.6, seed=8), 4000)
    share = draws.count(0) / len(draws)
    assert share == pytest.approx(0.5 / 0.8, abs=0.04)
