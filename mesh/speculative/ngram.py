"""Prompt lookup: proposals copied from the sequence itself (DESIGN.md §6, issue 16).

The last n tokens of the sequence (prompt and output together) are looked up earlier in
it, n from `ngram_max` down to `ngram_min`; the tokens that followed the most recent
occurrence are the proposal. Text that copies from its context (code edits, quotes, JSON)
gets long accepted windows for no model compute; novel text mostly finds no match, and
then the round is a plain decode.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from mesh.speculative.proposer import Budget, DraftSampling, Proposal

if TYPE_CHECKING:
    from mesh.constraints.guide import Guide

NGRAM = "ngram"  # its name in usage.speculative.by_proposer and in plans


def lookup(tokens: np.ndarray, ngram_min: int, ngram_max: int, k: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest suffix
    of `tokens` of ngram_max..ngram_min tokens; [] when none occurs earlier."""
    size = len(tokens)
    if k < 1 or size < ngram_min + 1:
        return []
    # every earlier position holding the last token ends a candidate; narrowing the candidates
    # token by token costs one pass over the sequence plus work on the few that survive
    ends = np.flatnonzero(tokens[: size - 1] == tokens[-1])
    for n in range(min(ngram_max, size - 1), ngram_min - 1, -1):
        found = ends[ends >= n - 1]
        for back in range(1, n):
            if not found.size:
                break
            found = found[tokens[found - back] == tokens[size - 1 - back]]
        if found.size:
            start = int(found[-1]) + 1
            return [int(t) for t in tokens[start : start + k]]
    return []


class NgramProposer:
    """The prompt-lookup proposer: `Proposer` (mesh/speculative/proposer.py) with no model."""

    names: tuple[str, ...] = (NGRAM,)

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.ngram_min, self.ngram_max = ngram_min, ngram_max

    async def proposal(self, lane: int, sequence: list[int], budget: Budget,
                       guide: Guide | None = None, sampling: DraftSampling | None = None) -> Proposal:
        """Point masses whatever `sampling` is: a lookup has no distribution to give."""
        began = time.perf_counter()
        k = budget(NGRAM)
        if k < 1:
            return Proposal([], NGRAM, 0.0)
        # the request's record holds the sequence; an array of it costs less than the lookup
        found = lookup(np.asarray(sequence, dtype=np.int64), self.ngram_min, self.ngram_max, k)
        if guide is not None:  # a lookup is cut at its first token the grammar refuses
            found = found[: guide.legal(found)]
        return Proposal(found, NGRAM, time.perf_counter() - began)

    def forget(self, lane: int) -> None:
        pass  # it keeps nothing per lane
