"""Grammar masks at the final stage: which tokens each sampled row may pick.

Stage 0 sends one mask per sampled row of a constrained frame (mesh/constraints/guide.py):
one bit per vocabulary token in little-endian 32-bit words, as llguidance computes it, and
empty bytes for a row it leaves free. A token whose bit is clear gets -inf before the draw,
after logit_bias and the penalties, so logprobs are those of the distribution sampled from.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def mask_bytes(vocab: int) -> int:
    """The size of one row's mask for a vocabulary of `vocab`."""
    return (vocab + 31) // 32 * 4


def pack(allowed: Sequence[int], vocab: int) -> bytes:
    """The mask allowing exactly `allowed`."""
    bits = np.zeros(mask_bytes(vocab) * 8, dtype=np.uint8)
    bits[np.asarray(allowed, dtype=np.int64)] = 1
    return np.packbits(bits, bitorder="little").tobytes()


def unpack(mask: bytes, vocab: int) -> np.ndarray:
    """The tokens `mask` allows, as a bool per token."""
    return np.unpackbits(np.frombuffer(mask, dtype=np.uint8), count=vocab, bitorder="little").view(bool)


def masks_problem(masks: Sequence[bytes], vocab: int, rows: int) -> str | None:
    """None when `masks` fit a frame of `rows` sampled rows over `vocab` tokens, else why not."""
    if not masks:
        return None
    if len(masks) != rows:
        return f"{len(masks)} grammar masks for {rows} sampled rows"
    size = mask_bytes(vocab)
    for i, mask in enumerate(masks):
        if mask and (len(mask) != size or not any(mask)):
            return f"grammar mask {i} is {len(mask)} bytes allowing {'some' if any(mask) else 'no'} token; " \
                   f"a vocabulary of {vocab} needs {size} with one allowed"
    return None


def apply_masks(logits: np.ndarray, masks: Sequence[bytes]) -> np.ndarray:
    """`logits` with each row's disallowed tokens at -inf; the same array when no row is masked
    (a copy otherwise: the engine's logits stay as it returned them)."""
    if not any(masks):
        return logits
    allowed = np.ones(logits.shape, dtype=bool)
    for i, mask in enumerate(masks):
        if mask:
            allowed[i] = unpack(mask, logits.shape[1])
    return np.where(allowed, logits, logits.dtype.type(-np.inf))  # one pass: cheaper than indexing by ~mask
