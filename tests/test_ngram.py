"""Prompt lookup: the matcher, its per-lane state, the combined proposer and how the window
controllers take a round with no match. No model is loaded."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from mesh.speculative.ngram import NGRAM, NgramProposer, lookup
from mesh.speculative.proposer import Combined, Proposal
from mesh.speculative.window import Adaptive, CostAware, Observation
from packages.speculative import WindowPolicy


def _lookup(tokens: list[int], k: int, ngram_min: int = 2, ngram_max: int = 4) -> list[int]:
    return lookup(np.asarray(tokens, dtype=np.int64), ngram_min, ngram_max, k)


def test_proposes_what_followed_the_most_recent_earlier_occurrence():
    #            0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [1, 2, 3, 7, 8, 1, 2, 3, 9, 5, 1, 2, 3]
    assert _lookup(tokens, 3) == [9, 5, 1]  # the occurrence at 5..7, not the older one at 0..2
    assert _lookup(tokens, 1) == [9]
    assert _lookup(tokens, 10) == [9, 5, 1, 2, 3]  # up to the end of the sequence


def test_the_longest_suffix_wins_over_a_more_recent_shorter_one():
    tokens = [4, 2, 3, 6, 9, 2, 3, 7, 4, 2, 3]
    assert _lookup(tokens, 1) == [6]  # [4, 2, 3] matches at 0; [2, 3] alone would give 7
    assert _lookup(tokens, 1, ngram_max=2) == [7]


def test_nothing_without_a_match_of_at_least_ngram_min():
    assert _lookup([1, 2, 3, 4, 5], 4) == []
    assert _lookup([5, 1, 9, 2, 1], 4) == []  # only the last token recurs: a 1-gram
    assert _lookup([5, 1, 9, 2, 1], 4, ngram_min=1) == [9, 2, 1]
    assert _lookup([7], 4, ngram_min=1) == []
    assert _lookup([1, 2, 1, 2], 0) == []


def test_a_repeating_run_proposes_its_continuation():
    assert _lookup([3, 3, 3, 3], 4) == [3]  # the suffix [3, 3, 3] also ends at 2; one token follows it
    assert _lookup([1, 2, 1, 2, 1, 2], 4) == [1, 2]


def _budget(k: int):
    return lambda name, catch_up=0: k if name == NGRAM else 0


def test_proposals_follow_the_sequence_as_it_grows_and_rolls_back():
    proposer = NgramProposer(2, 4)

    async def go() -> None:
        seq = [1, 2, 3, 4, 1, 2]
        assert (await proposer.proposal(0, seq, _budget(2))).tokens == [3, 4]
        seq += [3, 4]  # accepted
        assert (await proposer.proposal(0, seq, _budget(2))).tokens == [1, 2]
        rolled = [1, 2, 3, 4, 1, 2, 5, 6, 5]  # a rejection rewrote the tail
        assert (await proposer.proposal(0, rolled, _budget(2))).tokens == []
        assert (await proposer.proposal(0, [*rolled, 6], _budget(2))).tokens == [5, 6]
        assert (await proposer.proposal(1, [9, 9, 9], _budget(2))).tokens == [9]  # lanes are separate
        assert (await proposer.proposal(0, seq, _budget(0))).tokens == []  # its controller said 0

    asyncio.run(go())


def test_the_array_grows_past_its_first_capacity():
    proposer = NgramProposer(3, 5)
    seq = list(range(300)) * 3

    async def go() -> Proposal:
        for end in range(290, len(seq), 7):
            await proposer.proposal(0, seq[:end], _budget(4))
        return await proposer.proposal(0, seq, _budget(4))

    assert asyncio.run(go()).tokens == [0, 1, 2, 3]


class _Fixed:
    """A stand-in proposer that always proposes the same tokens."""

    def __init__(self, name: str, tokens: list[int]) -> None:
        self.names: tuple[str, ...] = (name,)
        self.tokens = tokens
        self.forgotten: list[int] = []

    async def proposal(self, lane, sequence, budget, guide=None, sampling=None) -> Proposal:
        return Proposal(self.tokens[: budget(self.names[0])], self.names[0], 0.01)

    def forget(self, lane: int) -> None:
        self.forgotten.append(lane)


def test_combined_takes_prompt_lookup_when_it_matches_and_the_draft_otherwise():
    draft = _Fixed("draft", [7, 7, 7])
    both = Combined(NgramProposer(2, 4), draft)
    assert both.names == ("ngram", "draft")
    asked: list[str] = []

    def budget(name: str, catch_up: int = 0) -> int:
        asked.append(name)
        return 2

    async def go() -> tuple[Proposal, Proposal]:
        return (await both.proposal(0, [1, 2, 3, 1, 2], budget), await both.proposal(1, [1, 2, 3, 4], budget))

    matched, missed = asyncio.run(go())
    assert (matched.tokens, matched.by) == ([3, 1], "ngram")
    assert (missed.tokens, missed.by) == ([7, 7], "draft")
    assert asked == ["ngram", "ngram", "draft"]  # the draft's controller is asked only when it proposes
    both.forget(1)
    assert draft.forgotten == [1]


def test_a_round_without_a_match_moves_no_adaptive_window():
    adaptive = Adaptive(WindowPolicy(policy="adaptive", initial=4, min=1, max=8))
    adaptive.record(Observation(0, 0, 0.0, 1))
    assert adaptive.window == 4  # no shrink: nothing was rejected


def test_cost_aware_with_free_proposals_speculates_when_they_are_accepted():
    """Prompt lookup's proposals cost microseconds: with this CPU's costs for one stage (a
    row 11.6 ms, each more 6.05 ms, DESIGN.md §9) and a copy accepted whole, a long window pays."""
    w = CostAware(WindowPolicy(policy="cost-aware", initial=4, min=1, max=16))
    for _ in range(60):
        k = w.next_window()
        w.record(Observation(k, k, 2e-5 * k, k + 1, 0.0116 + 0.00605 * k))
    assert w.next_window() >= 6


def test_per_call_cost_on_a_long_sequence():
    """A lookup on 4,000 tokens with frequent partial matches stays far below one decode
    (11.6 ms for one row of SmolLM2 here)."""
    rng = np.random.default_rng(0)
    seq = [int(t) for t in rng.integers(0, 50, 4200)]  # a 50-token vocabulary: many short matches
    proposer = NgramProposer(3, 5)

    async def go(lane: int, rolled_back: bool) -> float:
        began = time.perf_counter()
        for end in range(4000, 4200):  # one token more per call, as the loop's sequence grows
            tail = [seq[end] + 1] if rolled_back else []  # each call rewrites the last token
            await proposer.proposal(lane, seq[:end] + tail, _budget(8))
        return (time.perf_counter() - began) / 200

    growing, rewritten = asyncio.run(go(0, False)), asyncio.run(go(1, True))
    print(f"per call on 4,000 tokens: {growing * 1e6:.0f} µs growing, {rewritten * 1e6:.0f} µs rolled back")
    assert max(growing, rewritten) < 2e-3


@pytest.mark.parametrize(("lengths", "message"), [((0, 3), "1 <= ngram_min"),
                                                  ((4, 3), r"ngram_min \(4\) <= ngram_max")])
def test_lengths_are_checked(lengths, message):
    from pydantic import ValidationError

    from packages.speculative import NgramStrategy

    with pytest.raises(ValidationError, match=message):
        NgramStrategy(name="n", type="ngram", ngram_min=lengths[0], ngram_max=lengths[1])
