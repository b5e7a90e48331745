"""Tiny random-weight GGUFs of many architectures, for split and serving proofs without downloads.

Each writer follows its architecture's `load_arch_tensors` in the vendored llama.cpp
(`src/models/<arch>.cpp`): the tensor names come from `gguf.constants.MODEL_TENSORS` and the
shapes are what `create_tensor` checks. Per-layer counts are written as arrays, as converted
models of several families carry them, so a stage that keeps the whole array fails to load.
The vocabulary is SPM with byte tokens, so `mesh serve` can tokenize any text.
Gotchas: a `general.name` containing "phi3" makes the vocab loader look for `<|endoftext|>`;
gemma's token embeddings are multiplied by √width, so they are drawn small.
The recurrent and hybrid families (issue 43: mamba2, lfm2, granitehybrid, qwen35, qwen3next,
falcon-h1, nemotron_h in `WRITERS`) take their state's shapes from the
`ssm.*` keys, which must agree with the tensors; lfm2, granitehybrid and nemotron_h tell a
recurrent layer by 0 in the per-layer `attention.head_count_kv`, qwen35 and qwen3next by the index.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter, quants

LAYERS = 8
# The router MLX is compared on: llama.cpp quantizes the activations a Q8_0 matmul takes and MLX
# does not, so with a Q8_0 router their logits part by 0.2 where experts flip.
F32_ROUTER = GGMLQuantizationType.F32


@dataclass
class Tiny:
    """One model being written: its sizes, its random numbers, and the writer."""

    writer: GGUFWriter
    arch: str
    layers: int
    rng: np.random.Generator
    width: int = 64
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    ff: int = 128
    vocab: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    router: GGMLQuantizationType = GGMLQuantizationType.Q8_0

    def w(self, *shape: int, scale: float = 0.2) -> np.ndarray:
        return (self.rng.standard_normal(shape) * scale).astype(np.float32)

    def add(self, name: str, array: np.ndarray) -> None:
        if name.endswith(".ffn_gate_inp.weight") and self.router != GGMLQuantizationType.F32 \
                and array.shape[-1] % 32 == 0:
            # A router in Q8_0: ggml's F32 and F16 matmuls are not row-invariant on every CPU (on
            # AMD EPYC a 6-row window's router logits part from a single row's by 1e-7, and an
            # expert flips at a near tie), its Q8_0 matmul is, as the Q4_0 weights' are. Real MoE
            # GGUFs keep F32 routers (DESIGN.md §9), and so do the models MLX is compared on:
            # llama.cpp quantizes the activations a Q8_0 matmul takes, MLX does not.
            data = quants.quantize(np.ascontiguousarray(array, dtype=np.float32), self.router)
            self.writer.add_tensor(name, data, raw_dtype=self.router)
            return
        self.writer.add_tensor(name, array)

    def norm(self, name: str, n: int | None = None) -> None:
        self.add(name, 1 + self.w(n or self.width, scale=0.1))

    def key(self, suffix: str, value: Any, vtype: GGUFValueType | None = None) -> None:
        """`{arch}.suffix`; an int list becomes a per-layer UINT32 array."""
        if isinstance(value, list):
            self.writer.add_key_value(f"{self.arch}.{suffix}", value, GGUFValueType.ARRAY,
                                      sub_type=vtype or GGUFValueType.UINT32)
        else:
            self.writer.add_key_value(f"{self.arch}.{suffix}", value, vtype or _vtype(value))

    def set(self, suffix: str, value: Any, vtype: GGUFValueType | None = None) -> None:
        """Replace a key `_common` wrote (the writer refuses a duplicate)."""
        for kv in self.writer.kv_data:
            kv.pop(f"{self.arch}.{suffix}", None)
        self.key(suffix, value, vtype)

    def attention(self, i: int, q_norm: int = 0, k_norm: int = 0, bias: bool = False, q_gate: bool = False,
                  heads: tuple[int, int] | None = None) -> None:
        """Separate q, k, v and output projections; `q_norm`/`k_norm` the norms' lengths; with
        `q_gate`, attn_q carries an output gate as wide as the query (qwen35); `heads` this
        layer's (query, kv) head counts where they differ by layer."""
        n_q, n_kv = heads or (self.heads, self.kv_heads)
        q, kv = n_q * self.head_dim, n_kv * self.head_dim
        self.add(f"blk.{i}.attn_q.weight", self.w(2 * q if q_gate else q, self.width))
        self.add(f"blk.{i}.attn_k.weight", self.w(kv, self.width))
        self.add(f"blk.{i}.attn_v.weight", self.w(kv, self.width))
        self.add(f"blk.{i}.attn_output.weight", self.w(self.width, q))
        if bias:
            for name, n in (("q", q), ("k", kv), ("v", kv)):
                self.add(f"blk.{i}.attn_{name}.bias", self.w(n, scale=0.05))
        if q_norm:
            self.norm(f"blk.{i}.attn_q_norm.weight", q_norm)
        if k_norm:
            self.norm(f"blk.{i}.attn_k_norm.weight", k_norm)

    def swiglu(self, i: int, ff: int | None = None, suffix: str = "") -> None:
        n = ff or self.ff
        self.add(f"blk.{i}.ffn_gate{suffix}.weight", self.w(n, self.width))
        self.add(f"blk.{i}.ffn_up{suffix}.weight", self.w(n, self.width))
        self.add(f"blk.{i}.ffn_down{suffix}.weight", self.w(self.width, n))

    def experts(self, i: int, n_expert: int = 4, ff_exp: int = 32, bias: bool = False, suffix: str = "_exps") -> None:
        """A router and stacked experts: numpy shapes (n_expert, n_ff_exp, n_embd) as llama.cpp's
        {n_embd, n_ff_exp, n_expert}."""
        self.add(f"blk.{i}.ffn_gate_inp.weight", self.w(n_expert, self.width))
        self.add(f"blk.{i}.ffn_gate{suffix}.weight", self.w(n_expert, ff_exp, self.width))
        self.add(f"blk.{i}.ffn_up{suffix}.weight", self.w(n_expert, ff_exp, self.width))
        self.add(f"blk.{i}.ffn_down{suffix}.weight", self.w(n_expert, self.width, ff_exp))
        if bias:
            self.add(f"blk.{i}.ffn_gate_inp.bias", self.w(n_expert, scale=0.05))
            for name, n in (("gate", ff_exp), ("up", ff_exp), ("down", self.width)):
                self.add(f"blk.{i}.ffn_{name}{suffix}.bias", self.w(n_expert, n, scale=0.05))


def _vtype(value: Any) -> GGUFValueType:
    if isinstance(value, bool):
        return GGUFValueType.BOOL
    if isinstance(value, int):
        return GGUFValueType.UINT32
    if isinstance(value, float):
        return GGUFValueType.FLOAT32
    return GGUFValueType.STRING


def _common(t: Tiny) -> None:
    """Metadata every family reads, and the byte vocabulary."""
    t.key("context_length", 512)
    t.key("embedding_length", t.width)
    t.key("block_count", t.layers)
    t.key("feed_forward_length", [t.ff] * t.layers)
    t.key("attention.head_count", [t.heads] * t.layers)
    t.key("attention.head_count_kv", [t.kv_heads] * t.layers)
    t.key("attention.layer_norm_rms_epsilon", 1e-5)
    t.key("attention.key_length", t.head_dim)
    t.key("attention.value_length", t.head_dim)
    t.key("rope.dimension_count", t.head_dim)
    t.writer.add_file_type(0)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    t.vocab = len(tokens)
    t.writer.add_tokenizer_model("llama")
    t.writer.add_token_list(tokens)
    t.writer.add_token_scores([0.0] * t.vocab)
    t.writer.add_token_types([3, 3, 3] + [6] * 256)
    t.writer.add_bos_token_id(1)
    t.writer.add_eos_token_id(2)
    t.writer.add_unk_token_id(0)


def _head(t: Tiny, tied: bool = False, embd_scale: float = 0.2) -> None:
    t.add("token_embd.weight", t.w(t.vocab, t.width, scale=embd_scale))
    t.norm("output_norm.weight")
    if not tied:
        t.add("output.weight", t.w(t.vocab, t.width))


def _pre_norm_blocks(t: Tiny, ffn: Callable[[int], None], **attention: Any) -> None:
    """Each layer: attention norm, attention (`attention` its options), FFN norm, `ffn(i)`."""
    for i in range(t.layers):
        t.norm(f"blk.{i}.attn_norm.weight")
        t.attention(i, **attention)
        t.norm(f"blk.{i}.ffn_norm.weight")
        ffn(i)


def _llama(t: Tiny, embd_scale: float = 0.2) -> None:
    _head(t, embd_scale=embd_scale)
    _pre_norm_blocks(t, t.swiglu)


def _qwen3(t: Tiny) -> None:
    _head(t)
    _pre_norm_blocks(t, t.swiglu, q_norm=t.head_dim, k_norm=t.head_dim)


def _gemma3(t: Tiny) -> None:
    t.key("attention.sliding_window", 4)  # short, so the prompts reach past it
    _head(t, tied=True, embd_scale=0.02)
    for i in range(t.layers):
        t.norm(f"blk.{i}.attn_norm.weight")
        t.attention(i, q_norm=t.head_dim, k_norm=t.head_dim)
        t.norm(f"blk.{i}.post_attention_norm.weight")
        t.norm(f"blk.{i}.ffn_norm.weight")
        t.swiglu(i)
        t.norm(f"blk.{i}.post_ffw_norm.weight")


# --- dense families (issue 40) ---


def _qwen2(t: Tiny) -> None:
    _head(t)
    _pre_norm_blocks(t, t.swiglu, bias=True)


def _gemma2(t: Tiny) -> None:
    t.key("attention.sliding_window", 4)  # short, so the prompts reach past it
    t.key("attn_logit_softcapping", 50.0)
    t.key("final_logit_softcapping", 30.0)
    _head(t, tied=True, embd_scale=0.02)
    for i in range(t.layers):
        t.norm(f"blk.{i}.attn_norm.weight")
        t.attention(i)
        t.norm(f"blk.{i}.post_attention_norm.weight")
        t.norm(f"blk.{i}.ffn_norm.weight")
        t.swiglu(i)
        t.norm(f"blk.{i}.post_ffw_norm.weight")


def _phi3(t: Tiny) -> None:
    """Fused q/k/v and a fused gate+up of 2 * n_ff (phi3.cpp); q is n_embd wide."""
    _head(t)
    qkv = t.width + 2 * t.kv_heads * t.head_dim
    for i in range(t.layers):
        t.norm(f"blk.{i}.attn_norm.weight")
        t.add(f"blk.{i}.attn_qkv.weight", t.w(qkv, t.width))
        t.add(f"blk.{i}.attn_output.weight", t.w(t.width, t.width))
        t.norm(f"blk.{i}.ffn_norm.weight")
        t.add(f"blk.{i}.ffn_up.weight", t.w(2 * t.ff, t.width))
        t.add(f"blk.{i}.ffn_down.weight", t.w(t.width, t.ff))


def _olmo2(t: Tiny) -> None:
    """Norms after attention and FFN only; q/k norms over all heads (olmo2.cpp). With a sliding
    window (OLMo 3) every 4th layer is full attention, from the index."""
    t.key("attention.sliding_window", 4)
    _head(t)
    for i in range(t.layers):
        t.attention(i, q_norm=t.heads * t.head_dim, k_norm=t.kv_heads * t.head_dim)
        t.norm(f"blk.{i}.post_attention_norm.weight")
        t.swiglu(i)
        t.norm(f"blk.{i}.post_ffw_norm.weight")


def _granite(t: Tiny) -> None:
    t.key("logit_scale", 8.0)  # required by granite.cpp
    t.key("embedding_scale", 12.0)  # applied by build_inp_embd to hidden-state input too
    t.key("residual_scale", 0.22)
    t.key("attention.scale", 0.0625)
    _llama(t, embd_scale=0.05)


def _mistral3(t: Tiny) -> None:
    """Llama-shaped; the attention temperature grows with the position past original_context_length."""
    t.key("attention.temperature_scale", 0.5)
    t.key("rope.scaling.original_context_length", 8)
    _llama(t)


def _moe_keys(t: Tiny, n_expert: int = 4, used: int = 2, ff_exp: int = 32) -> None:
    """Expert counts; the used count and expert FFN length per layer, as arrays."""
    t.key("expert_count", n_expert)
    t.key("expert_used_count", [used] * t.layers)
    t.key("expert_feed_forward_length", [ff_exp] * t.layers)


def _qwen3moe(t: Tiny) -> None:
    _moe_keys(t)
    _head(t)
    _pre_norm_blocks(t, t.experts, q_norm=t.head_dim, k_norm=t.head_dim)


def _gpt_oss(t: Tiny) -> None:
    _moe_keys(t)
    t.key("attention.sliding_window", 4)  # short, so the prompts reach past it
    _head(t)
    for i in range(t.layers):
        t.norm(f"blk.{i}.attn_norm.weight")
        t.attention(i, bias=True)
        t.add(f"blk.{i}.attn_output.bias", t.w(t.width, scale=0.05))
        t.add(f"blk.{i}.attn_sinks.weight", t.w(t.heads, scale=1.0))
        t.norm(f"blk.{i}.post_attention_norm.weight")
        t.experts(i, bias=True)


def _shared_experts(t: Tiny, i: int, ff: int) -> None:
    t.add(f"blk.{i}.ffn_gate_shexp.weight", t.w(ff, t.width))
    t.add(f"blk.{i}.ffn_up_shexp.weight", t.w(ff, t.width))
    t.add(f"blk.{i}.ffn_down_shexp.weight", t.w(t.width, ff))


def _nextn(t: Tiny, i: int) -> None:
    """The multi-token-prediction tensors of layer i, past the main stack."""
    t.add(f"blk.{i}.nextn.eh_proj.weight", t.w(t.width, 2 * t.width))
    t.norm(f"blk.{i}.nextn.enorm.weight")
    t.norm(f"blk.{i}.nextn.hnorm.weight")
    t.norm(f"blk.{i}.nextn.shared_head_norm.weight")


