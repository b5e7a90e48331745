"""Which GGUF tensors MLX can read, asked without importing mlx.

Two places ask: the planner's fit check (mesh/routing/stage_fit.py), from the manifest's tensor types,
before any stage loads; and the MLX engine's load guard, from the GGUF itself. Neither imports
the other's module, so the check lives apart from both.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

# The GGUF tensor types `mx.load` reads: Q4_0, Q4_1 and Q8_0 stay quantized, the floats are
# read as they are. K-quants and the rest fail inside `mx.load` with a message that names
# neither tensor nor type, so they are refused first, by name.
MLX_GGUF_TYPES = ("F32", "F16", "Q4_0", "Q4_1", "Q8_0")


def mlx_unreadable(tensors: Iterable[tuple[str, str]]) -> tuple[str, str] | None:
    """The first (tensor, GGUF type) that `mx.load` cannot read, if any."""
    return next(((name, kind) for name, kind in tensors if kind not in MLX_GGUF_TYPES), None)


def unsupported_tensor(gguf: Path) -> tuple[str, str] | None:
    """The first tensor (name, type) of the GGUF that `mx.load` cannot read, if any."""
    from gguf import GGUFReader

    return mlx_unreadable((t.name, t.tensor_type.name) for t in GGUFReader(gguf).tensors)
