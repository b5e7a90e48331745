"""Chi-square tests for the distribution tests, without scipy (not a dependency here)."""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from typing import TypeVar

K = TypeVar("K", bound=Hashable)


def chi2_sf(x: float, k: int) -> float:
    """P(X >= x) for X chi-square with k degrees of freedom, by the Wilson-Hilferty cube
    root: within 1e-3 of the exact tail at the 0.001 level for k >= 3."""
    if k <= 0:
        return 1.0
    z = ((x / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


def goodness_of_fit(counts: Sequence[int], probs: Sequence[float]) -> float:
    """The p-value of `counts` drawn from `probs` (cells with expectations under 5 pooled)."""
    n = sum(counts)
    cells = _pooled([(c, p * n) for c, p in zip(counts, probs, strict=True)])
    x = sum((c - e) ** 2 / e for c, e in cells)
    return chi2_sf(x, len(cells) - 1)


def two_samples(a: Mapping[K, int], b: Mapping[K, int]) -> float:
    """The p-value of a and b being counts from one distribution (the chi-square test of
    homogeneity; outcomes seen fewer than 10 times in both together are pooled)."""
    na, nb = sum(a.values()), sum(b.values())
    keys = set(a) | set(b)
    common = [k for k in keys if a.get(k, 0) + b.get(k, 0) >= 10]
    rest = [k for k in keys if a.get(k, 0) + b.get(k, 0) < 10]
    rows = [(a.get(k, 0), b.get(k, 0)) for k in common]
    if rest:
        rows.append((sum(a.get(k, 0) for k in rest), sum(b.get(k, 0) for k in rest)))
    x = 0.0
    for ca, cb in rows:
        total = ca + cb
        ea, eb = total * na / (na + nb), total * nb / (na + nb)
        x += (ca - ea) ** 2 / ea + (cb - eb) ** 2 / eb
    return chi2_sf(x, len(rows) - 1)


def _pooled(cells: list[tuple[int, float]]) -> list[tuple[int, float]]:
    big = [(c, e) for c, e in cells if e >= 5]
    small = [(c, e) for c, e in cells if e < 5]
    if small:
        big.append((sum(c for c, _ in small), sum(e for _, e in small)))
    return [(c, e) for c, e in big if e > 0]