def _deepseek2(t: Tiny) -> None:
    """MLA (q and kv low-rank, absorbed k_b/v_b), 2 leading dense blocks, a shared expert, and one
    nextn layer: the main stack is `t.layers`, block_count one more."""
    q_rank, kv_rank, rope, nope, v_mla, lead = 32, 32, 16, 32, 32, 2
    blocks = t.layers + 1
    t.layers = blocks  # the per-layer arrays cover the nextn layer too
    _moe_keys(t)
    t.layers = blocks - 1
    t.set("block_count", blocks)
    t.set("feed_forward_length", [t.ff] * blocks)
    t.set("attention.head_count", [t.heads] * blocks)
    t.set("attention.head_count_kv", [1] * blocks)  # MLA is MQA over the compressed kv
    t.set("attention.key_length", kv_rank + rope)
    t.set("attention.value_length", kv_rank)
    t.set("rope.dimension_count", rope)
    t.key("nextn_predict_layers", 1)
    t.key("leading_dense_block_count", lead)
    t.key("expert_shared_count", 1)
    t.key("expert_weights_scale", 1.0)
    t.key("attention.q_lora_rank", q_rank)
    t.key("attention.kv_lora_rank", kv_rank)
    t.key("attention.key_length_mla", nope + rope)
    t.key("attention.value_length_mla", v_mla)
    t.key("vocab_size", t.vocab)
    _head(t)
    for i in range(blocks):
        t.norm(f"blk.{i}.attn_norm.weight")
        t.add(f"blk.{i}.attn_q_a.weight", t.w(q_rank, t.width))
        t.norm(f"blk.{i}.attn_q_a_norm.weight", q_rank)
        t.add(f"blk.{i}.attn_q_b.weight", t.w(t.heads * (nope + rope), q_rank))
        t.add(f"blk.{i}.attn_kv_a_mqa.weight", t.w(kv_rank + rope, t.width))
        t.norm(f"blk.{i}.attn_kv_a_norm.weight", kv_rank)
        t.add(f"blk.{i}.attn_k_b.weight", t.w(t.heads, kv_rank, nope))
        t.add(f"blk.{i}.attn_v_b.weight", t.w(t.heads, v_mla, kv_rank))
        t.add(f"blk.{i}.attn_output.weight", t.w(t.width, t.heads * v_mla))
        t.norm(f"blk.{i}.ffn_norm.weight")
        _lead_dense_then_moe(t, i, lead)


def _lead_dense_then_moe(t: Tiny, i: int, lead: int) -> None:
    """Layer i's FFN in deepseek2 and glm4moe: dense for the `lead` first layers, else routed
    experts with a selection bias and a shared expert; past the main stack, the nextn block too."""
    if i < lead:
        t.swiglu(i)
    else:
        t.experts(i)
        t.add(f"blk.{i}.exp_probs_b.bias", t.w(4, scale=0.05))
        _shared_experts(t, i, 32)
    if i >= t.layers:
        _nextn(t, i)


def _llama4(t: Tiny) -> None:
    """MoE (with a shared expert) every 2nd layer; chunked attention on 3 of 4 layers and no RoPE
    on every 4th (at llama.cpp's fixed 8192-token chunk, which these prompts do not reach)."""
    _moe_keys(t)
    t.key("interleave_moe_layer_step", 2)
    _head(t)
    for i in range(t.layers):
        t.norm(f"blk.{i}.attn_norm.weight")
        t.attention(i)
        t.norm(f"blk.{i}.ffn_norm.weight")
        if (i + 1) % 2 == 0:
            t.experts(i)
            _shared_experts(t, i, 32)
        else:
            t.swiglu(i)


