"""The qwen3moe architecture (Qwen3-MoE, as Qwen3-30B-A3B) in MLX, over a layer range: qwen3
(qwen3.py) with every layer's MLP a mixture of experts, as llama.cpp's
`llama_model_qwen3moe::graph` (src/models/qwen3moe.cpp) computes it with `build_moe_ffn`:
a softmax over the router's logits, the top `expert_used_count` experts, their weights
normalized to sum to one (`norm_w`), scaled by `expert_weights_scale` unless it is 0 or 1,
and the SwiGLU of each chosen expert summed with those weights.

The experts' weights are stacked, [experts, out, in] (`ffn_{gate,up,down}_exps`), and each
token multiplies only its chosen ones (`mx.gather_mm`, or `mx.gather_qmm` when they came
quantized), as mlx-lm's SwitchGLU does.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn

from stage.mlx_models import llama, qwen3
from stage.mlx_models.gguf_load import load_range, meta_number


@dataclass(frozen=True)
class ModelArgs(llama.ModelArgs):
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    expert_weights_scale: float = 0.0

    @classmethod
    def from_gguf(cls, meta: dict[str, object], vocab_size: int, arch: str = "qwen3moe") -> ModelArgs:
        def number(key: str, default: float | None = None) -> float:
            return meta_number(meta, f"{arch}.{key}", default)

        base = llama.ModelArgs.from_gguf(meta, vocab_size, arch)
        used = int(number("expert_used_count"))
        return cls(**dataclasses.asdict(base), num_experts=int(number("expert_count")), num_experts_per_tok=used,
                   moe_intermediate_size=int(number("expert_feed_forward_length", base.intermediate_size // used)),
                   expert_weights_scale=number("expert_weights_scale", 0.0))


class SwitchLinear(nn.Module):
    """Stacked experts' weights [experts, out, in]; each row of x meets its chosen experts."""

    def __init__(self, n_expert: int, in_dims: int, out_dims: int) -> None:
        super().__init__()
        self.weight = mx.zeros((n_expert, out_dims, in_dims))

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        return mx.gather_mm(x, self.weight.swapaxes(-1, -2), rhs_indices=indices)

    def to_quantized(self, group_size: int, bits: int, **_: Any) -> QuantizedSwitchLinear:
        return QuantizedSwitchLinear(self.weight, group_size, bits)


class QuantizedSwitchLinear(nn.Module):
    def __init__(self, weight: mx.array, group_size: int, bits: int) -> None:
        super().__init__()
        self.group_size, self.bits = group_size, bits
        self.weight, self.scales, self.biases = mx.quantize(weight, group_size, bits)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        return mx.gather_qmm(x, self.weight, self.scales, self.biases, rhs_indices=indices, transpose=True,
                             group_size=self.group_size, bits=self.bits)


class SwitchGLU(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, n_expert: int) -> None:
        super().__init__()
        self.gate_proj = SwitchLinear(n_expert, dim, hidden_dim)
        self.up_proj = SwitchLinear(n_expert, dim, hidden_dim)
        self.down_proj = SwitchLinear(n_expert, hidden_dim, dim)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        """x [..., dim], indices [..., k] -> each chosen expert's output [..., k, dim]."""
        x = mx.expand_dims(x, (-2, -3))
        h = nn.silu(self.gate_proj(x, indices)) * self.up_proj(x, indices)
        return self.down_proj(h, indices).squeeze(-2)


class SparseMoeBlock(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.top_k, self.scale = args.num_experts_per_tok, args.expert_weights_scale
        self.gate = nn.Linear(args.hidden_size, args.num_experts, bias=False)
        self.switch_mlp = SwitchGLU(args.hidden_size, args.moe_intermediate_size, args.num_experts)

    def __call__(self, x: mx.array) -> mx.array:
        probs = mx.softmax(self.gate(x), axis=-1, precise=True)
        chosen = mx.argpartition(-probs, kth=self.top_k - 1, axis=-1)[..., : self.top_k]
        weights = mx.take_along_axis(probs, chosen, axis=-1)
        weights = weights / mx.maximum(weights.sum(axis=-1, keepdims=True), 6.103515625e-5)
        if self.scale not in (0.0, 1.0):
            weights = weights * self.scale
        return (self.switch_mlp(x, chosen) * weights[..., None]).sum(axis=-2)


class Model(qwen3.Model):
    arch: ClassVar[str] = "qwen3moe"
    args_class: ClassVar[type[llama.ModelArgs]] = ModelArgs
    layer_names: ClassVar[dict[str, str]] = {
        **qwen3.Model.layer_names, "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
        "ffn_up_exps": "mlp.switch_mlp.up_proj", "ffn_down_exps": "mlp.switch_mlp.down_proj"}

    def make_mlp(self, args: llama.ModelArgs) -> nn.Module:
        assert isinstance(args, ModelArgs)
        return SparseMoeBlock(args)


def build(meta: dict[str, object], weights: dict[str, mx.array], first: bool, final: bool,
          dtype: mx.Dtype = mx.float32) -> Model:
    return load_range(Model, meta, weights, first, final, dtype)
