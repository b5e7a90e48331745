"""A row's tokens best first, as `np.argsort(-row, kind="stable")` orders them, without sorting the row.

The sampler draws from the tokens in that order (ties to the lower id), but a draw needs
only the first k of them, or one of them: a stable argsort of a 49k vocabulary cost about
14 ms a row on this project's VM, more than the decode that made the row. Partitioning
finds the same tokens in the same order; every function here returns exactly what the
full sort would, for rows without NaN (`sorted_exactly` says when that holds).
"""

from __future__ import annotations

import numpy as np

# Past this share of the row, partitioning saves little over sorting it all.
_PARTIAL_SHARE = 0.75


def sorted_exactly(row: np.ndarray) -> bool:
    """Whether these functions equal the full sort on `row`: NaN compares with nothing."""
    return not np.isnan(row).any()


def best(row: np.ndarray, k: int) -> np.ndarray:
    """`np.argsort(-row, kind="stable")[:k]`, for 1 <= k."""
    n = len(row)
    if k == 1:  # what top-p keeps of a confident row: argmax takes the first of equal maxima too
        return np.array([np.argmax(row)])
    if k >= n * _PARTIAL_SHARE:
        return np.argsort(-row, kind="stable")[:k]
    worse = -row
    kth = np.partition(worse, k - 1)[k - 1]  # the k-th best value
    above = np.flatnonzero(worse < kth)  # fewer than k
    tied = np.flatnonzero(worse == kth)[: k - len(above)]  # the rest, lowest ids first
    chosen = np.concatenate([above, tied])  # each part in id order, so a stable sort keeps ties by id
    return chosen[np.argsort(worse[chosen], kind="stable")]


def values(row: np.ndarray) -> np.ndarray:
    """`row[np.argsort(-row, kind="stable")]`: the values best first, a new contiguous array.

    Equal values are equal whichever token holds them (0.0 and -0.0 aside, which every
    use here treats alike), so sorting the values alone gives the same array.
    """
    return np.sort(row)[::-1].copy()  # contiguous: a sum then adds in this order


def nth(row: np.ndarray, ordered: np.ndarray, i: int) -> int:
    """`np.argsort(-row, kind="stable")[i]`, given `ordered = values(row)`."""
    value = ordered[i]
    ahead = int(np.count_nonzero(row > value))
    return int(np.flatnonzero(row == value)[i - ahead])
