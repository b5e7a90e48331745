"""A model class's layer range from a stage GGUF's tensors, as `mx.load` reads them.

The weights are a stage GGUF's (DESIGN.md §3 step 1): layers renumbered from 0, so a range's
layer i is `blk.i`. Q4_0, Q4_1 and Q8_0 tensors arrive as MLX affine quantized weights
(packed uint32, scales and biases per group of 32) and stay quantized;
`quantized_linear_params` reads their bits and group from the shapes. Each family's file
(llama.py, qwen3.py, ...) names its tensors (`Model.layer_names`) and calls `load_range`.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol, TypeVar, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten


class RangeModel(Protocol):
    """What `load_range` needs of a model class (stage/mlx_models/llama.py `Model` and its kin)."""

    arch: ClassVar[str]
    layer_names: ClassVar[dict[str, str]]
    args_class: ClassVar[Any]

    def __init__(self, args: Any, first: bool, final: bool, tied: bool) -> None: ...
    def parameters(self) -> Any: ...
    def load_weights(self, weights: list[tuple[str, mx.array]], strict: bool = True) -> Any: ...
    def eval(self) -> Any: ...


M = TypeVar("M", bound=RangeModel)

_TOP_NAMES = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}


def meta_number(meta: dict[str, object], key: str, default: float | None = None) -> float:
    """A number from `mx.load`'s GGUF metadata: scalars arrive as 0-d arrays, per-layer
    counts (head counts, FFN lengths) as 1-d arrays, which must hold one value."""
    value = meta.get(key, default)
    if isinstance(value, mx.array):
        values = set(np.array(value).ravel().tolist())
        if len(values) != 1:
            raise ValueError(f"{key} differs between layers ({sorted(values)}); the MLX model needs one value")
        value = values.pop()
    if not isinstance(value, int | float):
        raise ValueError(f"the GGUF has no number {key}")
    return float(value)


def check_supported(meta: dict[str, object], names: set[str], arch: str) -> None:
    """Refuse what the model code does not compute, by name, rather than computing it wrong."""
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling is not None and str(scaling) not in ("none", ""):
        raise ValueError(f"{arch} rope scaling {scaling!r} is not supported by the MLX {arch} model")
    if "rope_freqs.weight" in names:
        raise ValueError(f"{arch} rope frequency factors (rope_freqs.weight, Llama 3.1 scaling) are not supported")
    biased = sorted(n for n in names if n.endswith(".bias"))
    if biased:
        raise ValueError(f"the MLX {arch} model has no bias terms; the GGUF has {biased[0]}")


def module_path(gguf_name: str, model_class: type[RangeModel]) -> str:
    """`blk.3.attn_q.weight` -> `layers.3.self_attn.q_proj.weight` (also `.scales`, `.biases`)."""
    stem, _, suffix = gguf_name.rpartition(".")
    parts = stem.split(".")
    layer_names = model_class.layer_names
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in layer_names:
        return f"layers.{parts[1]}.{layer_names[parts[2]]}.{suffix}"
    if len(parts) == 1 and parts[0] in _TOP_NAMES:
        return f"{_TOP_NAMES[parts[0]]}.{suffix}"
    raise ValueError(f"the MLX {model_class.arch} model has no place for GGUF tensor {gguf_name}")


def load_range(model_class: type[M], meta: dict[str, object], weights: dict[str, mx.array], first: bool,
               final: bool, dtype: mx.Dtype = mx.float32) -> M:
    """The model for a stage GGUF's tensors (`mx.load` names), with only what the range uses.

    Floating weights (norms, and quantization scales and biases, float16 in the GGUF) are
    cast to `dtype`, so activations stay in it: float32 follows llama.cpp's CPU arithmetic.
    """
    arch = model_class.arch
    check_supported(meta, set(weights), arch)
    tied = "output.weight" not in weights
    vocab = int(weights["token_embd.weight"].shape[0])
    model = model_class(model_class.args_class.from_gguf(meta, vocab, arch), first=first, final=final, tied=tied)
    wanted = set(tree_flatten(model.parameters(), destination={}))  # parameter paths
    mapped: dict[str, mx.array] = {}
    for name, value in weights.items():
        path = module_path(name, model_class)
        module = path.rpartition(".")[0]
        if f"{module}.weight" not in wanted:
            continue  # a stage GGUF carries the embedding and head even where the range skips them
        mapped[path] = value.astype(dtype) if mx.issubdtype(value.dtype, mx.floating) else value
    nn.quantize(cast(nn.Module, model),
                class_predicate=lambda path, module: quantized_linear_params(path, module, mapped))
    model.load_weights(list(mapped.items()), strict=True)
    model.eval()
    return model


def quantized_linear_params(path: str, module: nn.Module, weights: dict[str, mx.array]) -> dict[str, int] | bool:
    """`nn.quantize`'s predicate: a module whose weight came quantized gets its bits and group.

    A packed weight is uint32 [out, in * bits / 32]; its scales are [out, in / group]
    (with the experts first, [experts, out, ...], for a mixture of experts).
    """
    scales = weights.get(f"{path}.scales")
    if scales is None or not hasattr(module, "to_quantized"):
        return False
    in_dims = int(module.weight.shape[-1])
    packed = int(weights[f"{path}.weight"].shape[-1])
    return {"group_size": in_dims // int(scales.shape[-1]), "bits": packed * 32 // in_dims}
