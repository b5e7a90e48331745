"""MLX model code, one small file per architecture family, as mlx-lm writes them (issue 17).

Importing this package imports `mlx`; only `stage.mlx_engine` does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import mlx.core as mx

from stage.mlx_models.cache import KVCache


class RangeModel(Protocol):
    """Layers [a, b) of a model, as the MLX engine drives them."""

    width: int  # hidden-state width
    n_vocab: int
    n_layer: int  # layers in the range

    def embed(self, tokens: mx.array) -> mx.array:
        """Token ids [B, n] -> the first layer's input [B, n, width] (first stage only)."""
        ...

    def __call__(self, h: mx.array, lanes: list[list[KVCache]]) -> mx.array:
        """The range's layers for B sessions ([B, rows, width]): hidden states in, hidden
        states out, each session's KV appended to its caches `lanes[b]` (one per layer)."""
        ...

    def logits(self, h: mx.array) -> mx.array:
        """The final norm and the head (final stage only)."""
        ...

    def make_caches(self) -> list[KVCache]: ...

    def parameters(self) -> dict[str, object]: ...


ARCHITECTURES = ("llama", "qwen3", "qwen3moe")  # the `general.architecture`s `builder` knows

# build(metadata, weights, first, final): the model for a stage GGUF's tensors
Builder = Callable[[dict[str, object], dict[str, mx.array], bool, bool], RangeModel]


def builder(architecture: str) -> Builder:
    """The model code for a GGUF's `general.architecture`; raises KeyError naming what there is."""
    if architecture == "llama":
        from stage.mlx_models import llama

        return llama.build
    if architecture == "qwen3":
        from stage.mlx_models import qwen3

        return qwen3.build
    if architecture == "qwen3moe":
        from stage.mlx_models import qwen3moe

        return qwen3moe.build
    raise KeyError(f"the MLX engine has no model code for architecture {architecture!r} "
                   f"(it has: {', '.join(ARCHITECTURES)})")
