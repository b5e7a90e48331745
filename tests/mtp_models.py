"""Tiny models whose MTP layer agrees with the target, for the MTP proposer's tests and bench.

A tiny random model's MTP layer is as random as its trunk: its drafts are almost never the
target's tokens, which exercises rejection and rollback but never a long accepted window.
`agreeing` turns any tiny model with a nextn layer into one whose drafts are always right: its
output norm and the MTP layer's head norm are zeroed, so every row's logits are zero and both
the target's greedy pick and the MTP layer's are token 0 (the first of a tie). The compute is
the model's own, row for row; only what the rows say is fixed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from packages.gguf_files import TensorCopy, architecture_of, metadata_of, open_gguf, write_gguf

_HEAD_NORMS = ("output_norm.weight", "nextn.shared_head_norm.weight")


def agreeing(src: Path, dest: Path) -> Path:
    """A copy of `src` whose greedy continuation is token 0 forever, from the target and its
    MTP layer alike."""
    reader = open_gguf(src)
    tensors = []
    for t in reader.tensors:
        if t.name.endswith(_HEAD_NORMS):
            t = t._replace(data_offset=0, data=np.zeros_like(t.data))
        tensors.append(TensorCopy(t.name, t))
    write_gguf(dest, architecture_of(reader), metadata_of(reader), tensors)
    return dest
