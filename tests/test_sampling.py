"""The final stage's sampler: logit_bias, penalties, logprobs and seeds, row by row."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from common.sampling import MAX_LOGPROBS, SamplingParams
from stage.sampling import sample_rows

RNG = np.random.default_rng(7)


def _logits(rows: int = 1, vocab: int = 50) -> np.ndarray:
    return RNG.standard_normal((rows, vocab)).astype(np.float32)


def test_bias_forces_and_forbids_a_token():
    logits = _logits(vocab=50)
    best = int(np.argmax(logits[0]))
    forced = SamplingParams(logit_bias=((7, 100.0),))
    assert sample_rows(logits, forced, 0, 1)[0].token == 7
    forbidden = SamplingParams(temperature=1.0, logit_bias=((best, -100.0),))
    assert all(sample_rows(logits, replace(forbidden, seed=s), 0, 1)[0].token != best
               for s in range(200))
    hot = SamplingParams(temperature=1.0, logit_bias=((3, 100.0),))
    assert {sample_rows(logits, hot, p, 1)[0].token for p in range(50)} == {3}


def test_penalties_subtract_as_the_openai_formula_says_row_by_row():
    logits = np.zeros((2, 8), dtype=np.float32)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, logprobs=8)
    rows = sample_rows(logits, params, 10, 2, committed=[1, 1, 2], drafts=[3])
    # row 0 counts the committed completion; row 1 also the draft fed at it
    for row, counts in zip(rows, [{1: 2, 2: 1}, {1: 2, 2: 1, 3: 1}], strict=True):
        lp = dict(row.top)
        for t in range(8):
            c = counts.get(t, 0)
            assert lp[t] - lp[0] == pytest.approx(-(0.25 * c + 0.5 * (c > 0)))


def test_a_window_samples_what_single_rows_do():
    """Speculation is lossless only if row i of a window equals a plain step with drafts[:i]."""
    logits = _logits(rows=4)
    params = SamplingParams(temperature=1.0, seed=3, presence_penalty=0.4, frequency_penalty=0.9,
                            logit_bias=((4, 1.5), (4, 0.5), (8, -3.0)), logprobs=3)
    committed, drafts = [4, 5, 5], [8, 4, 9]
    window = sample_rows(logits, params, 20, 4, committed, drafts)
    single = [sample_rows(logits[i : i + 1], params, 20 + i, 1, committed + drafts[:i])[0] for i in range(4)]
    assert window == single


def test_logprobs_are_normalised_sorted_and_the_greedy_choice_is_first():
    logits = _logits(rows=3, vocab=MAX_LOGPROBS)
    for row in sample_rows(logits, SamplingParams(logprobs=MAX_LOGPROBS), 0, 3):
        values = [lp for _, lp in row.top]
        assert sum(np.exp(values)) == pytest.approx(1.0)
        assert values == sorted(values, reverse=True)
        assert row.top[0] == (row.token, row.logprob)
    sampled = sample_rows(logits, SamplingParams(temperature=1.0, logprobs=0), 0, 3)
    assert all(r.top == () and r.logprob is not None and r.logprob < 0 for r in sampled)
    assert all(r.logprob is None for r in sample_rows(logits, SamplingParams(), 0, 3))


def test_logprobs_are_taken_before_temperature():
    logits = _logits()
    cold, hot = (sample_rows(logits, SamplingParams(temperature=t, logprobs=2), 0, 1)[0] for t in (0.0, 5.0))
    assert cold.top == hot.top


def test_all_64_seed_bits_count_and_the_largest_seed_works():
    logits = np.zeros((1, 1000), dtype=np.float32)

    def draws(seed: int) -> list[int]:
        return [sample_rows(logits, SamplingParams(temperature=1.0, seed=seed), p, 1)[0].token for p in range(20)]

    assert draws(5) != draws(5 + (1 << 32))
    assert draws(2**64 - 1) == draws(2**64 - 1)
    assert SamplingParams(seed=2**64 - 1).problem(1000) is None
    assert SamplingParams(seed=2**64).problem(1000) is not None
    assert SamplingParams(seed=-1).problem(1000) is not None


def test_top_k_at_or_past_the_vocabulary_or_below_one_means_no_limit():
    logits = _logits(vocab=30)
    for k in (-1, 30, 31):
        got = [sample_rows(logits, SamplingParams(temperature=1.0, top_k=k, seed=9), p, 1)[0].token
               for p in range(40)]
        want = [sample_rows(logits, SamplingParams(temperature=1.0, seed=9), p, 1)[0].token for p in range(40)]
        assert got == want


@pytest.mark.parametrize("params", [
    SamplingParams(logprobs=MAX_LOGPROBS + 1), SamplingParams(logprobs=-2),
    SamplingParams(logit_bias=((50, 1.0),)), SamplingParams(logit_bias=((-1, 1.0),)),
    SamplingParams(logit_bias=((1, float("nan")),)), SamplingParams(presence_penalty=float("inf")),
    SamplingParams(temperature=float("nan")), SamplingParams(top_p=0.0)])
def test_values_the_sampler_cannot_use_are_named(params: SamplingParams):
    assert params.problem(50) is not None
