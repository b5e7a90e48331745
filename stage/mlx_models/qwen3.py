"""The qwen3 architecture (Qwen3 dense) in MLX, over a layer range: llama (llama.py) plus an
RMSNorm over each head of q and of k before RoPE, as llama.cpp's `llama_model_qwen3::graph`
(src/models/qwen3.cpp) computes it.

Two differences from llama besides the norms:
- RoPE: `llama_model_rope_type` gives qwen3 NEOX rope, which rotates the halves of each head
  (x_i, x_{i+d/2}), and llama.cpp's converter does not permute qwen's q/k rows (it does for
  llama only), so the GGUF rows are the Hugging Face ones: MLX's `traditional=False` rope.
- The head size is `qwen3.attention.key_length` (128 in Qwen3, not width / heads); the
  norms `attn_q_norm`, `attn_k_norm` are that long. `llama.ModelArgs` reads it already.
"""

from __future__ import annotations

from typing import ClassVar

import mlx.core as mx
import mlx.nn as nn

from stage.mlx_models import llama
from stage.mlx_models.gguf_load import load_range


class Attention(llama.Attention):
    traditional = False  # NEOX rope

    def __init__(self, args: llama.ModelArgs) -> None:
        super().__init__(args)
        self.q_norm = nn.RMSNorm(args.head_dim, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(args.head_dim, eps=args.rms_norm_eps)

    def heads(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        q, k, v = super().heads(x)
        return self.q_norm(q), self.k_norm(k), v


class Model(llama.Model):
    arch: ClassVar[str] = "qwen3"
    attention: ClassVar[type[llama.Attention]] = Attention
    layer_names: ClassVar[dict[str, str]] = {
        **llama.LAYER_NAMES, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}


def build(meta: dict[str, object], weights: dict[str, mx.array], first: bool, final: bool,
          dtype: mx.Dtype = mx.float32) -> Model:
    return load_range(Model, meta, weights, first, final, dtype)
