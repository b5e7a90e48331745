"""Which architectures may be split, and where.

A cut at layer c means one stage ends at c and the next starts there. Stage GGUFs renumber
their layers from 0, so any per-layer behaviour that llama.cpp derives from the layer index
must repeat with the cut's period, or the split model computes something else.
"""

from __future__ import annotations

from collections.abc import Sequence

from packages.errors import PackageError

# Llama-family graphs do not depend on the layer index: every cut is safe.
_ANY_CUT = {"llama"}
# Gemma3 makes every 6th layer global attention and the rest sliding-window, by index.
_PERIODIC = {"gemma3": 6}

SUPPORTED = sorted(_ANY_CUT | set(_PERIODIC))


def require_supported(architecture: str) -> None:
    if architecture not in SUPPORTED:
        raise PackageError(
            f"unsupported architecture '{architecture}': splitting is proven only for "
            f"{', '.join(SUPPORTED)}"
        )


def allowed_cuts(architecture: str, layer_count: int) -> list[int]:
    """Interior cut points (0 < c < layer_count) that keep the model's computation unchanged."""
    require_supported(architecture)
    if architecture in _ANY_CUT:
        return list(range(1, layer_count))
    if architecture in _PERIODIC:
        period = _PERIODIC[architecture]
        return list(range(period, layer_count, period))
    raise AssertionError(architecture)


def check_range(start: int, end: int, layer_count: int, cuts: Sequence[int]) -> None:
    """Refuse empty, out-of-bounds, or disallowed-boundary layer ranges."""
    if end <= start:
        raise PackageError(f"layer range [{start},{end}) is empty")
    if start < 0 or end > layer_count:
        raise PackageError(f"layer range [{start},{end}) is outside [0,{layer_count})")
    boundaries = {0, layer_count, *cuts}
    for edge in (start, end):
        if edge not in boundaries:
            raise PackageError(
                f"cut at layer {edge} is not allowed for this architecture; "
                f"allowed cuts: {cuts}"
            )
