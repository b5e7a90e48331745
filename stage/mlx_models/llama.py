"""The llama architecture (SmolLM2, Llama 2/3 without rope scaling) in MLX, over a layer range.

Written the way mlx-lm writes a model: arguments, attention, MLP, block, model, and the
weight names; `gguf_load.load_range` builds a layer range from a stage GGUF's tensors.

RoPE: llama.cpp's converter permutes the rows of `attn_q`/`attn_k` so that llama.cpp's
"normal" rope, which rotates adjacent pairs (x0, x1), (x2, x3), ..., equals the Hugging Face
model's half-split rope. MLX's `traditional=True` rope rotates the same adjacent pairs, so
the GGUF weights are used as stored, with no permutation back.

Other families reuse these pieces (qwen3.py, qwen3moe.py): a subclass of `Attention` changes
the heads (`heads`) or the rope (`traditional`), and a subclass of `Model` names its
attention, its MLP (`make_mlp`), its arguments (`args_class`), its GGUF metadata prefix
(`arch`) and its tensors (`layer_names`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import mlx.core as mx
import mlx.nn as nn

from stage.mlx_models.cache import KVCache, LayerCache
from stage.mlx_models.gguf_load import load_range, meta_number


@dataclass(frozen=True)
class ModelArgs:
    hidden_size: int
    num_hidden_layers: int  # in this range
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_dims: int
    rope_theta: float
    rms_norm_eps: float
    vocab_size: int

    @classmethod
    def from_gguf(cls, meta: dict[str, object], vocab_size: int, arch: str = "llama") -> ModelArgs:
        def number(key: str, default: float | None = None) -> float:
            return meta_number(meta, f"{arch}.{key}", default)

        heads = int(number("attention.head_count"))
        hidden = int(number("embedding_length"))
        head_dim = int(number("attention.key_length", hidden // heads))
        return cls(
            hidden_size=hidden,
            num_hidden_layers=int(number("block_count")),
            intermediate_size=int(number("feed_forward_length")),
            num_attention_heads=heads,
            num_key_value_heads=int(number("attention.head_count_kv", heads)),
            head_dim=head_dim,
            rope_dims=int(number("rope.dimension_count", head_dim)),
            rope_theta=number("rope.freq_base", 10000.0),
            rms_norm_eps=number("attention.layer_norm_rms_epsilon"),
            vocab_size=vocab_size,
        )


class Attention(nn.Module):
    traditional = True  # llama.cpp's "normal" rope on the permuted q/k rows (the docstring above)

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        dim, head_dim = args.hidden_size, args.head_dim
        self.n_heads, self.n_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.scale = head_dim**-0.5
        self.q_proj = nn.Linear(dim, self.n_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * head_dim, dim, bias=False)
        self.rope = nn.RoPE(args.rope_dims, traditional=self.traditional, base=args.rope_theta)

    def __call__(self, x: mx.array, caches: list[KVCache]) -> mx.array:
        """x: [B, rows, dim], one batch row per session, each with its own lane's cache:
        the projections run batched, attention per session over its own keys."""
        batch, rows, _ = x.shape
        q, k, v = (t.transpose(0, 2, 1, 3) for t in self.heads(x))
        outs = [self._attend(q[b : b + 1], k[b : b + 1], v[b : b + 1], cache) for b, cache in enumerate(caches)]
        out = outs[0] if batch == 1 else mx.concatenate(outs, axis=0)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(batch, rows, -1))

    def heads(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """q, k and v of x [B, rows, dim], each [B, rows, heads, head_dim]."""
        batch, rows, _ = x.shape
        return (self.q_proj(x).reshape(batch, rows, self.n_heads, -1),
                self.k_proj(x).reshape(batch, rows, self.n_kv_heads, -1),
                self.v_proj(x).reshape(batch, rows, self.n_kv_heads, -1))

    def _attend(self, q: mx.array, k: mx.array, v: mx.array, cache: KVCache) -> mx.array:
        q = self.rope(q, offset=cache.offset)
        k = self.rope(k, offset=cache.offset)
        k, v = cache.update_and_fetch(k, v)
        # "causal" aligns the last query with the last key: row i sees the cache and rows <= i
        mask = "causal" if q.shape[2] > 1 else None
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)


class MLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, attention: type[Attention], mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = attention(args)
        self.mlp = mlp
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, caches: list[KVCache]) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), caches)
        return h + self.mlp(self.post_attention_layernorm(h))


# GGUF tensor names -> this file's module paths
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}



class Model(nn.Module):
    """Layers [a, b) of a llama model: the embedding when a = 0, the norm and head when b = L.

    `embed` turns token ids into the first layer's input; `__call__` runs the range's layers
    (hidden states in, hidden states out); `logits` applies the final norm and the head,
    which is the embedding matrix when the GGUF has no `output.weight` (tied, as in SmolLM2).
    """

    arch: ClassVar[str] = "llama"  # the GGUF metadata prefix, `general.architecture`
    args_class: ClassVar[type[ModelArgs]] = ModelArgs
    attention: ClassVar[type[Attention]] = Attention
    layer_names: ClassVar[dict[str, str]] = LAYER_NAMES

    def __init__(self, args: ModelArgs, first: bool, final: bool, tied: bool) -> None:
        super().__init__()
        self.args, self.first, self.final, self.tied = args, first, final, tied
        self.width, self.n_vocab, self.n_layer = args.hidden_size, args.vocab_size, args.num_hidden_layers
        if first or (final and tied):
            self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [self.make_layer(args, i) for i in range(args.num_hidden_layers)]
        if final:
            self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
            if not tied:
                self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def make_layer(self, args: ModelArgs, index: int) -> nn.Module:
        """The range's layer `index` (a hybrid's kind depends on it: qwen35moe.py)."""
        return TransformerBlock(args, self.attention, self.make_mlp(args))

    def make_mlp(self, args: ModelArgs) -> nn.Module:
        return MLP(args.hidden_size, args.intermediate_size)

    def embed(self, tokens: mx.array) -> mx.array:
        return self.embed_tokens(tokens)

    def __call__(self, h: mx.array, lanes: list[list[LayerCache]]) -> mx.array:
        """h: [B, rows, width] for B sessions; `lanes[b]` is session b's caches, one per layer."""
        for i, layer in enumerate(self.layers):
            h = layer(h, [caches[i] for caches in lanes])
        return h

    def logits(self, h: mx.array) -> mx.array:
        h = self.norm(h)
        return self.embed_tokens.as_linear(h) if self.tied else self.lm_head(h)

    def make_caches(self) -> list[LayerCache]:
        return [KVCache() for _ in self.layers]


def build(meta: dict[str, object], weights: dict[str, mx.array], first: bool, final: bool,
          dtype: mx.Dtype = mx.float32) -> Model:
    return load_range(Model, meta, weights, first, final, dtype)
