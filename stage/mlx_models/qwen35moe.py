"""The qwen35moe architecture (Qwen3.5-MoE, as Qwen3.5-397B-A17B) in MLX, over a layer range,
as llama.cpp's `llama_model_qwen35moe::graph` (src/models/qwen35moe.cpp) computes it.

A hybrid: gated delta-net layers (linear attention with a recurrent state) where the
stage's own layer index il has (il + 1) % full_attention_interval != 0, or as the per-layer
`attention.recurrent_layers` says, and gated full attention on the others; every layer's FFN
a qwen3moe mixture of experts plus a shared expert scaled by a sigmoid gate.

- Full attention: `attn_q` gives each head its query and then an output gate as wide
  (`build_layer_attn`); q/k RMSNorm per head, rope, attention, times sigmoid(gate), `attn_output`.
  The rope is IMROPE (M-RoPE with interleaved sections); text gives every section the same
  position, so it is NEOX rope over `rope.dimension_count` dims, MLX's `traditional=False`.
- Delta-net (`build_layer_attn_linear`, delta-net-base.cpp): `attn_qkv` then a causal
  depthwise convolution over the last `ssm.conv_kernel` rows (`ssm_conv1d`, no bias) and
  SiLU; q and k L2-normed (`build_gdn_l2_norm`: x / sqrt(sum x² + eps)); value head h reads
  key head h % key heads (ggml_repeat_4d tiles, and the fused kernel's `iv1 % neq1` agrees);
  per row, with g = softplus(`ssm_alpha` x + `ssm_dt.bias`) · `ssm_a` and
  β = sigmoid(`ssm_beta` x): S ← S·exp(g); S ← S + β(v − S k) kᵀ; out = S q / sqrt(key dim).
  The output is RMSNormed per head (`ssm_norm`), times SiLU(`attn_gate` x), then `ssm_out`.
  Rows run one at a time: the same arithmetic whatever the step's size, so a verify window
  equals single decodes and a replay after rollback (recurrent.py) equals the first pass.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from packages.architectures import recurrent_layers
from stage.mlx_models import llama, qwen3, qwen3moe
from stage.mlx_models.cache import KVCache, LayerCache
from stage.mlx_models.gguf_load import load_range, meta_number
from stage.mlx_models.recurrent import Checkpoint, RecurrentCache, Rows


@dataclass(frozen=True)
class ModelArgs(qwen3moe.ModelArgs):
    shared_intermediate_size: int = 0
    conv_kernel: int = 0
    key_heads: int = 0  # ssm.group_count
    value_heads: int = 0  # ssm.time_step_rank
    key_dim: int = 0  # ssm.state_size, per head
    value_dim: int = 0  # ssm.inner_size / value heads, per head
    recurrent: tuple[bool, ...] = ()  # per layer of the range

    @classmethod
    def from_gguf(cls, meta: dict[str, object], vocab_size: int, arch: str = "qwen35moe") -> ModelArgs:
        def number(key: str, default: float | None = None) -> float:
            return meta_number(meta, f"{arch}.{key}", default)

        base = qwen3moe.ModelArgs.from_gguf(meta, vocab_size, arch)
        heads = int(number("ssm.time_step_rank"))
        return cls(**dataclasses.asdict(base),
                   shared_intermediate_size=int(number("expert_shared_feed_forward_length", base.intermediate_size)),
                   conv_kernel=int(number("ssm.conv_kernel")), key_heads=int(number("ssm.group_count")),
                   value_heads=heads, key_dim=int(number("ssm.state_size")),
                   value_dim=int(number("ssm.inner_size")) // heads,
                   recurrent=tuple(_recurrent(meta, arch, base.num_hidden_layers)))


def _recurrent(meta: dict[str, object], arch: str, layers: int) -> list[bool]:
    """Which layers of the stage are delta-net, by the rule the package's cuts follow."""
    listed = meta.get(f"{arch}.attention.recurrent_layers")
    interval = meta.get(f"{arch}.full_attention_interval")
    plain = {f"{arch}.attention.recurrent_layers": None if listed is None else np.array(listed).tolist(),
             f"{arch}.full_attention_interval": None if interval is None else int(np.array(interval))}
    return recurrent_layers(arch, plain, layers)


