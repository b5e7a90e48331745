"""Token sequences: what stage 0's record and its proposers both ask of two of them."""

from __future__ import annotations


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two sequences share: what the draft's KV still matches, and
    how many draft tokens the target accepted."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