def _glm4moe(t: Tiny) -> None:
    """1 leading dense block, MoE with a shared expert after it, one nextn layer past the main
    stack, q/k/v biases and q/k norms, RoPE on half the head (GLM-4.5 converted text-only: no
    rope.dimension_sections)."""
    lead = 1
    blocks = t.layers + 1
    t.layers = blocks  # the per-layer arrays cover the nextn layer too
    _moe_keys(t)
    t.layers = blocks - 1
    t.set("block_count", blocks)
    t.set("feed_forward_length", [t.ff] * blocks)
    t.set("attention.head_count", [t.heads] * blocks)
    t.set("attention.head_count_kv", [t.kv_heads] * blocks)
    t.set("rope.dimension_count", t.head_dim // 2)
    t.key("nextn_predict_layers", 1)
    t.key("leading_dense_block_count", lead)
    t.key("expert_shared_count", 1)
    t.key("expert_weights_scale", 2.5)
    t.key("expert_weights_norm", True)
    t.key("expert_gating_func", 2)  # sigmoid, as the converter writes it
    _head(t)
    for i in range(blocks):
        t.norm(f"blk.{i}.attn_norm.weight")
        t.attention(i, q_norm=t.head_dim, k_norm=t.head_dim, bias=True)
        t.norm(f"blk.{i}.post_attention_norm.weight")
        _lead_dense_then_moe(t, i, lead)


# --- recurrent and hybrid families (issue 43) ---


def _ssm_keys(t: Tiny, inner: int, state: int, groups: int, heads: int, conv: int = 4) -> None:
    """The SSM widths load_arch_tensors derives every recurrent tensor's shape from."""
    t.key("ssm.conv_kernel", conv)
    t.key("ssm.inner_size", inner)
    t.key("ssm.state_size", state)
    t.key("ssm.group_count", groups)
    t.key("ssm.time_step_rank", heads)


def _recurrent_kv(t: Tiny, attention: Callable[[int], bool]) -> None:
    """lfm2 and granitehybrid mark a recurrent layer by 0 KV heads."""
    t.set("attention.head_count_kv", [t.kv_heads if attention(i) else 0 for i in range(t.layers)])


def _mamba2_mixer(t: Tiny, i: int) -> None:
    """One Mamba-2 block (mamba2.cpp, granite-hybrid.cpp): d_inner 2 * width, one group, 8 heads,
    state 16, conv kernel 4 (the keys `_mamba2_keys` writes)."""
    inner, state, groups, heads, conv = 2 * t.width, 16, 1, 8, 4
    xbc = inner + 2 * groups * state
    t.add(f"blk.{i}.ssm_in.weight", t.w(inner + xbc + heads, t.width))
    t.add(f"blk.{i}.ssm_conv1d.weight", t.w(xbc, conv))
    t.add(f"blk.{i}.ssm_conv1d.bias", t.w(xbc, scale=0.05))
    t.add(f"blk.{i}.ssm_dt.bias", t.w(heads, scale=0.05))
    t.add(f"blk.{i}.ssm_a", -np.exp(t.w(heads, 1)))  # A < 0: the state decays
    t.add(f"blk.{i}.ssm_d", t.w(heads, 1))
    t.norm(f"blk.{i}.ssm_norm.weight", inner)
    t.add(f"blk.{i}.ssm_out.weight", t.w(t.width, inner))


def _mamba2_keys(t: Tiny) -> None:
    _ssm_keys(t, inner=2 * t.width, state=16, groups=1, heads=8)


def _mamba2(t: Tiny) -> None:
    """Pure recurrent: a norm and a Mamba-2 mixer per layer, no FFN, no attention."""
    _mamba2_keys(t)
    _head(t)
    for i in range(t.layers):
        t.norm(f"blk.{i}.attn_norm.weight")
        _mamba2_mixer(t, i)


def _lfm2(t: Tiny) -> None:
    """Short convolutions, with attention (q/k norms, q n_embd wide) on every 3rd layer; the output
    norm is named token_embd_norm (lfm2.cpp)."""
    _lfm2_layers(t, t.swiglu)


def _lfm2_layers(t: Tiny, ffn: Callable[[int], None]) -> None:
    """lfm2's stack (lfm2.cpp, also lfm2moe's graph), with `ffn` writing a layer's FFN."""
    conv = 3
    t.key("shortconv.l_cache", conv)
    _recurrent_kv(t, lambda i: i % 3 == 2)
    t.add("token_embd.weight", t.w(t.vocab, t.width))
    t.norm("token_embd_norm.weight")
    for i in range(t.layers):
        t.norm(f"blk.{i}.attn_norm.weight")
        if i % 3 == 2:
            t.attention(i, q_norm=t.head_dim, k_norm=t.head_dim)
        else:
            t.add(f"blk.{i}.shortconv.conv.weight", t.w(t.width, conv))
            t.add(f"blk.{i}.shortconv.in_proj.weight", t.w(3 * t.width, t.width))
            t.add(f"blk.{i}.shortconv.out_proj.weight", t.w(t.width, t.width))
        t.norm(f"blk.{i}.ffn_norm.weight")
        ffn(i)


# --- hyb: lfm2moe ---
def _lfm2moe(t: Tiny) -> None:
    """lfm2's layers with a dense FFN where il < leading_dense_block_count (4) and sigmoid-gated
    experts with a selection bias past it (lfm2moe.cpp, lfm2.cpp's graph)."""
    lead = 4
    t.key("leading_dense_block_count", lead)
    t.key("expert_count", 4)
    t.key("expert_used_count", 2)
    t.key("expert_feed_forward_length", 32)
    t.key("expert_gating_func", 2)  # sigmoid, as LFM2-8B-A1B

    def ffn(i: int) -> None:
        if i < lead:
            t.swiglu(i)
            return
        t.experts(i)
        t.add(f"blk.{i}.exp_probs_b.bias", t.w(4, scale=0.05))

    _lfm2_layers(t, ffn)
# --- end hyb ---


def _granitehybrid(t: Tiny) -> None:
    """Mamba-2 mixers with attention on every 4th layer, each with a dense FFN, and Granite's scales
    (granite-hybrid.cpp): the embedding scale, which build_inp_embd applies to hidden-state input too."""
    t.key("logit_scale", 8.0)
    t.key("embedding_scale", 12.0)
    t.key("residual_scale", 0.22)
    _mamba2_keys(t)
    _recurrent_kv(t, lambda i: (i + 1) % 4 == 0)
    _head(t, embd_scale=0.05)
    _attention_every_4th(t, _mamba2_mixer, t.swiglu)


def _attention_every_4th(t: Tiny, mixer: Callable[[Tiny, int], None], ffn: Callable[[int], None]) -> None:
    """Pre-norm blocks of a recurrent `mixer`, attention where (il + 1) % 4 == 0, each then `ffn`."""
    for i in range(t.layers):
        t.norm(f"blk.{i}.attn_norm.weight")
        if (i + 1) % 4 == 0:
            t.attention(i)
        else:
            mixer(t, i)
        t.norm(f"blk.{i}.ffn_norm.weight")
        ffn(i)


def _gated_delta_hybrid(t: Tiny, ffn: Callable[[int], None], fused_beta_alpha: bool) -> None:
    """Gated delta-net layers, with gated attention (attn_q twice as wide: query and gate) where
    (il + 1) % full_attention_interval == 0 (qwen35.cpp, qwen3next.cpp): 2 key heads and 4 value
    heads of 16; beta and alpha one tensor (ssm_ba) in qwen3next, two in qwen35."""
    state, k_heads, v_heads, conv = 16, 2, 4, 4
    key_dim, value_dim = state * k_heads, state * v_heads
    _ssm_keys(t, inner=value_dim, state=state, groups=k_heads, heads=v_heads, conv=conv)
    t.key("full_attention_interval", 4)
    _head(t)
    for i in range(t.layers):
        t.norm(f"blk.{i}.attn_norm.weight")
        t.norm(f"blk.{i}.post_attention_norm.weight")
        if (i + 1) % 4 == 0:
            t.attention(i, q_norm=t.head_dim, k_norm=t.head_dim, q_gate=True)
        else:
            t.add(f"blk.{i}.attn_qkv.weight", t.w(2 * key_dim + value_dim, t.width))
            t.add(f"blk.{i}.attn_gate.weight", t.w(value_dim, t.width))
            t.add(f"blk.{i}.ssm_conv1d.weight", t.w(2 * key_dim + value_dim, conv))
            t.add(f"blk.{i}.ssm_dt.bias", t.w(v_heads, scale=0.05))
            t.add(f"blk.{i}.ssm_a", -np.exp(t.w(v_heads)))
            if fused_beta_alpha:
                t.add(f"blk.{i}.ssm_ba.weight", t.w(2 * v_heads, t.width))
            else:
                t.add(f"blk.{i}.ssm_beta.weight", t.w(v_heads, t.width))
                t.add(f"blk.{i}.ssm_alpha.weight", t.w(v_heads, t.width))
            t.norm(f"blk.{i}.ssm_norm.weight", state)
            t.add(f"blk.{i}.ssm_out.weight", t.w(t.width, value_dim))
        ffn(i)


def _qwen35(t: Tiny) -> None:
    """Gated delta-net and gated attention layers, and one MTP block past the main stack."""
    t.key("rope.dimension_sections", [4, 2, 2, 0], GGUFValueType.INT32)  # required by qwen35.cpp
    _gated_delta_hybrid(t, t.swiglu, fused_beta_alpha=False)
    _mtp_block(t, t.swiglu)


def _mtp_block(t: Tiny, ffn: Callable[[int], None]) -> None:
    """One MTP (nextn) block after the `t.layers` of the main stack, as qwen35.cpp's and
    qwen35moe.cpp's `load_block_mtp` read it: a full-attention layer with the output gate and q/k
    norms, the layer's FFN, and the nextn projection and norms. block_count counts it, and every
    per-layer array covers it (`get_key_or_arr(..., n_layer_all)`), its entry the last layer's.
    Written after the main stack's tensors, so the main stack's random weights are those it had
    without it."""
    i = t.layers
    per_layer = {f"{t.arch}.{suffix}" for suffix in ("feed_forward_length", "attention.head_count",
                                                     "attention.head_count_kv", "expert_used_count",
                                                     "expert_feed_forward_length")}
    for kv in t.writer.kv_data:
        for key in per_layer & kv.keys():
            kv[key] = replace(kv[key], value=[*kv[key].value, kv[key].value[-1]])
    t.set("block_count", i + 1)
    t.key("nextn_predict_layers", 1)
    t.norm(f"blk.{i}.attn_norm.weight")
    t.norm(f"blk.{i}.post_attention_norm.weight")
    t.attention(i, q_norm=t.head_dim, k_norm=t.head_dim, q_gate=True)
    ffn(i)
    _nextn(t, i)


def _gated_shared_moe(t: Tiny) -> Callable[[int], None]:
    """Every layer MoE with a shared expert gated by a sigmoid of an n_embd vector (qwen3next.cpp,
    qwen35moe.cpp): the keys, and the writer of layer i's FFN."""
    _moe_keys(t)
    t.key("expert_shared_feed_forward_length", 32)

    def ffn(i: int) -> None:
        t.experts(i)
        t.norm(f"blk.{i}.ffn_gate_inp_shexp.weight")
        _shared_experts(t, i, 32)

    return ffn


def _qwen3next(t: Tiny) -> None:
    _gated_delta_hybrid(t, _gated_shared_moe(t), fused_beta_alpha=True)


def _qwen35moe(t: Tiny) -> None:
    """qwen35's layers (beta and alpha apart, M-RoPE sections required) with qwen3next's MoE FFN,
    and one MTP block past the main stack."""
    t.key("rope.dimension_sections", [4, 2, 2, 0], GGUFValueType.INT32)
    ffn = _gated_shared_moe(t)
    _gated_delta_hybrid(t, ffn, fused_beta_alpha=False)
    _mtp_block(t, ffn)


def _nemotron_h(t: Tiny) -> None:
    """Each layer one of a Mamba-2 mixer (0 KV heads and 0 FFN), attention (0 FFN) or a squared-ReLU
    up/down FFN (nemotron-h.cpp), here mixer, FFN, mixer, attention, repeated; a norm before each."""
    def ffn(i: int) -> None:
        t.add(f"blk.{i}.ffn_up.weight", t.w(t.ff, t.width))
        t.add(f"blk.{i}.ffn_down.weight", t.w(t.width, t.ff))

    _nemotron_h_layers(t, ffn)


# --- hyb: nemotron_h_moe ---
def _nemotron_h_moe(t: Tiny) -> None:
    """nemotron_h's layers (its loader and graph, models.h) with a routed FFN where an FFN layer
    is: sigmoid-gated experts with a selection bias and no gate, and a shared expert, all up/down."""
    _moe_keys(t)
    t.key("expert_shared_feed_forward_length", 32)
    t.key("expert_weights_norm", True)
    t.key("expert_weights_scale", 1.0)

    def ffn(i: int) -> None:
        t.add(f"blk.{i}.ffn_gate_inp.weight", t.w(4, t.width))
        t.add(f"blk.{i}.exp_probs_b.bias", t.w(4, scale=0.05))
        t.add(f"blk.{i}.ffn_up_exps.weight", t.w(4, 32, t.width))
        t.add(f"blk.{i}.ffn_down_exps.weight", t.w(4, t.width, 32))
        t.add(f"blk.{i}.ffn_up_shexp.weight", t.w(32, t.width))
        t.add(f"blk.{i}.ffn_down_shexp.weight", t.w(t.width, 32))

    _nemotron_h_layers(t, ffn)
# --- end hyb ---


# --- hyb: jamba ---
def _mamba1_mixer(t: Tiny, i: int, dt_rank: int = 4, state: int = 16, conv: int = 4, norms: bool = True) -> None:
    """One Mamba-1 block, with jamba's dt/B/C norms unless `norms` is off (mamba.cpp has none):
    d_inner 2 * width (asserted)."""
    inner = 2 * t.width
    t.add(f"blk.{i}.ssm_in.weight", t.w(2 * inner, t.width))
    t.add(f"blk.{i}.ssm_conv1d.weight", t.w(inner, conv))
    t.add(f"blk.{i}.ssm_conv1d.bias", t.w(inner, scale=0.05))
    t.add(f"blk.{i}.ssm_x.weight", t.w(dt_rank + 2 * state, inner))
    if norms:  # in jamba's order of draws, so its tiny model is unchanged
        t.norm(f"blk.{i}.ssm_dt_norm.weight", dt_rank)
    t.add(f"blk.{i}.ssm_dt.weight", t.w(inner, dt_rank))
    t.add(f"blk.{i}.ssm_dt.bias", t.w(inner, scale=0.05))
    if norms:
        t.norm(f"blk.{i}.ssm_b_norm.weight", state)
        t.norm(f"blk.{i}.ssm_c_norm.weight", state)
    t.add(f"blk.{i}.ssm_a", -np.exp(t.w(inner, state)))  # A < 0: the state decays
    t.add(f"blk.{i}.ssm_d", t.w(inner))
    t.add(f"blk.{i}.ssm_out.weight", t.w(t.width, inner))


def _jamba(t: Tiny) -> None:
    """Mamba-1 mixers with attention (no RoPE) where head_count_kv is not 0, here every 4th layer,
    and an FFN dense or MoE by the router's presence, here MoE on odd layers (jamba.cpp)."""
    for key, value in (("ssm.conv_kernel", 4), ("ssm.inner_size", 2 * t.width), ("ssm.state_size", 16),
                       ("ssm.time_step_rank", 4), ("expert_count", 4), ("expert_used_count", 2)):
        t.key(key, value)
    _recurrent_kv(t, lambda i: (i + 1) % 4 == 0)
    _head(t)
    _attention_every_4th(t, _mamba1_mixer, lambda i: t.experts(i, ff_exp=t.ff) if i % 2 else t.swiglu(i))
# --- end hyb ---


def _mamba(t: Tiny) -> None:
    """Pure recurrent: a norm and a Mamba-1 mixer per layer, without dt/B/C norms (mamba.cpp)."""
    _ssm_keys(t, inner=2 * t.width, state=16, groups=0, heads=4)
    _head(t)
    for i in range(t.layers):
        t.norm(f"blk.{i}.attn_norm.weight")
        _mamba1_mixer(t, i, norms=False)


# --- RWKV (recurrent): wkv state and token shift, no KV cache ---
_WKV_HEAD = 16  # head_size: 4 heads of a 64-wide model
_RWKV6_EXTRA = 8  # the width of RWKV-6's time-mix and decay LoRAs


def _rwkv_keys(t: Tiny, shift: int, head: int = _WKV_HEAD) -> None:
    t.key("wkv.head_size", head)
    t.key("token_shift_count", shift)
    t.key("attention.layer_norm_epsilon", 1e-5)


def _rwkv6_keys(t: Tiny, shift: int) -> None:
    _rwkv_keys(t, shift)
    t.key("time_mix_extra_dim", _RWKV6_EXTRA)
    t.key("time_decay_extra_dim", _RWKV6_EXTRA)


def _layer_norm_pair(t: Tiny, name: str) -> None:
    t.norm(f"{name}.weight")
    t.add(f"{name}.bias", t.w(t.width, scale=0.05))


def _rwkv6_time_mix(t: Tiny, i: int, kv: int, first: bool) -> None:
    """RWKV-6 time mixing (rwkv6-base.cpp): fused lerps, a decay LoRA; with `first` (RWKV-6 proper)
    the bonus time_mix_first and a group norm, without it (QRWKV-6) gated linear attention."""
    extra = _RWKV6_EXTRA
    p = f"blk.{i}.time_mix"
    t.add(f"{p}_w1.weight", t.w(extra * 5, t.width))
    t.add(f"{p}_w2.weight", t.w(5, t.width, extra))
    t.add(f"{p}_lerp_x.weight", t.w(1, 1, t.width))
    t.add(f"{p}_lerp_fused.weight", t.w(5, 1, 1, t.width))
    if first:
        t.add(f"{p}_first.weight", t.w(t.width // _WKV_HEAD, _WKV_HEAD))
    t.add(f"{p}_decay.weight", t.w(t.width))
    t.add(f"{p}_decay_w1.weight", t.w(extra, t.width))
    t.add(f"{p}_decay_w2.weight", t.w(t.width, extra))
    for name, rows in (("key", kv), ("value", kv), ("receptance", t.width), ("gate", t.width)):
        t.add(f"{p}_{name}.weight", t.w(rows, t.width))
    if first:
        _layer_norm_pair(t, f"{p}_ln")
    t.add(f"{p}_output.weight", t.w(t.width, t.width))


def _rwkv6(t: Tiny) -> None:
    """RWKV-6: a LayerNorm on the embeddings (token_embd_norm), LayerNorm blocks of time and channel
    mixing, two token shifts a layer, half the residual every 2nd layer (rwkv6.cpp)."""
    _rwkv6_keys(t, 2)
    t.key("rescale_every_n_layers", 2)
    t.set("attention.head_count_kv", [0] * t.layers)  # no grouped keys (rwkv6-base.cpp reads n_head_kv)
    t.add("token_embd.weight", t.w(t.vocab, t.width))
    _layer_norm_pair(t, "token_embd_norm")
    for i in range(t.layers):
        _layer_norm_pair(t, f"blk.{i}.attn_norm")
        _layer_norm_pair(t, f"blk.{i}.attn_norm_2")
        _rwkv6_time_mix(t, i, t.width, first=True)
        t.add(f"blk.{i}.channel_mix_lerp_k.weight", t.w(1, 1, t.width))
        t.add(f"blk.{i}.channel_mix_lerp_r.weight", t.w(1, 1, t.width))
        t.add(f"blk.{i}.channel_mix_key.weight", t.w(t.ff, t.width))
        t.add(f"blk.{i}.channel_mix_value.weight", t.w(t.width, t.ff))
        t.add(f"blk.{i}.channel_mix_receptance.weight", t.w(t.width, t.width))
    _layer_norm_pair(t, "output_norm")
    t.add("output.weight", t.w(t.vocab, t.width))


def _rwkv6qwen2(t: Tiny) -> None:
    """QRWKV-6: RMS-normed blocks of RWKV-6 time mixing without time_mix_first (gated linear
    attention, 2 KV heads for 4) and a SwiGLU FFN, one token shift a layer (rwkv6qwen2.cpp)."""
    _rwkv6_keys(t, 1)
    _head(t)
    for i in range(t.layers):
        t.norm(f"blk.{i}.attn_norm.weight")
        _rwkv6_time_mix(t, i, t.kv_heads * _WKV_HEAD, first=False)
        t.norm(f"blk.{i}.ffn_norm.weight")
        t.swiglu(i)


# attention.{name}_lora_rank; load_arch_tensors gives layer 0's unused value LoRA the iclr rank, so a
# stage starting past it loads only where the two are equal, as here: a cut then parts by v_first alone
_RWKV7_LORA = {"decay": 8, "iclr": 8, "value_residual_mix": 8, "gate": 8}


def _rwkv7_keys(t: Tiny, shift: int) -> None:
    # one head as wide as the model: with heads of 16, ggml's CPU wkv7 gave NaN or varying logits
    # by ubatch size and run (measured), with heads of 64, as RWKV-7 models have, it is exact
    _rwkv_keys(t, shift, head=t.width)
    for name, rank in _RWKV7_LORA.items():
        t.key(f"attention.{name}_lora_rank", rank)


def _rwkv7_time_mix(t: Tiny, i: int, ln: bool) -> None:
    """RWKV-7 time mixing (rwkv7-base.cpp): decay, in-context rate, value-residual and gate LoRAs;
    layer 0's value LoRA is iclr-wide and unused, every later layer mixes in layer 0's value
    (v_first)."""
    p, lora = f"blk.{i}.time_mix", _RWKV7_LORA
    value_rank = lora["iclr"] if i == 0 else lora["value_residual_mix"]
    for name, rank in (("w", lora["decay"]), ("a", lora["iclr"]), ("v", value_rank)):
        t.add(f"{p}_{name}0.weight", t.w(t.width))
        t.add(f"{p}_{name}1.weight", t.w(rank, t.width))
        t.add(f"{p}_{name}2.weight", t.w(t.width, rank))
    t.add(f"{p}_g1.weight", t.w(lora["gate"], t.width))
    t.add(f"{p}_g2.weight", t.w(t.width, lora["gate"]))
    t.add(f"{p}_lerp_fused.weight", t.w(6, 1, 1, t.width))
    for name in ("k_k", "k_a", "r_k"):
        t.add(f"{p}_{name}.weight", t.w(t.width))
    for name in ("key", "value", "receptance"):
        t.add(f"{p}_{name}.weight", t.w(t.width, t.width))
    if ln:
        _layer_norm_pair(t, f"{p}_ln")
    t.add(f"{p}_output.weight", t.w(t.width, t.width))


def _rwkv7(t: Tiny) -> None:
    """RWKV-7: a LayerNorm on the embeddings, LayerNorm blocks of time and channel mixing, two token
    shifts a layer (rwkv7.cpp)."""
    _rwkv7_keys(t, 2)
    t.add("token_embd.weight", t.w(t.vocab, t.width))
    _layer_norm_pair(t, "token_embd_norm")
    for i in range(t.layers):
        _layer_norm_pair(t, f"blk.{i}.attn_norm")
        _layer_norm_pair(t, f"blk.{i}.attn_norm_2")
        _rwkv7_time_mix(t, i, ln=True)
        t.add(f"blk.{i}.channel_mix_lerp_k.weight", t.w(1, 1, t.width))
        t.add(f"blk.{i}.channel_mix_key.weight", t.w(t.ff, t.width))
        t.add(f"blk.{i}.channel_mix_value.weight", t.w(t.width, t.ff))
    _layer_norm_pair(t, "output_norm")
    t.add("output.weight", t.w(t.vocab, t.width))


def _arwkv7(t: Tiny) -> None:
    """ARWKV-7: RMS-normed blocks of RWKV-7 time mixing (gated, with its group norm) and a SwiGLU
    FFN, one token shift a layer (arwkv7.cpp)."""
    _rwkv7_keys(t, 1)
    _head(t)
    for i in range(t.layers):
        t.norm(f"blk.{i}.attn_norm.weight")
        _rwkv7_time_mix(t, i, ln=True)
        t.norm(f"blk.{i}.ffn_norm.weight")
        t.swiglu(i)


def _plamo2_mamba(t: Tiny, i: int, inner: int, state: int, heads: int, conv: int) -> None:
    """PLaMo-2's Mamba mixer (plamo2.cpp): a scan with one A and D per head, dt/B/C RMS norms
    named without `.weight`, no conv bias, no groups."""
    dt_dim = max(64, t.width // 16)
    t.add(f"blk.{i}.ssm_in.weight", t.w(2 * inner, t.width))
    t.add(f"blk.{i}.ssm_conv1d.weight", t.w(inner, conv))
    t.add(f"blk.{i}.ssm_x.weight", t.w(dt_dim + 2 * state, inner))
    t.add(f"blk.{i}.ssm_dt.weight", t.w(heads, dt_dim))
    t.add(f"blk.{i}.ssm_dt.bias", t.w(heads, scale=0.05))
    t.add(f"blk.{i}.ssm_a", -np.exp(t.w(heads)))  # A < 0: the state decays
    t.add(f"blk.{i}.ssm_d", t.w(heads))
    t.add(f"blk.{i}.ssm_out.weight", t.w(t.width, inner))
    t.norm(f"blk.{i}.ssm_dt_norm", dt_dim)
    t.norm(f"blk.{i}.ssm_b_norm", state)
    t.norm(f"blk.{i}.ssm_c_norm", state)


def _plamo2(t: Tiny) -> None:
    """Mamba mixers, with attention (fused QKV, per-head q/k norms, RoPE) where head_count_kv is not 0,
    here every 4th layer; post-mixer and post-FFN norms, an up-gate FFN (plamo2.cpp)."""
    inner, state, heads, conv = 2 * t.width, 16, 8, 4
    _ssm_keys(t, inner=inner, state=state, groups=0, heads=heads, conv=conv)
    _recurrent_kv(t, lambda i: (i + 1) % 4 == 0)
    _head(t)
    for i in range(t.layers):
        t.norm(f"blk.{i}.attn_norm.weight")
        if (i + 1) % 4 == 0:
            q, kv = t.heads * t.head_dim, t.kv_heads * t.head_dim
            t.add(f"blk.{i}.attn_qkv.weight", t.w(q + 2 * kv, t.width))
            t.add(f"blk.{i}.attn_q_norm.weight", 1 + t.w(t.heads, t.head_dim, scale=0.1))
            t.add(f"blk.{i}.attn_k_norm.weight", 1 + t.w(t.kv_heads, t.head_dim, scale=0.1))
            t.add(f"blk.{i}.attn_output.weight", t.w(t.width, q))
        else:
            _plamo2_mamba(t, i, inner, state, heads, conv)
        t.norm(f"blk.{i}.post_attention_norm")
        t.norm(f"blk.{i}.ffn_norm.weight")
        t.add(f"blk.{i}.ffn_up.weight", t.w(2 * t.ff, t.width))
        t.add(f"blk.{i}.ffn_down.weight", t.w(t.width, t.ff))
        t.norm(f"blk.{i}.post_ffw_norm")


# --- hyb: bailingmoe3 ---
def _kda(t: Tiny, i: int, head_dim: int = 16, conv: int = 4) -> None:
    """One Kimi delta-attention layer (bailingmoe3.cpp): q, k, v each through a short conv, a gate
    and an output gate, d_inner = head_count * kda.head_dim."""
    inner = t.heads * head_dim
    for x in "qkv":
        t.add(f"blk.{i}.ssm_conv1d_{x}.weight", t.w(1, inner, 1, conv))
        t.add(f"blk.{i}.attn_{x}.weight", t.w(inner, t.width))
    t.add(f"blk.{i}.ssm_f_a.weight", t.w(inner, t.width))
    t.add(f"blk.{i}.ssm_beta.weight", t.w(t.heads, t.width))
    t.add(f"blk.{i}.ssm_a", t.w(t.heads, 1))
    t.add(f"blk.{i}.ssm_dt.bias", t.w(inner, scale=0.05))
    t.add(f"blk.{i}.ssm_g_a.weight", t.w(inner, t.width))
    t.norm(f"blk.{i}.ssm_norm.weight", head_dim)
    t.add(f"blk.{i}.attn_output.weight", t.w(t.width, inner))


def _gated_mla(t: Tiny, i: int, kv_rank: int, rope: int, nope: int, v_mla: int) -> None:
    """bailingmoe3's attention: MLA without a q LoRA, with a sigmoid gate per head (attn_gate)."""
    t.add(f"blk.{i}.attn_q.weight", t.w(t.heads * (nope + rope), t.width))
    t.add(f"blk.{i}.attn_kv_a_mqa.weight", t.w(kv_rank + rope, t.width))
    t.norm(f"blk.{i}.attn_kv_a_norm.weight", kv_rank)
    t.add(f"blk.{i}.attn_k_b.weight", t.w(t.heads, kv_rank, nope))
    t.add(f"blk.{i}.attn_v_b.weight", t.w(t.heads, v_mla, kv_rank))
    t.add(f"blk.{i}.attn_gate.weight", t.w(t.heads, t.width))
    t.add(f"blk.{i}.attn_output.weight", t.w(t.width, t.heads * v_mla))


def _bailingmoe3(t: Tiny) -> None:
    """KDA layers where head_count_kv is 0, gated MLA every 4th layer, dense FFN where
    il < leading_dense_block_count (5), sigmoid-routed experts and a shared expert past it."""
    kv_rank, rope, nope, v_mla, lead = 32, 16, 32, 32, 5
    _moe_keys(t)
    for key, value in (("attention.kv_lora_rank", kv_rank), ("attention.key_length_mla", nope + rope),
                       ("attention.value_length_mla", v_mla), ("ssm.conv_kernel", 4), ("kda.head_dim", 16),
                       ("kda.gate_lower_bound", -5.0), ("expert_shared_count", 1),
                       ("leading_dense_block_count", lead), ("expert_gating_func", 2), ("expert_weights_norm", True),
                       ("expert_weights_scale", 1.0)):
        t.key(key, value)
    t.set("attention.head_count_kv", [1 if (i + 1) % 4 == 0 else 0 for i in range(t.layers)])
    t.set("attention.key_length", kv_rank + rope)
    t.set("attention.value_length", kv_rank)
    t.set("rope.dimension_count", rope)
    _head(t)
    for i in range(t.layers):
        t.norm(f"blk.{i}.attn_norm.weight")
        if (i + 1) % 4 == 0:
            _gated_mla(t, i, kv_rank, rope, nope, v_mla)
        else:
            _kda(t, i)
        t.norm(f"blk.{i}.ffn_norm.weight")
        _lead_dense_then_moe(t, i, lead)
# --- end hyb ---


def _kimi_kda(t: Tiny, i: int, head_dim: int = 16, conv: int = 4) -> None:
    """One Kimi delta-attention layer (kimi-linear.cpp): q, k, v each through a short conv, the decay
    and the output gate each a low-rank pair through head_dim, d_inner = head_count * kda.head_dim."""
    inner = t.heads * head_dim
    for x in "qkv":
        t.add(f"blk.{i}.ssm_conv1d_{x}.weight", t.w(1, inner, 1, conv))
        t.add(f"blk.{i}.attn_{x}.weight", t.w(inner, t.width))
    for x in "fg":
        t.add(f"blk.{i}.ssm_{x}_a.weight", t.w(head_dim, t.width))
        t.add(f"blk.{i}.ssm_{x}_b.weight", t.w(inner, head_dim))
    t.add(f"blk.{i}.ssm_beta.weight", t.w(t.heads, t.width))
    t.add(f"blk.{i}.ssm_a", -np.exp(t.w(t.heads, 1)))  # -exp(A_log), as converted
    t.add(f"blk.{i}.ssm_dt.bias", t.w(inner, scale=0.05))
    t.norm(f"blk.{i}.ssm_norm.weight", head_dim)
    t.add(f"blk.{i}.attn_output.weight", t.w(t.width, inner))


def _kimi_linear(t: Tiny) -> None:
    """KDA layers where head_count_kv is 0, MLA without RoPE on the query every 4th layer, a dense FFN
    where il < leading_dense_block_count (5), sigmoid-routed experts and a shared expert past it
    (kimi-linear.cpp)."""
    kv_rank, rope, nope, v_mla, lead = 32, 16, 32, 32, 5
    _moe_keys(t)
    for key, value in (("attention.kv_lora_rank", kv_rank), ("attention.key_length_mla", nope + rope),
                       ("attention.value_length_mla", v_mla), ("ssm.conv_kernel", 4), ("kda.head_dim", 16),
                       ("expert_shared_count", 1), ("leading_dense_block_count", lead),
                       ("expert_gating_func", 2), ("expert_weights_scale", 1.0)):
        t.key(key, value)
    t.set("attention.head_count_kv", [1 if (i + 1) % 4 == 0 else 0 for i in range(t.layers)])
    t.set("attention.key_length", kv_rank + rope)
    t.set("attention.value_length", kv_rank)
    t.set("rope.dimension_count", rope)
    _head(t)
    for i in range(t.layers):
        t.norm(f"blk.{i}.attn_norm.weight")
        if (i + 1) % 4 == 0:
            t.add(f"blk.{i}.attn_q.weight", t.w(t.heads * (nope + rope), t.width))
            t.add(f"blk.{i}.attn_kv_a_mqa.weight", t.w(kv_rank + rope, t.width))
            t.norm(f"blk.{i}.attn_kv_a_norm.weight", kv_rank)
            t.add(f"blk.{i}.attn_k_b.weight", t.w(t.heads, kv_rank, nope))
            t.add(f"blk.{i}.attn_v_b.weight", t.w(t.heads, v_mla, kv_rank))
            t.add(f"blk.{i}.attn_output.weight", t.w(t.width, t.heads * v_mla))
        else:
            _kimi_kda(t, i)
        t.norm(f"blk.{i}.ffn_norm.weight")
        _lead_dense_then_moe(t, i, lead)


def _nemotron_h_layers(t: Tiny, ffn: Callable[[int], None]) -> None:
    """nemotron-h.cpp's stack, mixer, FFN, mixer, attention repeated, with `ffn` writing an FFN layer."""
    kinds = "MFMA" * (t.layers // 4) + "MFMA"[: t.layers % 4]
    _mamba2_keys(t)
    t.key("attention.layer_norm_epsilon", 1e-5)  # required (for the MTP head's final norm)
    t.set("attention.head_count_kv", [t.kv_heads if k == "A" else 0 for k in kinds])
    t.set("feed_forward_length", [t.ff if k == "F" else 0 for k in kinds])
    _head(t)
    for i, kind in enumerate(kinds):
        t.norm(f"blk.{i}.attn_norm.weight")
        if kind == "M":
            _mamba2_mixer(t, i)
        elif kind == "A":
            t.attention(i)
        else:
            ffn(i)


def _falcon_h1(t: Tiny) -> None:
    """A Mamba-2 mixer beside attention in every layer, then a SwiGLU FFN whose norm has no
    `.weight` suffix (falcon-h1.cpp)."""
    _mamba2_keys(t)
    _head(t)
    for i in range(t.layers):
        t.norm(f"blk.{i}.attn_norm.weight")
        _mamba2_mixer(t, i)
        t.attention(i)
        t.norm(f"blk.{i}.ffn_norm")
        t.swiglu(i)


# --- frontier families (issue 54) ---


def _minimax_m2(t: Tiny) -> None:
    """Every layer MoE with sigmoid gating and a selection bias; experts as wide as
    feed_forward_length (minimax-m2.cpp reads n_ff for them); q/k norms over all heads; RoPE on
    half the head, as MiniMax-M2 has it."""
    _moe_keys(t)
    t.set("feed_forward_length", [32] * t.layers)
    t.key("expert_gating_func", 2)
    t.set("rope.dimension_count", t.head_dim // 2)
    _head(t)
    for i in range(t.layers):
        t.norm(f"blk.{i}.attn_norm.weight")
        t.attention(i, q_norm=t.heads * t.head_dim, k_norm=t.kv_heads * t.head_dim)
        t.norm(f"blk.{i}.ffn_norm.weight")
        t.experts(i, ff_exp=32)
        t.add(f"blk.{i}.exp_probs_b.bias", t.w(4, scale=0.05))


def _mistral4(t: Tiny) -> None:
    """deepseek2's layers (llama_model_mistral4 is its loader and graph) with Mistral Large's
    attention temperature, which grows with the position every 8 tokens here."""
    t.key("attention.temperature_scale", 0.5)
    t.key("attention.temperature_length", 8)
    _deepseek2(t)


def _step35(t: Tiny) -> None:
    """Sliding-window layers from the per-layer array (full attention on every 4th from layer 0),
    with their own head counts and RoPE base; a head-wise attention gate; a dense first layer
    and MoE with a shared expert after it, told apart by the tensors; per-layer SwiGLU clamps
    (step35.cpp)."""
    sliding = [i % 4 != 0 for i in range(t.layers)]
    heads = [(8, 4) if s else (t.heads, t.kv_heads) for s in sliding]
    _moe_keys(t)
    t.key("expert_shared_feed_forward_length", 32)
    t.key("attention.sliding_window", 4)  # short, so the prompts reach past it
    t.key("attention.sliding_window_pattern", sliding, GGUFValueType.BOOL)
    t.key("rope.freq_base_swa", 1000.0)
    t.set("attention.head_count", [q for q, _ in heads])
    t.set("attention.head_count_kv", [kv for _, kv in heads])
    t.key("swiglu_clamp_exp", [7.0] * t.layers, GGUFValueType.FLOAT32)
    t.key("swiglu_clamp_shexp", [7.0] * t.layers, GGUFValueType.FLOAT32)
    _head(t)
    for i in range(t.layers):
        t.norm(f"blk.{i}.attn_norm.weight")
        t.attention(i, q_norm=t.head_dim, k_norm=t.head_dim, heads=heads[i])
        t.add(f"blk.{i}.attn_gate.weight", t.w(heads[i][0], t.width))
        _dense_first_then_routed(t, i)


def _dense_first_then_routed(t: Tiny, i: int) -> None:
    """Layer i's FFN: dense in layer 0, past it experts with a selection bias and shared experts."""
    t.norm(f"blk.{i}.ffn_norm.weight")
    if i == 0:
        t.swiglu(i)
    else:
        t.experts(i)
        t.add(f"blk.{i}.exp_probs_b.bias", t.w(4, scale=0.05))
        _shared_experts(t, i, 32)


def _mimo2(t: Tiny) -> None:
    """Sliding-window layers by the per-layer array (full attention on every 4th from layer 0),
    with their own head counts and RoPE base; attention sinks and a value scale; a dense first
    layer and sigmoid-routed MoE after it, told apart by the tensors (mimo2.cpp)."""
    sliding = [i % 4 != 0 for i in range(t.layers)]
    heads = [(4, 1) if s else (t.heads, t.kv_heads) for s in sliding]
    _moe_keys(t)
    t.key("attention.sliding_window", 4)  # short, so the prompts reach past it
    t.key("attention.sliding_window_pattern", sliding, GGUFValueType.BOOL)
    t.key("rope.freq_base_swa", 1000.0)
    t.key("attention.value_scale", 0.7)
    t.set("attention.head_count_kv", [kv for _, kv in heads])
    _head(t)
    for i in range(t.layers):
        t.norm(f"blk.{i}.attn_norm.weight")
        t.attention(i, heads=heads[i])
        t.add(f"blk.{i}.attn_sinks.weight", t.w(heads[i][0], scale=1.0))
        t.norm(f"blk.{i}.ffn_norm.weight")
        if i == 0:
            t.swiglu(i)
        else:
            t.experts(i)
            t.add(f"blk.{i}.exp_probs_b.bias", t.w(4, scale=0.05))


def _glm4(t: Tiny) -> None:
    """GLM-4 with M-RoPE sections (GLM-4.1V's language model, GLM-OCR): q/k/v biases, norms after
    attention and FFN, a fused gate+up of 2 * n_ff, and one nextn layer past the main stack, whose
    tensors llama.cpp skips (glm4.cpp)."""
    blocks = t.layers + 1
    t.set("block_count", blocks)
    t.set("feed_forward_length", [t.ff] * blocks)
    t.set("attention.head_count", [t.heads] * blocks)
    t.set("attention.head_count_kv", [t.kv_heads] * blocks)
    t.key("nextn_predict_layers", 1)
    t.key("rope.dimension_sections", [4, 2, 2, 0], GGUFValueType.INT32)
    _head(t)
    for i in range(blocks):
        t.norm(f"blk.{i}.attn_norm.weight")
        t.attention(i, bias=True)
        t.norm(f"blk.{i}.post_attention_norm.weight")
        t.norm(f"blk.{i}.ffn_norm.weight")
        t.add(f"blk.{i}.ffn_up.weight", t.w(2 * t.ff, t.width))
        t.add(f"blk.{i}.ffn_down.weight", t.w(t.width, t.ff))
        t.norm(f"blk.{i}.post_ffw_norm.weight")
        if i >= t.layers:
            t.add(f"blk.{i}.nextn.eh_proj.weight", t.w(t.width, 2 * t.width))
            t.norm(f"blk.{i}.nextn.enorm.weight")
            t.norm(f"blk.{i}.nextn.hnorm.weight")


def _qwen2moe(t: Tiny) -> None:
    """qwen2's attention (q/k/v biases, q as wide as n_embd) and every layer MoE with a shared
    expert gated per token (qwen2moe.cpp)."""
    ffn = _gated_shared_moe(t)
    _head(t)
    _pre_norm_blocks(t, ffn, bias=True)


def _olmoe(t: Tiny) -> None:
    """Multi-head attention with q/k norms over all of n_embd (so as many KV heads as heads), every
    layer MoE with experts as wide as feed_forward_length (olmoe.cpp)."""
    t.kv_heads = t.heads
    _moe_keys(t)
    t.set("attention.head_count_kv", [t.kv_heads] * t.layers)
    t.set("feed_forward_length", [32] * t.layers)
    _head(t)
    _pre_norm_blocks(t, lambda i: t.experts(i, ff_exp=32), q_norm=t.width, k_norm=t.width)


def _seed_oss(t: Tiny) -> None:
    """q/k/v biases (Seed-OSS-36B has them; create_tensor_qkv loads them when present), a norm
    after attention that is the FFN's input norm, an untied head (seed-oss.cpp)."""
    _head(t)
    for i in range(t.layers):
        t.norm(f"blk.{i}.attn_norm.weight")
        t.attention(i, bias=True)
        t.norm(f"blk.{i}.post_attention_norm.weight")
        t.swiglu(i)


def _ernie4_5_moe(t: Tiny) -> None:
    """A dense first layer (leading_dense_block_count), then MoE with a selection bias and a
    shared expert on every layer (interleave_moe_layer_step 1, as ERNIE-4.5-21B-A3B has it: the
    loader makes every layer past the lead MoE, the graph every step-th) (ernie4-5.cpp, ernie4-5-moe.cpp)."""
    _moe_keys(t)
    t.key("leading_dense_block_count", 1)
    t.key("interleave_moe_layer_step", 1)
    t.key("expert_shared_feed_forward_length", 32)
    _head(t)
    for i in range(t.layers):
        t.norm(f"blk.{i}.attn_norm.weight")
        t.attention(i)
        _dense_first_then_routed(t, i)


def _exaone4(t: Tiny) -> None:
    """No pre-norms: q/k norms, norms after attention and FFN; one nextn layer past the main stack
    (loaded with TENSOR_SKIP); no sliding window, which exaone4.cpp turns on for 64 layers only."""
    blocks = t.layers + 1
    t.set("block_count", blocks)
    t.set("feed_forward_length", [t.ff] * blocks)
    t.set("attention.head_count", [t.heads] * blocks)
    t.set("attention.head_count_kv", [t.kv_heads] * blocks)
    t.key("nextn_predict_layers", 1)
    _head(t)
    for i in range(blocks):
        t.attention(i, q_norm=t.head_dim, k_norm=t.head_dim)
        t.norm(f"blk.{i}.post_attention_norm.weight")
        t.swiglu(i)
        t.norm(f"blk.{i}.post_ffw_norm.weight")
        if i >= t.layers:
            _nextn(t, i)


def _cohere2(t: Tiny) -> None:
    """Attention and FFN in parallel off one LayerNorm without bias, a tied head, a logit scale;
    sliding window on 3 of 4 layers (load_swa_pattern(ml, 4)), RoPE on those only (cohere2.cpp)."""
    t.key("attention.sliding_window", 4)  # short, so the prompts reach past it
    t.key("attention.layer_norm_epsilon", 1e-5)
    t.key("logit_scale", 0.5)
    _head(t, tied=True)
    for i in range(t.layers):
        t.norm(f"blk.{i}.attn_norm.weight")
        t.attention(i)
        t.swiglu(i)


def _hy_v3(t: Tiny) -> None:
    """q/k norms over a head; a dense first layer, then sigmoid-routed MoE with a selection bias
    (named without `.bias`: tn() is given no suffix) and an ungated shared expert, told apart by
    the router's presence; one nextn block past the main stack (hy-v3.cpp)."""
    blocks = t.layers + 1
    t.layers = blocks  # the per-layer arrays cover the nextn block too
    _moe_keys(t)
    t.layers = blocks - 1
    t.set("block_count", blocks)
    t.set("feed_forward_length", [t.ff] * blocks)
    t.set("attention.head_count", [t.heads] * blocks)
    t.set("attention.head_count_kv", [t.kv_heads] * blocks)
    t.key("nextn_predict_layers", 1)
    t.key("expert_shared_feed_forward_length", 32)
    _head(t)
    for i in range(blocks):
        t.norm(f"blk.{i}.attn_norm.weight")
        t.attention(i, q_norm=t.head_dim, k_norm=t.head_dim)
        t.norm(f"blk.{i}.ffn_norm.weight")
        if i == 0:
            t.swiglu(i)
        else:
            t.experts(i)
            t.add(f"blk.{i}.exp_probs_b", t.w(4, scale=0.05))
            _shared_experts(t, i, 32)
        if i >= t.layers:
            _nextn(t, i)


# --- older dense families (issue 54, part 2): each from its load_arch_tensors ---


def _layer_norm(t: Tiny, name: str, n: int | None = None) -> None:
    """A LayerNorm: weight and bias."""
    t.norm(f"{name}.weight", n)
    t.add(f"{name}.bias", t.w(n or t.width, scale=0.05))


def _up_down(t: Tiny, i: int, bias: bool = False) -> None:
    """An FFN without a gate (GELU or squared ReLU in the graph)."""
    t.add(f"blk.{i}.ffn_up.weight", t.w(t.ff, t.width))
    t.add(f"blk.{i}.ffn_down.weight", t.w(t.width, t.ff))
    if bias:
        t.add(f"blk.{i}.ffn_up.bias", t.w(t.ff, scale=0.05))
        t.add(f"blk.{i}.ffn_down.bias", t.w(t.width, scale=0.05))


def _arcee(t: Tiny) -> None:
    """Llama attention, a squared-ReLU up/down FFN (arcee.cpp)."""
    _head(t)
    _pre_norm_blocks(t, lambda i: _up_down(t, i))


def _maincoder(t: Tiny) -> None:
    """q/k norms over a head (maincoder.cpp)."""
    _head(t)
    _pre_norm_blocks(t, t.swiglu, q_norm=t.head_dim, k_norm=t.head_dim)


def _layer_norm_blocks(t: Tiny, ffn: Callable[[int], None], out_bias: bool = False, **attention: Any) -> None:
    """Each layer: LayerNorm, attention, LayerNorm, `ffn(i)` (orion, starcoder2, stablelm, ...);
    the output norm has a bias too, and `layer_norm_epsilon` is required."""
    t.key("attention.layer_norm_epsilon", 1e-5)
    t.add("token_embd.weight", t.w(t.vocab, t.width))
    _layer_norm(t, "output_norm")
    t.add("output.weight", t.w(t.vocab, t.width))
    for i in range(t.layers):
        _layer_norm(t, f"blk.{i}.attn_norm")
        t.attention(i, **attention)
        if out_bias:
            t.add(f"blk.{i}.attn_output.bias", t.w(t.width, scale=0.05))
        _layer_norm(t, f"blk.{i}.ffn_norm")
        ffn(i)


def _starcoder2(t: Tiny) -> None:
    _layer_norm_blocks(t, lambda i: _up_down(t, i, bias=True), out_bias=True, bias=True)


def _fused_qkv(t: Tiny, i: int, bias: bool = False) -> None:
    """attn_qkv as one tensor, q as wide as n_embd (falcon, gptneox, qwen)."""
    n = t.width + 2 * t.kv_heads * t.head_dim
    t.add(f"blk.{i}.attn_qkv.weight", t.w(n, t.width))
    if bias:
        t.add(f"blk.{i}.attn_qkv.bias", t.w(n, scale=0.05))


def _olmo(t: Tiny) -> None:
    """No norm weights at all: the graph's LayerNorms are parameter-free (olmo.cpp)."""
    t.key("attention.layer_norm_epsilon", 1e-5)
    t.add("token_embd.weight", t.w(t.vocab, t.width))
    t.add("output.weight", t.w(t.vocab, t.width))
    for i in range(t.layers):
        t.attention(i)
        t.swiglu(i)


def _qwen(t: Tiny) -> None:
    """Multi-head attention in one fused tensor with a bias; gate/up/down n_ff / 2 wide (qwen.cpp)."""
    t.kv_heads = t.heads
    t.set("attention.head_count_kv", [t.heads] * t.layers)
    _head(t)
    for i in range(t.layers):
        t.norm(f"blk.{i}.attn_norm.weight")
        _fused_qkv(t, i, bias=True)
        t.add(f"blk.{i}.attn_output.weight", t.w(t.width, t.width))
        t.norm(f"blk.{i}.ffn_norm.weight")
        t.swiglu(i, ff=t.ff // 2)


def _phi2(t: Tiny) -> None:
    """Attention and a biased GELU FFN in parallel off one LayerNorm; the head has a bias (phi2.cpp)."""
    t.key("attention.layer_norm_epsilon", 1e-5)
    t.add("token_embd.weight", t.w(t.vocab, t.width))
    _layer_norm(t, "output_norm")
    t.add("output.weight", t.w(t.vocab, t.width))
    t.add("output.bias", t.w(t.vocab, scale=0.05))
    for i in range(t.layers):
        _layer_norm(t, f"blk.{i}.attn_norm")
        t.attention(i, bias=True)
        t.add(f"blk.{i}.attn_output.bias", t.w(t.width, scale=0.05))
        _up_down(t, i, bias=True)


def _falcon(t: Tiny) -> None:
    """Falcon-7B's layout: one LayerNorm before attention and FFN in parallel, fused q/k/v (falcon.cpp)."""
    t.key("attention.layer_norm_epsilon", 1e-5)
    t.add("token_embd.weight", t.w(t.vocab, t.width))
    _layer_norm(t, "output_norm")
    t.add("output.weight", t.w(t.vocab, t.width))
    for i in range(t.layers):
        _layer_norm(t, f"blk.{i}.attn_norm")
        _fused_qkv(t, i)
        t.add(f"blk.{i}.attn_output.weight", t.w(t.width, t.width))
        _up_down(t, i)


def _gptneox(t: Tiny) -> None:
    """Fused biased q/k/v, biased LayerNorms and GELU FFN, the parallel residual (gptneox.cpp)."""
    t.key("use_parallel_residual", True)
    t.key("attention.layer_norm_epsilon", 1e-5)
    t.add("token_embd.weight", t.w(t.vocab, t.width))
    _biased_blocks(t)


def _biased_blocks(t: Tiny) -> None:
    """The output LayerNorm and head, then blocks of biased LayerNorms, fused biased q/k/v and a
    biased GELU FFN (gptneox's and gpt2's layouts)."""
    _layer_norm(t, "output_norm")
    t.add("output.weight", t.w(t.vocab, t.width))
    for i in range(t.layers):
        _layer_norm(t, f"blk.{i}.attn_norm")
        _fused_qkv(t, i, bias=True)
        t.add(f"blk.{i}.attn_output.weight", t.w(t.width, t.width))
        t.add(f"blk.{i}.attn_output.bias", t.w(t.width, scale=0.05))
        _layer_norm(t, f"blk.{i}.ffn_norm")
        _up_down(t, i, bias=True)


def _command_r(t: Tiny) -> None:
    """Attention and FFN in parallel off one LayerNorm (weight only), the head tied to the
    embeddings and scaled by logit_scale (command-r.cpp); no q/k norms below 64 layers."""
    t.key("logit_scale", 0.5)
    t.key("attention.layer_norm_epsilon", 1e-5)
    _head(t, tied=True)
    for i in range(t.layers):
        t.norm(f"blk.{i}.attn_norm.weight")
        t.attention(i)
        t.swiglu(i)


def _chatglm(t: Tiny) -> None:
    """ffn_up holds gate and up, 2 * n_ff (chatglm.cpp)."""
    _head(t)
    for i in range(t.layers):
        t.norm(f"blk.{i}.attn_norm.weight")
        t.attention(i, bias=True)
        t.norm(f"blk.{i}.ffn_norm.weight")
        t.add(f"blk.{i}.ffn_up.weight", t.w(2 * t.ff, t.width))
        t.add(f"blk.{i}.ffn_down.weight", t.w(t.width, t.ff))


def _gemma(t: Tiny) -> None:
    """Llama's tensors with the head tied to the embeddings, which the graph scales by √n_embd
    (8 here: a later stage's h/8 is exact), so they are drawn small (gemma.cpp)."""
    _head(t, tied=True, embd_scale=0.02)
    _pre_norm_blocks(t, t.swiglu)


def _minicpm(t: Tiny) -> None:
    """Llama's tensors; no embedding or residual scale keys, so llama.cpp's defaults (12 and
    1.4/√n_layer) apply and the package writes them (minicpm.cpp)."""
    _llama(t, embd_scale=0.02)


def _jais(t: Tiny) -> None:
    """Fused biased q/k/v, biased LayerNorms and a biased SwiGLU, ALiBi (jais.cpp)."""
    t.key("attention.layer_norm_epsilon", 1e-5)
    t.add("token_embd.weight", t.w(t.vocab, t.width))
    _layer_norm(t, "output_norm")
    t.add("output.weight", t.w(t.vocab, t.width))
    for i in range(t.layers):
        _layer_norm(t, f"blk.{i}.attn_norm")
        _fused_qkv(t, i, bias=True)
        t.add(f"blk.{i}.attn_output.weight", t.w(t.width, t.width))
        t.add(f"blk.{i}.attn_output.bias", t.w(t.width, scale=0.05))
        _layer_norm(t, f"blk.{i}.ffn_norm")
        t.swiglu(i)
        for name, n in (("gate", t.ff), ("up", t.ff), ("down", t.width)):
            t.add(f"blk.{i}.ffn_{name}.bias", t.w(n, scale=0.05))


def _learned_positions(t: Tiny) -> None:
    """gpt2, starcoder, and mpt with position_embd: a learned embedding per position
    ({n_embd, n_ctx_train}), added to the input; biased LayerNorms, fused q/k/v, GELU FFN."""
    t.key("attention.layer_norm_epsilon", 1e-5)
    t.add("token_embd.weight", t.w(t.vocab, t.width))
    t.add("position_embd.weight", t.w(512, t.width))  # context_length rows
    _biased_blocks(t)


def _granitemoe(t: Tiny) -> None:
    """Every layer MoE whose experts are feed_forward_length wide, and Granite's scales
    (granite-moe.cpp): the embedding scale, which build_inp_embd applies to hidden-state input too."""
    t.key("expert_count", 4)
    t.key("expert_used_count", [2] * t.layers)
    t.key("logit_scale", 8.0)
    t.key("embedding_scale", 12.0)
    t.key("residual_scale", 0.22)
    _head(t, embd_scale=0.05)
    _pre_norm_blocks(t, lambda i: t.experts(i, ff_exp=t.ff))


def _qwen2vl(t: Tiny) -> None:
    """Qwen2's tensors; M-RoPE sections are required (qwen2vl.cpp): a later stage's engine passes
    4 positions a row of embedding input."""
    t.key("rope.dimension_sections", [4, 2, 2, 0], GGUFValueType.INT32)
    _head(t)
    _pre_norm_blocks(t, t.swiglu, bias=True)


def _output_biased_blocks(t: Tiny) -> None:
    """Llama's pre-norm blocks with a bias on the attention output (pangu-embedded, ernie4_5's loader)."""
    for i in range(t.layers):
        t.norm(f"blk.{i}.attn_norm.weight")
        t.attention(i)
        t.add(f"blk.{i}.attn_output.bias", t.w(t.width, scale=0.05))
        t.norm(f"blk.{i}.ffn_norm.weight")
        t.swiglu(i)


def _pangu_embedded(t: Tiny) -> None:
    """Llama's tensors with a required attention output bias (pangu-embed.cpp)."""
    _head(t)
    _output_biased_blocks(t)


def _plamo(t: Tiny) -> None:
    """Attention and FFN in parallel off one norm, no FFN norm (plamo.cpp)."""
    _head(t)
    for i in range(t.layers):
        t.norm(f"blk.{i}.attn_norm.weight")
        t.attention(i)
        t.swiglu(i)


OLDER_DENSE: dict[str, Callable[[Tiny], None]] = {
    "arcee": _arcee,
    "xverse": _llama,  # xverse.cpp: llama's tensors (q as wide as n_embd)
    "internlm2": _llama,  # internlm2.cpp: llama's tensors (q as wide as n_embd)
    "exaone": _llama,  # exaone.cpp: llama's tensors
    "maincoder": _maincoder,
    "orion": lambda t: _layer_norm_blocks(t, t.swiglu),
    "starcoder2": _starcoder2,
    "stablelm": lambda t: _layer_norm_blocks(t, t.swiglu),
    "olmo": _olmo,
    "qwen": _qwen,
    "refact": _llama,  # refact.cpp: llama's tensors; ALiBi instead of RoPE
    "codeshell": lambda t: _layer_norm_blocks(t, lambda i: _up_down(t, i, bias=True), out_bias=True, bias=True),
    "phi2": _phi2,
    "falcon": _falcon,
    "nemotron": lambda t: _layer_norm_blocks(t, lambda i: _up_down(t, i)),
    "jais2": lambda t: _layer_norm_blocks(t, lambda i: _up_down(t, i, bias=True), out_bias=True),
    "gptneox": _gptneox,
    "command-r": _command_r,
    "chatglm": _chatglm,
    "gemma": _gemma,
    "minicpm": _minicpm,
    "jais": _jais,
    "gpt2": _learned_positions,
    "starcoder": _learned_positions,
    "mpt": _learned_positions,
    "granitemoe": _granitemoe,
    "qwen2vl": _qwen2vl,
    "pangu-embedded": _pangu_embedded,
    "plamo": _plamo,
    "hunyuan-dense": _maincoder,  # hunyuan-vl.cpp's loader: q/k norms over a head, SwiGLU
}


# --- older families (issue 54, part 3): each from its load_arch_tensors ---


def _arctic(t: Tiny) -> None:
    """A dense SwiGLU n_embd wide beside routed experts feed_forward_length wide, each with its own
    norm (arctic.cpp: ffn_norm, ffn_norm_exps)."""
    t.key("expert_count", 4)
    t.key("expert_used_count", [2] * t.layers)
    _head(t)

    def ffn(i: int) -> None:
        t.swiglu(i, ff=t.width)
        t.norm(f"blk.{i}.ffn_norm_exps.weight")
        t.experts(i, ff_exp=t.ff)

    _pre_norm_blocks(t, ffn)


def _dbrx(t: Tiny) -> None:
    """LayerNorms without bias, fused q/k/v clamped, a norm after attention and every layer MoE with
    experts feed_forward_length wide (dbrx.cpp)."""
    t.key("expert_count", 4)
    t.key("expert_used_count", [2] * t.layers)
    t.key("attention.layer_norm_epsilon", 1e-5)
    t.key("attention.clamp_kqv", 8.0)
    _head(t)
    for i in range(t.layers):
        t.norm(f"blk.{i}.attn_norm.weight")
        _fused_qkv(t, i)
        t.add(f"blk.{i}.attn_output.weight", t.w(t.width, t.width))
        t.norm(f"blk.{i}.attn_output_norm.weight")
        t.experts(i, ff_exp=t.ff)


def _bitnet(t: Tiny) -> None:
    """Sub-norms inside attention and FFN; the head is the token embeddings (bitnet.cpp), in f32
    here rather than ternary."""
    _head(t, tied=True)
    for i in range(t.layers):
        t.norm(f"blk.{i}.attn_norm.weight")
        t.norm(f"blk.{i}.attn_sub_norm.weight")
        t.attention(i)
        t.norm(f"blk.{i}.ffn_norm.weight")
        t.norm(f"blk.{i}.ffn_sub_norm.weight", t.ff)
        t.swiglu(i)


def _phimoe(t: Tiny) -> None:
    """Biased LayerNorms, q/k/v and a biased output projection, every layer MoE, a biased head
    (phimoe.cpp; phi3's graph)."""
    t.key("expert_count", 4)
    t.key("expert_used_count", [2] * t.layers)
    t.key("attention.layer_norm_epsilon", 1e-5)
    t.add("token_embd.weight", t.w(t.vocab, t.width))
    _layer_norm(t, "output_norm")
    t.add("output.weight", t.w(t.vocab, t.width))
    t.add("output.bias", t.w(t.vocab, scale=0.05))
    for i in range(t.layers):
        _layer_norm(t, f"blk.{i}.attn_norm")
        t.attention(i)
        t.add(f"blk.{i}.attn_output.bias", t.w(t.width, scale=0.05))
        _layer_norm(t, f"blk.{i}.ffn_norm")
        t.experts(i, ff_exp=t.ff)


def _grok(t: Tiny) -> None:
    """Grok-2's layer: a norm after attention, a dense GELU FFN beside routed experts, a norm after
    the FFN; no embedding_scale key, so llama.cpp's default 78.38 applies and the package writes
    it (grok.cpp)."""
    t.key("expert_count", 4)
    t.key("expert_used_count", [2] * t.layers)
    t.key("expert_feed_forward_length", [32] * t.layers)
    _head(t, embd_scale=0.005)
    for i in range(t.layers):
        t.norm(f"blk.{i}.attn_norm.weight")
        t.attention(i)
        t.norm(f"blk.{i}.attn_output_norm.weight")
        t.norm(f"blk.{i}.ffn_norm.weight")
        t.swiglu(i)
        t.experts(i)
        t.norm(f"blk.{i}.layer_output_norm.weight")


def _lead_moe(t: Tiny, lead: int, q_norm: int = 0, probs_bias: bool = False) -> None:
    """deepseek.cpp and dots1.cpp: a dense FFN for the `lead` first layers, then routed experts
    with one shared expert as wide as one of them; `probs_bias`: a selection bias (dots1)."""
    _moe_keys(t)
    t.key("leading_dense_block_count", lead)
    t.key("expert_shared_count", 1)
    _head(t)

    def ffn(i: int) -> None:
        if i < lead:
            t.swiglu(i)
            return
        t.experts(i)
        _shared_experts(t, i, 32)
        if probs_bias:
            t.add(f"blk.{i}.exp_probs_b.bias", t.w(4, scale=0.05))

    _pre_norm_blocks(t, ffn, q_norm=q_norm, k_norm=q_norm)


def _dots1(t: Tiny) -> None:
    """Multi-head attention (k and v as wide as q) with q/k norms over a head, sigmoid routing with
    a selection bias (dots1.cpp)."""
    t.kv_heads = t.heads
    t.set("attention.head_count_kv", [t.heads] * t.layers)
    t.key("expert_gating_func", 2)
    t.key("expert_weights_norm", True)
    _lead_moe(t, 1, q_norm=t.head_dim, probs_bias=True)


def _bailingmoe(t: Tiny) -> None:
    """Every layer MoE with a shared expert (bailingmoe.cpp reads leading_dense_block_count and never
    uses it)."""
    _moe_keys(t)
    t.key("expert_shared_count", 1)
    _head(t)

    def ffn(i: int) -> None:
        t.experts(i)
        _shared_experts(t, i, 32)

    _pre_norm_blocks(t, ffn)


def _hunyuan_moe(t: Tiny) -> None:
    """q/k norms over a head, every layer MoE with experts feed_forward_length wide and a shared expert
    of its own width (hunyuan-moe.cpp); expert_feed_forward_length is required all the same."""
    _moe_keys(t, ff_exp=t.ff)
    t.key("expert_shared_feed_forward_length", 32)
    _head(t)

    def ffn(i: int) -> None:
        t.experts(i, ff_exp=t.ff)
        _shared_experts(t, i, 32)

    _pre_norm_blocks(t, ffn, q_norm=t.head_dim, k_norm=t.head_dim)


OLDER: dict[str, Callable[[Tiny], None]] = {
    "arctic": _arctic,
    "dbrx": _dbrx,
    "bitnet": _bitnet,
    "phimoe": _phimoe,
    "grok": _grok,
    "deepseek": lambda t: _lead_moe(t, 2),
    "dots1": _dots1,
    "bailingmoe": _bailingmoe,
    "hunyuan-moe": _hunyuan_moe,
}


# --- DSA families (issue 54): deepseek2's MLA layers with a lightning indexer ---


def _indexer(t: Tiny, i: int, q_rank: int = 32, heads: int = 2, size: int = 64) -> None:
    """Layer i's DSA indexer (deepseek32.cpp, glm-dsa.cpp): a head of 64, the smallest Hadamard
    rotation llama_kv_cache::build_input_k_rot makes for the indexer cache."""
    t.add(f"blk.{i}.indexer.k_norm.weight", 1 + t.w(size, scale=0.1))
    t.add(f"blk.{i}.indexer.k_norm.bias", t.w(size, scale=0.05))
    t.add(f"blk.{i}.indexer.proj.weight", t.w(heads, t.width))
    t.add(f"blk.{i}.indexer.attn_k.weight", t.w(size, t.width))
    t.add(f"blk.{i}.indexer.attn_q_b.weight", t.w(heads * size, q_rank))


def _dsa_keys(t: Tiny) -> None:
    """A top-k of 8, below the prompt's length, so the indexer's choice shapes the attention."""
    t.key("attention.indexer.head_count", 2)
    t.key("attention.indexer.key_length", 64)
    t.key("attention.indexer.top_k", 8)
    t.key("expert_gating_func", 2)  # sigmoid; deepseek32.cpp requires the key


def _deepseek32(t: Tiny) -> None:
    """deepseek2's layers (2 leading dense, one nextn layer) with an indexer in every layer."""
    _deepseek2(t)
    _dsa_keys(t)
    for i in range(t.layers + 1):
        _indexer(t, i)


# glm-dsa's indexer kinds over the main stack: 1 full, 0 shared (reusing the last full one's top-k)
GLM_DSA_TYPES = [1, 1, 0, 0, 1, 0, 1, 0]


def _glm_dsa(t: Tiny) -> None:
    """deepseek2's layers with an indexer only where the layer's kind is full, the nextn layer's too."""
    _deepseek2(t)
    _dsa_keys(t)
    types = GLM_DSA_TYPES[:t.layers]
    t.key("attention.indexer.types", types)
    for i, full in enumerate([*types, 1]):
        if full:
            _indexer(t, i)


DSA: dict[str, Callable[[Tiny], None]] = {"deepseek32": _deepseek32, "glm-dsa": _glm_dsa}


# --- gemma4 (issue 54): sliding layers from the array, the last layers reusing earlier layers' KV ---

# Full attention at 2, 5, 7 and 9; the last 2 layers share KV: layer 8 (sliding) reads layer 6's,
# layer 9 (full) layer 7's, as create_memory's reuse callback picks them (llama-model.cpp).
GEMMA4_SLIDING = [True, True, False, True, True, False, True, False, True, False]
GEMMA4_SHARED_KV = 2


def _gemma4(t: Tiny) -> None:
    """Gemma 4 without per-layer inputs (26B/31B-like): full layers with wider heads, proportional
    RoPE factors and their own RoPE width; q/k/v norms; a post-attention and post-FFN norm; a
    layer scale; GELU FFN; KV-sharing layers at the end without k/v projections (gemma4.cpp)."""
    sliding = GEMMA4_SLIDING[:t.layers]
    full_dim, swa_dim = 64, 32  # multiples of the q8_0 KV cache's block (32)
    t.key("attention.sliding_window", 8)  # short, so the prompts reach past it
    t.key("attention.sliding_window_pattern", sliding, GGUFValueType.BOOL)
    t.key("attention.shared_kv_layers", GEMMA4_SHARED_KV)
    t.key("embedding_length_per_layer_input", 0)
    t.set("attention.key_length", full_dim)
    t.set("attention.value_length", full_dim)
    t.key("attention.key_length_swa", swa_dim)
    t.key("attention.value_length_swa", swa_dim)
    t.set("rope.dimension_count", full_dim)
    t.key("rope.dimension_count_swa", swa_dim)
    t.key("rope.freq_base_swa", 1000.0)
    t.key("final_logit_softcapping", 30.0)
    _head(t, tied=True, embd_scale=0.05)  # the graph scales token input by √width
    t.add("rope_freqs.weight", 1 + t.w(full_dim // 2, scale=0.1))
    for i, slides in enumerate(sliding):
        dim = swa_dim if slides else full_dim
        t.norm(f"blk.{i}.attn_norm.weight")
        t.add(f"blk.{i}.attn_q.weight", t.w(t.heads * dim, t.width))
        if i < t.layers - GEMMA4_SHARED_KV:
            t.add(f"blk.{i}.attn_k.weight", t.w(t.kv_heads * dim, t.width))
            t.add(f"blk.{i}.attn_v.weight", t.w(t.kv_heads * dim, t.width))
            t.norm(f"blk.{i}.attn_k_norm.weight", dim)
        t.norm(f"blk.{i}.attn_q_norm.weight", dim)
        t.add(f"blk.{i}.attn_output.weight", t.w(t.width, t.heads * dim))
        t.norm(f"blk.{i}.post_attention_norm.weight")
        t.add(f"blk.{i}.layer_output_scale.weight", 1 + t.w(1, scale=0.1))
        t.norm(f"blk.{i}.ffn_norm.weight")
        t.swiglu(i)
        t.norm(f"blk.{i}.post_ffw_norm.weight")


GEMMA4: dict[str, Callable[[Tiny], None]] = {"gemma4": _gemma4}


# --- minimax-m3 (issue 54): MiniMax sparse attention (MSA) past the leading dense blocks ---


def _minimax_m3(t: Tiny) -> None:
    """One leading dense block (swigluoai), then MoE with a selection bias and a shared expert and
    sparse attention: an indexer head per KV head over blocks of 4 positions, 2 chosen and 1 local
    (minimax-m3.cpp); per-head q/k norms, RoPE on half the head."""
    lead, idx = 1, 64  # the indexer cache's Hadamard rotation is 64 wide at least
    t.head_dim = 32  # a multiple of the q8_0 KV cache's block
    _moe_keys(t)
    t.set("attention.key_length", t.head_dim)
    t.set("attention.value_length", t.head_dim)
    t.set("rope.dimension_count", t.head_dim // 2)
    t.key("leading_dense_block_count", lead)
    t.key("expert_shared_count", 1)
    t.key("expert_gating_func", 2)
    for suffix, value in (("head_count", t.kv_heads), ("key_length", idx), ("top_k", 2), ("block_size", 4),
                          ("local_blocks", 1)):
        t.key(f"attention.indexer.{suffix}", value)
    _head(t)
    for i in range(t.layers):
        t.norm(f"blk.{i}.attn_norm.weight")
        t.attention(i, q_norm=t.head_dim, k_norm=t.head_dim)
        t.norm(f"blk.{i}.ffn_norm.weight")
        _lead_dense_then_moe(t, i, lead)
        if i >= lead:
            t.add(f"blk.{i}.indexer.q_proj.weight", t.w(t.kv_heads * idx, t.width))
            t.add(f"blk.{i}.indexer.k_proj.weight", t.w(idx, t.width))
            t.norm(f"blk.{i}.indexer.q_norm.weight", idx)
            t.norm(f"blk.{i}.indexer.k_norm.weight", idx)


MINIMAX_M3: dict[str, Callable[[Tiny], None]] = {"minimax-m3": _minimax_m3}


# --- older families (issue 54, part 4): each from its load_arch_tensors ---


def _ernie4_5(t: Tiny) -> None:
    """Llama's tensors with an attention output bias, which ernie4-5.cpp loads when present and
    its graph never adds (so none here)."""
    _head(t)
    _pre_norm_blocks(t, t.swiglu)


def _paddleocr(t: Tiny) -> None:
    """ernie4_5's loader; M-RoPE sections (paddleocr.cpp rotates by them) and the output bias it adds."""
    t.key("rope.dimension_sections", [4, 2, 2, 0], GGUFValueType.INT32)
    _head(t)
    _output_biased_blocks(t)


def _moe_with_nextn(t: Tiny) -> int:
    """MoE keys, and one nextn layer past the main stack of `t.layers`: block_count one more, which
    the per-layer arrays cover too. Returns block_count."""
    blocks = t.layers + 1
    t.layers = blocks
    _moe_keys(t)
    t.layers = blocks - 1
    t.set("block_count", blocks)
    t.set("feed_forward_length", [t.ff] * blocks)
    t.set("attention.head_count", [t.heads] * blocks)
    t.set("attention.head_count_kv", [t.kv_heads] * blocks)
    t.key("nextn_predict_layers", 1)
    return blocks


def _bailingmoe2(t: Tiny) -> None:
    """Fused q/k/v (q n_embd wide) with q/k norms over a head, a dense first layer, then MoE with a
    selection bias and a shared expert as wide as one expert times expert_shared_count; one nextn
    layer past the main stack (bailingmoe2.cpp)."""
    blocks = _moe_with_nextn(t)
    t.key("leading_dense_block_count", 1)
    t.key("expert_shared_count", 1)
    t.key("expert_gating_func", 2)
    t.key("expert_weights_norm", True)
    _head(t)
    gqa = t.kv_heads * t.head_dim
    for i in range(blocks):
        t.norm(f"blk.{i}.attn_norm.weight")
        t.add(f"blk.{i}.attn_qkv.weight", t.w(t.width + 2 * gqa, t.width))
        t.add(f"blk.{i}.attn_output.weight", t.w(t.width, t.width))
        t.norm(f"blk.{i}.attn_q_norm.weight", t.head_dim)
        t.norm(f"blk.{i}.attn_k_norm.weight", t.head_dim)
        t.norm(f"blk.{i}.ffn_norm.weight")
        if i == 0:
            t.swiglu(i)
            continue
        t.experts(i)
        t.add(f"blk.{i}.exp_probs_b.bias", t.w(4, scale=0.05))
        _shared_experts(t, i, 32)
        if i == t.layers:
            _nextn(t, i)
            t.norm(f"blk.{i}.layer_output_norm.weight")


def _mellum(t: Tiny) -> None:
    """q/k norms over a head, every layer MoE (softmax, weights normed); a sliding window on 3 of 4
    layers (load_swa_pattern(ml, 4)) (mellum.cpp)."""
    _moe_keys(t)
    t.key("attention.sliding_window", 4)  # short, so the prompts reach past it
    _head(t)
    _pre_norm_blocks(t, t.experts, q_norm=t.head_dim, k_norm=t.head_dim)


def _plamo3(t: Tiny) -> None:
    """Fused q/k/v, q/k norms over a head, norms after attention and FFN (named without ".weight":
    plamo3.cpp's tn() has no suffix), ffn_up holding gate and up; a sliding window on 7 of 8 layers
    (load_swa_pattern(ml, 8))."""
    t.key("attention.sliding_window", 4)  # short, so the prompts reach past it
    _head(t)
    gqa = t.kv_heads * t.head_dim
    for i in range(t.layers):
        t.norm(f"blk.{i}.attn_norm.weight")
        t.add(f"blk.{i}.attn_qkv.weight", t.w(t.heads * t.head_dim + 2 * gqa, t.width))
        t.norm(f"blk.{i}.attn_q_norm.weight", t.head_dim)
        t.norm(f"blk.{i}.attn_k_norm.weight", t.head_dim)
        t.add(f"blk.{i}.attn_output.weight", t.w(t.width, t.heads * t.head_dim))
        t.norm(f"blk.{i}.post_attention_norm")
        t.norm(f"blk.{i}.ffn_norm.weight")
        t.norm(f"blk.{i}.post_ffw_norm")
        t.add(f"blk.{i}.ffn_up.weight", t.w(2 * t.ff, t.width))
        t.add(f"blk.{i}.ffn_down.weight", t.w(t.width, t.ff))


def _laguna(t: Tiny) -> None:
    """q/k norms over a head and a softplus gate per head on the attention output (attn_gate,
    {n_embd, n_head}); a dense first layer (leading_dense_block_count, required), then sigmoid-routed
    MoE with a required selection bias and a shared expert as wide as one expert; a sliding window
    with full attention on every 4th layer from layer 0 (load_swa_pattern(ml, 4, true)) (laguna.cpp)."""
    _moe_keys(t)
    t.key("leading_dense_block_count", 1)
    t.key("attention.sliding_window", 4)  # short, so the prompts reach past it
    _head(t)

    def ffn(i: int) -> None:
        t.add(f"blk.{i}.attn_gate.weight", t.w(t.heads, t.width))
        if i == 0:
            t.swiglu(i)
            return
        t.experts(i)
        t.add(f"blk.{i}.exp_probs_b.bias", t.w(4, scale=0.05))
        _shared_experts(t, i, 32)

    _pre_norm_blocks(t, ffn, q_norm=t.head_dim, k_norm=t.head_dim)


def _exaone_moe(t: Tiny) -> None:
    """q/k norms over a head; a dense first layer, then MoE with a selection bias and a shared expert;
    a sliding window (required) on 3 of 4 layers (load_swa_pattern(ml, 4)), RoPE on those only;
    one nextn layer, dense, past the main stack (exaone-moe.cpp)."""
    blocks = _moe_with_nextn(t)
    t.key("leading_dense_block_count", 1)
    t.key("expert_shared_count", 1)
    t.key("expert_gating_func", 2)
    t.key("expert_weights_norm", True)
    t.key("attention.sliding_window", 4)  # short, so the prompts reach past it
    _head(t)
    for i in range(blocks):
        t.norm(f"blk.{i}.attn_norm.weight")
        t.attention(i, q_norm=t.head_dim, k_norm=t.head_dim)
        t.norm(f"blk.{i}.ffn_norm.weight")
        if i == 0 or i == t.layers:
            t.swiglu(i)
        else:
            t.experts(i)
            t.add(f"blk.{i}.exp_probs_b.bias", t.w(4, scale=0.05))
            _shared_experts(t, i, 32)
        if i == t.layers:
            _nextn(t, i)


def _cohere2moe(t: Tiny) -> None:
    """Attention and FFN in parallel off one norm, a tied head, a logit scale; a dense first layer,
    then sigmoid-routed MoE with a shared expert (their sum halved); a sliding window with full
    attention on every 4th layer from layer 0 (load_swa_pattern(ml, 4, true)), RoPE on sliding and
    leading dense layers only (cohere2moe.cpp)."""
    _moe_keys(t)
    t.key("leading_dense_block_count", 1)
    t.key("expert_shared_count", 1)
    t.key("attention.sliding_window", 4)  # short, so the prompts reach past it
    t.key("logit_scale", 0.5)
    _head(t, tied=True)
    for i in range(t.layers):
        t.norm(f"blk.{i}.attn_norm.weight")
        t.attention(i)
        if i == 0:
            t.swiglu(i)
            continue
        t.experts(i)
        _shared_experts(t, i, 32)


def _smallthinker(t: Tiny) -> None:
    """Every layer MoE (ReLU experts) routed from the layer's input, before its norm; a sliding
    window with full attention on every 4th layer from layer 0 (load_swa_pattern(ml, 4, true)), and
    no RoPE on those (smallthinker.cpp)."""
    _moe_keys(t)
    t.key("expert_gating_func", 1)
    t.key("attention.sliding_window", 4)  # short, so the prompts reach past it
    _head(t)
    _pre_norm_blocks(t, t.experts)


def _apertus(t: Tiny) -> None:
    """q/k norms over a head, an up/down FFN through xIELU whose alpha_n, alpha_p, beta and eps are
    per-layer arrays named without the arch prefix (apertus.cpp, llama-arch.cpp LLM_KV_XIELU_*);
    they differ by layer here, so a stage that took the wrong slice would part."""
    for name, base in (("alpha_n", 0.8), ("alpha_p", 0.8), ("beta", 0.5), ("eps", -1e-6)):
        values = [base * (1 + 0.1 * i) for i in range(t.layers)]
        t.writer.add_key_value(f"xielu.{name}", values, GGUFValueType.ARRAY, sub_type=GGUFValueType.FLOAT32)
    _head(t)
    _pre_norm_blocks(t, lambda i: _up_down(t, i), q_norm=t.head_dim, k_norm=t.head_dim)


def _afmoe(t: Tiny) -> None:
    """q/k norms over a head and a sigmoid gate on the attention output (attn_gate, as wide as q),
    norms before and after attention and FFN; a dense first layer, then sigmoid-routed MoE with a
    required selection bias and a shared expert; a sliding window on 3 of 4 layers; embeddings drawn
    small, as the graph scales them by √n_embd (afmoe.cpp)."""
    _moe_keys(t)
    t.key("leading_dense_block_count", 1)
    t.key("expert_shared_count", 1)
    t.key("attention.sliding_window", 4)  # short, so the prompts reach past it
    _head(t, embd_scale=0.02)
    for i in range(t.layers):
        t.norm(f"blk.{i}.attn_norm.weight")
        t.attention(i, q_norm=t.head_dim, k_norm=t.head_dim)
        t.add(f"blk.{i}.attn_gate.weight", t.w(t.heads * t.head_dim, t.width))
        t.norm(f"blk.{i}.post_attention_norm.weight")
        t.norm(f"blk.{i}.ffn_norm.weight")
        t.norm(f"blk.{i}.post_ffw_norm.weight")
        if i == 0:
            t.swiglu(i)
            continue
        t.experts(i)
        t.add(f"blk.{i}.exp_probs_b.bias", t.w(4, scale=0.05))
        _shared_experts(t, i, 32)


def _deci(t: Tiny) -> None:
    """Llama's layers with per-layer heads and FFN widths (deci.cpp): layer 2 has no FFN (the graph's
    `continue`, which drops its attention's output too), layer 3 is attention-free (no heads, an
    FFN), layer 5 linear attention (heads but no KV heads: attn_output alone, n_embd square)."""
    heads = [0 if i == 3 else t.heads for i in range(t.layers)]
    kv = [0 if i in (3, 5) else t.kv_heads for i in range(t.layers)]
    ff = [0 if i == 2 else t.ff for i in range(t.layers)]
    t.set("attention.head_count", heads)
    t.set("attention.head_count_kv", kv)
    t.set("feed_forward_length", ff)
    _head(t)
    for i in range(t.layers):
        if heads[i] and kv[i]:
            t.norm(f"blk.{i}.attn_norm.weight")
            t.attention(i)
        elif heads[i]:
            t.norm(f"blk.{i}.attn_norm.weight")
            t.add(f"blk.{i}.attn_output.weight", t.w(t.width, t.width))
        if ff[i]:
            t.norm(f"blk.{i}.ffn_norm.weight")
            t.swiglu(i)


def _qwen3vl(t: Tiny, moe: bool = False) -> None:
    """qwen3's (or qwen3moe's) tensors with M-RoPE sections (required) and 3 deepstack layers, which
    widen the embedding input to 4 * n_embd (qwen3vl.cpp, qwen3vlmoe.cpp)."""
    t.key("rope.dimension_sections", [4, 2, 2, 0], GGUFValueType.INT32)
    t.key("n_deepstack_layers", 3)
    if moe:
        _qwen3moe(t)
        return
    _head(t)
    _pre_norm_blocks(t, t.swiglu, q_norm=t.head_dim, k_norm=t.head_dim)


def _deepseek2_ocr(t: Tiny) -> None:
    """Multi-head attention (k and v n_embd wide), a dense first layer, then softmax-routed MoE with a
    shared expert as wide as one expert (deepseek2ocr.cpp; deepseek2's graph, its OCR branch)."""
    t.kv_heads = t.heads
    t.set("attention.head_count_kv", [t.heads] * t.layers)
    _moe_keys(t)
    t.key("leading_dense_block_count", 1)
    t.key("expert_shared_count", 1)
    _head(t)

    def ffn(i: int) -> None:
        if i == 0:
            t.swiglu(i)
            return
        t.experts(i)
        _shared_experts(t, i, 32)

    _pre_norm_blocks(t, ffn)


def _openelm(t: Tiny) -> None:
    """Fused q/k/v with head counts and FFN widths that grow by layer, as OpenELM's do; q/k norms over a
    head; the head tied to the embeddings (openelm.cpp)."""
    heads = [2 + 2 * (i % 2) for i in range(t.layers)]
    kv = [1 + i % 2 for i in range(t.layers)]
    ff = [64 + 32 * (i % 3) for i in range(t.layers)]
    t.set("attention.head_count", heads)
    t.set("attention.head_count_kv", kv)
    t.set("feed_forward_length", ff)
    _head(t, tied=True)
    for i in range(t.layers):
        t.norm(f"blk.{i}.attn_norm.weight")
        t.add(f"blk.{i}.attn_qkv.weight", t.w((heads[i] + 2 * kv[i]) * t.head_dim, t.width))
        t.norm(f"blk.{i}.attn_q_norm.weight", t.head_dim)
        t.norm(f"blk.{i}.attn_k_norm.weight", t.head_dim)
        t.add(f"blk.{i}.attn_output.weight", t.w(t.width, heads[i] * t.head_dim))
        t.norm(f"blk.{i}.ffn_norm.weight")
        t.swiglu(i, ff=ff[i])


OLDER_4: dict[str, Callable[[Tiny], None]] = {
    "ernie4_5": _ernie4_5,
    "paddleocr": _paddleocr,
    "bailingmoe2": _bailingmoe2,
    "mellum": _mellum,
    "plamo3": _plamo3,
    "laguna": _laguna,
    "exaone-moe": _exaone_moe,
    "cohere2moe": _cohere2moe,
    "smallthinker": _smallthinker,
    "apertus": _apertus,
    "afmoe": _afmoe,
    "deci": _deci,
    "qwen3vl": _qwen3vl,
    "qwen3vlmoe": lambda t: _qwen3vl(t, moe=True),
    "deepseek2-ocr": _deepseek2_ocr,
    "openelm": _openelm,
}


# --- text families (issue 54, part 5): each from its load_arch_tensors and graph ---


def _maple(t: Tiny) -> None:
    """q/k norms over a head; RoPE on sliding-window layers only, which the per-layer array tells
    (get_arr, required; full attention on every 4th from layer 0 here), with their own RoPE base;
    every layer MoE (softmax, weights normed) with per-layer SwiGLU clamps (maple.cpp)."""
    sliding = [i % 4 != 0 for i in range(t.layers)]
    _moe_keys(t)
    t.key("attention.sliding_window", 4)  # short, so the prompts reach past it
    t.key("attention.sliding_window_pattern", sliding, GGUFValueType.BOOL)
    t.key("rope.freq_base_swa", 1000.0)
    t.key("swiglu_clamp_exp", [7.0] * t.layers, GGUFValueType.FLOAT32)
    _head(t)
    _pre_norm_blocks(t, t.experts, q_norm=t.head_dim, k_norm=t.head_dim)


def _spark2_5(t: Tiny) -> None:
    """Sliding-window layers by the per-layer array (get_arr, required; full attention on every 4th
    from layer 0 here) with their own head counts and RoPE base; a sigmoid gate per head on the
    attention output (attn_gate, {n_embd, n_head}); a GELU FFN; the head tied (spark2-5.cpp)."""
    sliding = [i % 4 != 0 for i in range(t.layers)]
    heads = [(8, 4) if s else (t.heads, t.kv_heads) for s in sliding]
    t.key("attention.sliding_window", 4)  # short, so the prompts reach past it
    t.key("attention.sliding_window_pattern", sliding, GGUFValueType.BOOL)
    t.key("rope.freq_base_swa", 1000.0)
    t.set("attention.head_count", [q for q, _ in heads])
    t.set("attention.head_count_kv", [kv for _, kv in heads])
    _head(t, tied=True)
    for i in range(t.layers):
        t.norm(f"blk.{i}.attn_norm.weight")
        t.attention(i, heads=heads[i])
        t.add(f"blk.{i}.attn_gate.weight", t.w(heads[i][0], t.width))
        t.norm(f"blk.{i}.ffn_norm.weight")
        t.swiglu(i)


def _hunyuan_vl(t: Tiny) -> None:
    """q/k norms over a head, applied after RoPE; SwiGLU; XDRoPE sections (M-RoPE, so a later stage
    passes 4 positions a row) and its NTK alpha on the RoPE base (hunyuan-vl.cpp)."""
    t.key("rope.dimension_sections", [4, 2, 2, 0], GGUFValueType.INT32)
    t.key("rope.scaling.alpha", 1.5)
    _head(t)
    _pre_norm_blocks(t, t.swiglu, q_norm=t.head_dim, k_norm=t.head_dim)


def _muse_glimmer(t: Tiny) -> None:
    """q/k norms over a head, a sigmoid gate on the attention output as wide as q, norms after
    attention and FFN; the input RMS-normed without a weight; RoPE on sliding-window layers only
    (load_swa_pattern(ml, 4)); a logit scale (muse-glimmer.cpp)."""
    t.key("attention.sliding_window", 4)  # short, so the prompts reach past it
    t.key("logit_scale", 0.5)
    _head(t)
    for i in range(t.layers):
        t.norm(f"blk.{i}.attn_norm.weight")
        t.attention(i, q_norm=t.head_dim, k_norm=t.head_dim)
        t.add(f"blk.{i}.attn_gate.weight", t.w(t.heads * t.head_dim, t.width))
        t.norm(f"blk.{i}.post_attention_norm.weight")
        t.norm(f"blk.{i}.ffn_norm.weight")
        t.swiglu(i)
        t.norm(f"blk.{i}.post_ffw_norm.weight")


def _granite_swa(t: Tiny) -> None:
    """Granite's scales (the embedding scale, which build_inp_embd applies to hidden-state input too);
    sliding-window layers by the per-layer array (get_arr, required; full attention on every 4th from
    layer 0 here) and RoPE by the per-layer rope_pattern (none on the full layers here); attention
    sinks; biased attention output and SwiGLU FFN (granite-swa.cpp). Dense: its MoE branch splits as
    exactly, but an F32 router's logits differ in the last bit between a window and single rows (in
    every MoE family here), which at this model's near-tie parts a sampled speculation."""
    sliding = [i % 4 != 0 for i in range(t.layers)]
    t.key("logit_scale", 8.0)  # required by granite-swa.cpp
    t.key("embedding_scale", 12.0)
    t.key("residual_scale", 0.22)
    t.key("attention.sliding_window", 4)  # short, so the prompts reach past it
    t.key("attention.sliding_window_pattern", sliding, GGUFValueType.BOOL)
    t.key("attention.rope_pattern", [int(s) for s in sliding])
    _head(t, embd_scale=0.05)

    def ffn(i: int) -> None:
        t.add(f"blk.{i}.attn_sinks.weight", t.w(t.heads, scale=1.0))
        t.add(f"blk.{i}.attn_output.bias", t.w(t.width, scale=0.05))
        t.swiglu(i)
        for name, n in (("gate", t.ff), ("up", t.ff), ("down", t.width)):
            t.add(f"blk.{i}.ffn_{name}.bias", t.w(n, scale=0.05))

    _pre_norm_blocks(t, ffn)


# dots3note's full-attention layers (the others slide), over a main stack of 8: the nextn layer slides.
DOTS3NOTE_FULL = [0, 3, 6]


def _dots3note(t: Tiny) -> None:
    """MLA in two geometries: full-attention layers with a DSA indexer (a head of 64, the smallest
    Hadamard rotation of its cache) and a wider compressed KV, sliding-window layers with their own
    head count, KV rank, head sizes and RoPE base, both kinds by per-layer arrays (get_arr, required);
    a norm on the shared RoPE key and a sigmoid gate per head; a dense first layer, then sigmoid-routed
    MoE with a selection bias and a shared expert; one nextn layer past the main stack (dots3note.cpp)."""
    q_rank, rope, lead = 32, 16, 1
    geometry = {False: (t.heads, 32, 32, 32), True: (2, 16, 16, 16)}  # heads, kv rank, nope, v
    sliding = [i not in DOTS3NOTE_FULL for i in range(t.layers)]
    blocks = _moe_with_nextn(t)
    t.set("attention.head_count", [geometry[s][0] for s in [*sliding, True]])
    t.set("attention.head_count_kv", [1] * blocks)  # MQA over the compressed KV
    t.set("rope.dimension_count", rope)
    for swa, suffix in ((False, ""), (True, "_swa")):
        _, kv_rank, nope, v = geometry[swa]
        t.key(f"attention.kv_lora_rank{suffix}", kv_rank)
        t.key(f"attention.key_length_mla{suffix}", nope + rope)
        t.key(f"attention.value_length_mla{suffix}", v)
        (t.set if suffix == "" else t.key)(f"attention.key_length{suffix}", kv_rank + rope)
        (t.set if suffix == "" else t.key)(f"attention.value_length{suffix}", kv_rank)
    t.key("attention.q_lora_rank", q_rank)
    t.key("leading_dense_block_count", lead)
    t.key("expert_shared_count", 1)
    t.key("expert_gating_func", 2)
    t.key("expert_weights_norm", True)
    t.key("attention.sliding_window", 4)  # short, so the prompts reach past it
    t.key("attention.sliding_window_pattern", sliding, GGUFValueType.BOOL)
    t.key("rope.freq_base_swa", 1000.0)
    for suffix, value in (("head_count", 2), ("key_length", 64), ("top_k", 8)):
        t.key(f"attention.indexer.{suffix}", value)
    t.key("attention.indexer.types", [not s for s in sliding], GGUFValueType.BOOL)
    _head(t)
    for i, swa in enumerate([*sliding, True]):
        heads, kv_rank, nope, v = geometry[swa]
        t.norm(f"blk.{i}.attn_norm.weight")
        t.add(f"blk.{i}.attn_q_a.weight", t.w(q_rank, t.width))
        t.norm(f"blk.{i}.attn_q_a_norm.weight", q_rank)
        t.norm(f"blk.{i}.attn_kv_a_norm.weight", kv_rank)
        t.norm(f"blk.{i}.attn_k_norm.weight", rope)
        t.add(f"blk.{i}.attn_q_b.weight", t.w(heads * (nope + rope), q_rank))
        t.add(f"blk.{i}.attn_kv_a_mqa.weight", t.w(kv_rank + rope, t.width))
        t.add(f"blk.{i}.attn_k_b.weight", t.w(heads, kv_rank, nope))
        t.add(f"blk.{i}.attn_v_b.weight", t.w(heads, v, kv_rank))
        t.add(f"blk.{i}.attn_output.weight", t.w(t.width, heads * v))
        t.add(f"blk.{i}.attn_gate.weight", t.w(heads, t.width))
        t.norm(f"blk.{i}.ffn_norm.weight")
        if not swa:
            _indexer(t, i)
        if i >= t.layers:  # the nextn block: a dense FFN
            t.swiglu(i)
            _nextn(t, i)
            t.add(f"blk.{i}.nextn.embed_tokens.weight", t.w(t.vocab, t.width))
        else:
            _lead_dense_then_moe(t, i, lead)


TEXT_5: dict[str, Callable[[Tiny], None]] = {
    "dots3note": _dots3note,
    "maple": _maple,
    "spark2_5": _spark2_5,
    "hunyuan_vl": _hunyuan_vl,
    "granite_swa": _granite_swa,
}


WRITERS: dict[str, Callable[[Tiny], None]] = {
    "llama": _llama,
    "qwen3": _qwen3,
    "gemma3": _gemma3,
    "qwen2": _qwen2,
    "gemma2": _gemma2,
    "phi3": _phi3,
    "olmo2": _olmo2,
    "granite": _granite,
    "smollm3": _llama,  # llama-shaped; no RoPE on every 4th layer, from the index (smollm3.cpp)
    "mistral3": _mistral3,
    "qwen3moe": _qwen3moe,
    "gpt-oss": _gpt_oss,
    "deepseek2": _deepseek2,
    "llama4": _llama4,
    "glm4moe": _glm4moe,
    "mamba2": _mamba2,
    "mamba": _mamba,
    "rwkv6qwen2": _rwkv6qwen2,
    "plamo2": _plamo2,
    "kimi-linear": _kimi_linear,
    "lfm2": _lfm2,
    "granitehybrid": _granitehybrid,
    "qwen35": _qwen35,
    "qwen3next": _qwen3next,
    "qwen35moe": _qwen35moe,
    "minimax-m2": _minimax_m2,
    "mistral4": _mistral4,
    "step35": _step35,
    "mimo2": _mimo2,
    "glm4": _glm4,
    "qwen2moe": _qwen2moe,
    "olmoe": _olmoe,
    "seed_oss": _seed_oss,
    "ernie4_5-moe": _ernie4_5_moe,
    "exaone4": _exaone4,
    "cohere2": _cohere2,
    "hy_v3": _hy_v3,
    "falcon-h1": _falcon_h1,
    "nemotron_h": _nemotron_h,  # hyb
    "nemotron_h_moe": _nemotron_h_moe,  # hyb
    "jamba": _jamba,  # hyb
    "lfm2moe": _lfm2moe,  # hyb
    "bailingmoe3": _bailingmoe3,  # hyb
    **OLDER_DENSE,
    **OLDER,
    **DSA,
    **GEMMA4,
    **OLDER_4,
    **TEXT_5,
}

# A `general.name` containing "phi3" makes the vocab loader look for `<|endoftext|>`.
NAMES = {"phi3": "tiny-phi-three"}


def _talkie(t: Tiny) -> None:
    """Unweighted RMS norms, a q gain per head ({1, n_head}), an untied head, and a per-layer
    scale on the normalized token embeddings every layer adds back (talkie.cpp)."""
    t.key("logit_scale", 0.5)
    t.add("token_embd.weight", t.w(t.vocab, t.width))
    t.add("output.weight", t.w(t.vocab, t.width))
    for i in range(t.layers):
        t.attention(i)
        t.add(f"blk.{i}.attn_q_norm.weight", 1 + t.w(t.heads, 1, scale=0.1))
        t.swiglu(i)
        t.add(f"blk.{i}.layer_output_scale.weight", t.w(1, scale=0.5))


# A text family llama.cpp runs whose graph cannot be cut (ONE_NODE): served on one node.
ONE_NODE_WRITERS: dict[str, Callable[[Tiny], None]] = {"talkie": _talkie}
# minimax-m3 splits exactly but cannot speculate losslessly (ONE_NODE): one node
ONE_NODE_WRITERS |= MINIMAX_M3
# muse-glimmer RMS-normalizes any input before its first layer (ONE_NODE): one node
ONE_NODE_WRITERS["muse-glimmer"] = _muse_glimmer

# Recurrent families whose graph cannot be cut (architectures.ONE_NODE_STATEFUL): served on one node.
ONE_NODE_RECURRENT: dict[str, Callable[[Tiny], None]] = {"rwkv6": _rwkv6, "rwkv7": _rwkv7, "arwkv7": _arwkv7}

# Hybrids llama.cpp loads and decodes whole that meshpipe refuses: none left (nemotron_h, once
# refused for its layer output's name, is split through tap_name).
RECURRENT: dict[str, Callable[[Tiny], None]] = {}


# 8 layers allow one cut where cuts fall on every 4th layer (llama4, and the hybrids with attention
# on every 4th), and lfm2's (attention on every 3rd) one too, its last stage needing an attention
# layer: 12 allow a split in three.
LAYERS_OF = dict.fromkeys(("llama4", "lfm2", "granitehybrid", "qwen35", "qwen3next", "qwen35moe"), 12)
# hyb: nemotron_h's mixer, FFN, mixer, attention, and jamba's attention every 4th: cuts at 4 and 8
LAYERS_OF |= dict.fromkeys(("nemotron_h", "nemotron_h_moe", "jamba", "lfm2moe", "bailingmoe3"), 12)
LAYERS_OF |= dict.fromkeys(("plamo2", "kimi-linear"), 12)  # attention every 4th: cuts at 4 and 8
# Families that may split at any layer need few layers to show it: fewer cuts to run.
LAYERS_OF |= dict.fromkeys(("minimax-m2", "mistral4", "glm4", "qwen2moe", "olmoe", "seed_oss", "talkie",
                                 "ernie4_5-moe", "exaone4", "hy_v3"), 4)
# full attention at 0 and 4: cuts at 2, 3 and 5
LAYERS_OF |= dict.fromkeys(("step35", "mimo2"), 6)
# full attention at 3: cuts at 1, 2, 4 and 5
LAYERS_OF["cohere2"] = 6
# cuts at 3, 4 and 6: sliding layers, stages of 2 or more, the KV-sharing layers with their sources
LAYERS_OF["gemma4"] = len(GEMMA4_SLIDING)
# Older families, part 4: any cut in 4 layers; mellum's full attention at 3 (cuts 1, 2, 4, 5).
LAYERS_OF |= dict.fromkeys(("ernie4_5", "paddleocr", "bailingmoe2", "apertus", "deepseek2-ocr"), 4)
LAYERS_OF["mellum"] = 6
# cuts every 4th layer and no 4-layer stage: 8, 12 and 16 of 24
LAYERS_OF["smallthinker"] = 24
LAYERS_OF["afmoe"] = 12  # cuts every 4th layer: 4 and 8
# Part 5: full attention at 0 and 4 (cuts 2, 3 and 5); hunyuan_vl any cut in 4 layers.
LAYERS_OF |= dict.fromkeys(("maple", "spark2_5", "granite_swa"), 6)
LAYERS_OF["hunyuan_vl"] = 4
LAYERS_OF["dots3note"] = 8  # full attention at 0, 3 and 6 (DOTS3NOTE_FULL): cuts at 3 and 6


def write_tiny(path: Path, arch: str, layers: int | None = None, seed: int = 0, width: int = 64,
               router: GGMLQuantizationType = GGMLQuantizationType.Q8_0) -> Path:
    """A random-weight GGUF of `arch` that llama.cpp loads and decodes in milliseconds; MoE
    routers in `router` (Q8_0 or F32)."""
    writer = GGUFWriter(path, arch)
    writer.add_name(NAMES.get(arch, f"tiny-{arch}"))
    t = Tiny(writer, arch, layers or LAYERS_OF.get(arch, LAYERS), np.random.default_rng(seed), width=width,
             router=router)
    _common(t)
    (WRITERS | ONE_NODE_WRITERS | ONE_NODE_RECURRENT | RECURRENT)[arch](t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
