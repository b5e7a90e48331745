"""MLX model code, one small file per architecture family, as mlx-lm writes them (issue 17).

Importing this package imports `mlx`; only `stage.mlx_engine` does.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Protocol

import mlx.core as mx

from stage.mlx_models.cache import LayerCache


class RangeModel(Protocol):
    """Layers [a, b) of a model, as the MLX engine drives them."""

    width: int  # hidden-state width
    n_vocab: int
    n_layer: int  # layers in the range

    def embed(self, tokens: mx.array) -> mx.array:
        """Token ids [B, n] -> the first layer's input [B, n, width] (first stage only)."""
        ...

    def __call__(self, h: mx.array, lanes: list[list[LayerCache]]) -> mx.array:
        """The range's layers for B sessions ([B, rows, width]): hidden states in, hidden
        states out, each session's KV appended to its caches `lanes[b]` (one per layer)."""
        ...

    def logits(self, h: mx.array) -> mx.array:
        """The final norm and the head (final stage only)."""
        ...

    def make_caches(self) -> list[LayerCache]: ...

    def parameters(self) -> dict[str, object]: ...


# `general.architecture` -> the module of this package that builds it (its `build`), imported
# only when a stage GGUF names it
MODULES = {"llama": "llama", "qwen3": "qwen3", "qwen3moe": "qwen3moe", "qwen35moe": "qwen35moe"}
ARCHITECTURES = tuple(MODULES)  # the `general.architecture`s `builder` knows

# build(metadata, weights, first, final): the model for a stage GGUF's tensors
Builder = Callable[[dict[str, object], dict[str, mx.array], bool, bool], RangeModel]


def builder(architecture: str) -> Builder:
    """The model code for a GGUF's `general.architecture`; raises KeyError naming what there is."""
    if architecture not in MODULES:
        raise KeyError(f"the MLX engine has no model code for architecture {architecture!r} "
                       f"(it has: {', '.join(ARCHITECTURES)})")
    build: Builder = importlib.import_module(f"{__name__}.{MODULES[architecture]}").build
    return build
