"""One lane's keys and values for one layer, trimmable to a position (DESIGN.md §3 step 5).

Like mlx-lm's KVCache: a buffer that grows in blocks of `step` positions, of which the first
`offset` hold this lane's KV. Trimming moves `offset` back; the positions past it are
overwritten by the next rows, so a trim costs nothing and a lane's buffer never shrinks.
"""

from __future__ import annotations

from typing import Protocol

import mlx.core as mx


class LayerCache(Protocol):
    """One lane's state for one layer, as the engine trims and evaluates it: KV (`KVCache`)
    or a recurrent layer's (stage/mlx_models/recurrent.py)."""

    offset: int

    def trim(self, position: int) -> None: ...

    @property
    def state(self) -> list[mx.array]: ...


class KVCache:
    step = 256

    def __init__(self) -> None:
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append rows [B, heads, n, dim] at `offset`; the lane's keys and values so far."""
        start, rows = self.offset, keys.shape[2]
        if self.keys is None or self.values is None or start + rows > self.keys.shape[2]:
            self.keys, self.values = self._grown(keys, values, start + rows)
        self.keys[..., start : start + rows, :] = keys
        self.values[..., start : start + rows, :] = values
        self.offset = start + rows
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    def _grown(self, keys: mx.array, values: mx.array, needed: int) -> tuple[mx.array, mx.array]:
        size = -(-needed // self.step) * self.step
        batch, heads, _, k_dim = keys.shape
        new_k = mx.zeros((batch, heads, size, k_dim), keys.dtype)
        new_v = mx.zeros((batch, heads, size, values.shape[3]), values.dtype)
        if self.keys is not None and self.values is not None and self.offset:
            new_k[..., : self.offset, :] = self.keys[..., : self.offset, :]
            new_v[..., : self.offset, :] = self.values[..., : self.offset, :]
        return new_k, new_v

    def trim(self, position: int) -> None:
        """Drop the positions from `position` on."""
        self.offset = max(0, min(self.offset, position))

    @property
    def state(self) -> list[mx.array]:
        return [a for a in (self.keys, self.values) if a is not None]