class Vector(nn.Module):
    """A bare weight the graph uses other than as a matmul (a convolution, a bias, a gate)."""

    def __init__(self, *shape: int) -> None:
        super().__init__()
        self.weight = mx.zeros(shape)


class GatedAttention(qwen3.Attention):
    def __init__(self, args: llama.ModelArgs) -> None:
        super().__init__(args)
        self.q_proj = nn.Linear(args.hidden_size, 2 * self.n_heads * args.head_dim, bias=False)

    def __call__(self, x: mx.array, caches: list[KVCache]) -> mx.array:
        batch, rows, _ = x.shape
        both = self.q_proj(x).reshape(batch, rows, self.n_heads, 2, -1)  # per head: query, then gate
        q = self.q_norm(both[..., 0, :]).transpose(0, 2, 1, 3)
        k = self.k_norm(self.k_proj(x).reshape(batch, rows, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(batch, rows, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        outs = [self._attend(q[b : b + 1], k[b : b + 1], v[b : b + 1], cache) for b, cache in enumerate(caches)]
        out = mx.concatenate(outs, axis=0).transpose(0, 2, 1, 3).reshape(batch, rows, -1)
        return self.o_proj(out * mx.sigmoid(both[..., 1, :].reshape(batch, rows, -1)))


class GatedDeltaNet(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        keys, values = args.key_heads * args.key_dim, args.value_heads * args.value_dim
        self.in_proj_qkv = nn.Linear(args.hidden_size, 2 * keys + values, bias=False)
        self.in_proj_z = nn.Linear(args.hidden_size, values, bias=False)
        self.in_proj_b = nn.Linear(args.hidden_size, args.value_heads, bias=False)
        self.in_proj_a = nn.Linear(args.hidden_size, args.value_heads, bias=False)
        self.conv1d = Vector(2 * keys + values, args.conv_kernel)
        self.dt_bias = Vector(args.value_heads)
        self.A = Vector(args.value_heads)
        self.norm = nn.RMSNorm(args.value_dim, eps=args.rms_norm_eps)
        self.out_proj = nn.Linear(values, args.hidden_size, bias=False)

    def __call__(self, x: mx.array, caches: list[RecurrentCache]) -> mx.array:
        batch, rows, _ = x.shape
        mixed, beta = self.in_proj_qkv(x), mx.sigmoid(self.in_proj_b(x))
        decay = nn.softplus(self.in_proj_a(x) + self.dt_bias.weight) * self.A.weight  # log of the decay
        core = mx.stack([self._recur(Rows(c.offset, mixed[b], decay[b], beta[b]), c) for b, c in enumerate(caches)])
        z = self.in_proj_z(x).reshape(batch, rows, self.args.value_heads, -1)
        return self.out_proj((self.norm(core) * nn.silu(z)).reshape(batch, rows, -1))

    def _recur(self, new: Rows, cache: RecurrentCache) -> mx.array:
        """One session's rows through the convolution and the delta rule, after replaying
        the rows a rollback left pending; its output rows [n, value heads, value dim]."""
        a, held, pending = self.args, cache.held, cache.pending()
        replay = sum(len(r.conv) for r in pending)
        conv = mx.concatenate([r.conv for r in (*pending, new)])
        width = a.conv_kernel - 1
        before = held.conv if held.conv is not None else mx.zeros((width, conv.shape[1]), conv.dtype)
        window = mx.concatenate([before, conv])
        q, k, v = self._qkv(window)
        decay = mx.exp(mx.concatenate([r.decay for r in (*pending, new)]))
        beta = mx.concatenate([r.beta for r in (*pending, new)])
        state = held.ssm if held.ssm is not None else mx.zeros((a.value_heads, a.value_dim, a.key_dim), conv.dtype)
        start, out = state, []
        for t in range(len(conv)):
            if t == replay:
                start = state
            state = state * decay[t][:, None, None]
            delta = (v[t] - (state * k[t][:, None, :]).sum(-1)) * beta[t][:, None]
            state = state + delta[:, :, None] * k[t][:, None, :]
            if t >= replay:
                out.append((state * q[t][:, None, :]).sum(-1))
        end = new.start + len(new.conv)
        cache.commit(Checkpoint(new.start, window[replay : replay + width], start), new,
                     Checkpoint(end, window[len(window) - width :], state))
        return mx.stack(out)

    def _qkv(self, window: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """The convolution over `window` (kernel-1 earlier rows, then the rows), SiLU, and the
        heads: q (L2-normed, scaled) and k (L2-normed) per value head, and v."""
        a, weight = self.args, self.conv1d.weight
        n = len(window) - a.conv_kernel + 1
        conv = nn.silu(sum((window[j : j + n] * weight[:, j] for j in range(a.conv_kernel)), mx.zeros_like(window[:n])))
        keys = a.key_heads * a.key_dim
        repeat = (1, a.value_heads // a.key_heads, 1)  # value head h reads key head h % key heads
        q, k = (_l2_norm(conv[:, i * keys : (i + 1) * keys].reshape(n, a.key_heads, -1), a.rms_norm_eps)
                for i in (0, 1))
        v = conv[:, 2 * keys :].reshape(n, a.value_heads, -1)
        return mx.tile(q, repeat) * a.value_dim**-0.5, mx.tile(k, repeat), v


def _l2_norm(x: mx.array, eps: float) -> mx.array:
    return x * mx.rsqrt((x * x).sum(axis=-1, keepdims=True) + eps)


class SharedExpertMoe(qwen3moe.SparseMoeBlock):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args)
        self.shared_expert = llama.MLP(args.hidden_size, args.shared_intermediate_size)
        self.shared_expert_gate = Vector(args.hidden_size)

    def __call__(self, x: mx.array) -> mx.array:
        gate = mx.sigmoid(x @ self.shared_expert_gate.weight[:, None])
        return super().__call__(x) + self.shared_expert(x) * gate


class Block(nn.Module):
    def __init__(self, args: ModelArgs, recurrent: bool) -> None:
        super().__init__()
        self.recurrent = recurrent
        if recurrent:
            self.linear_attn = GatedDeltaNet(args)
        else:
            self.self_attn = GatedAttention(args)
        self.mlp = SharedExpertMoe(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, caches: list[LayerCache]) -> mx.array:
        # the caches are this layer's kind: make_caches follows the same `recurrent` flags
        mixer: nn.Module = self.linear_attn if self.recurrent else self.self_attn
        h = x + mixer(self.input_layernorm(x), caches)
        return h + self.mlp(self.post_attention_layernorm(h))


class Model(qwen3moe.Model):
    arch: ClassVar[str] = "qwen35moe"
    args_class: ClassVar[type[llama.ModelArgs]] = ModelArgs
    layer_names: ClassVar[dict[str, str]] = {
        **qwen3moe.Model.layer_names, "post_attention_norm": "post_attention_layernorm",
        "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
        "ffn_down_shexp": "mlp.shared_expert.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
        "attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z",
        "ssm_conv1d": "linear_attn.conv1d", "ssm_dt": "linear_attn.dt_bias", "ssm_a": "linear_attn.A",
        "ssm_beta": "linear_attn.in_proj_b", "ssm_alpha": "linear_attn.in_proj_a",
        "ssm_norm": "linear_attn.norm", "ssm_out": "linear_attn.out_proj"}

    def make_layer(self, args: llama.ModelArgs, index: int) -> nn.Module:
        assert isinstance(args, ModelArgs)
        return Block(args, args.recurrent[index])

    def make_caches(self) -> list[LayerCache]:
        assert isinstance(self.args, ModelArgs)
        return [RecurrentCache() if r else KVCache() for r in self.args.recurrent]


def _gguf_name(name: str) -> str:
    """`ssm_a` has no suffix and `ssm_dt` is a `.bias` (which the loader refuses elsewhere):
    both are plain vectors here, named `.weight` as every other tensor."""
    if name.endswith(".ssm_a"):
        return f"{name}.weight"
    return name.removesuffix(".ssm_dt.bias") + ".ssm_dt.weight" if name.endswith(".ssm_dt.bias") else name


def build(meta: dict[str, object], weights: dict[str, mx.array], first: bool, final: bool,
          dtype: mx.Dtype = mx.float32) -> Model:
    return load_range(Model, meta, {_gguf_name(n): w for n, w in weights.items()}, first, final, dtype)
