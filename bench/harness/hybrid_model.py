"""A random-weight Q4_0 `qwen35` or `qwen35moe` GGUF of a real hybrid's shape, for `mesh bench
--scenarios hybrid`, `--scenarios mtp` (with a nextn block) and (the MoE) `--scenarios shapes
--shape qwen3.5-moe-35b-a3b-8-layers`.

Qwen3.5's layer pattern: gated delta-net layers (a recurrent state per lane), with gated
attention on every `interval`-th layer, each followed by a SwiGLU FFN. The default shape is
about 1.1B parameters (24 layers, width 1536, the Qwen vocabulary of 151,936), whose
recurrent state is about 19 MB a lane, so a checkpoint costs what it would on a real model
of that size. With experts, each layer's FFN is Qwen3.5-MoE's: a router over `experts`, each
token's `experts_used` of them and a gated shared expert. The router is F32 and random, so a
window's rows go to different experts, as they do in use (a router of ones would tie every
expert and send each row to the same ones).

Matrices are random Q4_0 blocks (bench/harness/shape_model.py `q4_0_bytes`), the small beta
and alpha projections too: an F32 matrix's k-row product differs in the last bits from k
single rows, which under sampling from this model's nearly flat distribution parted speculative
output from plain. What llama.cpp keeps in F32 (norms, the convolution, the decay and time-step
vectors) is written in F32 with values that keep the state bounded: `ssm_a` negative, norms ones. The vocabulary is
shape_model's minimal SentencePiece one.

With `nextn`, one multi-token-prediction block follows the main stack (`block_count` counts it,
`nextn_predict_layers` = 1), as llama.cpp's qwen35 loader reads it (`load_block_mtp`): a
full-attention block with a dense FFN, and `nextn.eh_proj` over [token, hidden row] with its
norms and the head's; the token embeddings and the output head are the model's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGUFValueType, GGUFWriter

from bench.harness.shape_model import write_random_tensors

_F32 = 0  # a tensor entry's kind: F32 values of `shape`; else Q4_0 rows x cols
HEAD_NORMS = ("output_norm.weight", "nextn.shared_head_norm.weight")  # zeros in an agreeing model


@dataclass(frozen=True)
class HybridShape:
    name: str
    layers: int
    width: int
    ffn: int
    heads: int  # gated attention: query heads (attn_q holds the query and its gate)
    kv_heads: int
    head_dim: int
    k_heads: int  # delta-net key heads; value heads are `v_heads`, both of `state` dims
    v_heads: int
    state: int
    vocab: int
    interval: int = 4  # attention where (il + 1) % interval == 0
    conv: int = 4
    experts: int = 0  # > 0: qwen35moe, every FFN routed (`ffn` is then each expert's width)
    experts_used: int = 0
    shared_ffn: int = 0  # the shared expert's width
    nextn: int = 0  # MTP ("nextn") blocks past the main stack: 0 or 1, dense only (llama.cpp's qwen35 MTP)

    @property
    def architecture(self) -> str:
        return "qwen35moe" if self.experts else "qwen35"

    def write(self, path: Path, seed: int = 0) -> Path:
        return write_hybrid_gguf(path, self, seed)

    @property
    def blocks(self) -> int:
        """`block_count`: the main stack and the nextn blocks after it."""
        return self.layers + self.nextn

    def recurrent_layers(self) -> int:
        return sum(1 for i in range(self.layers) if (i + 1) % self.interval)

    def state_bytes(self) -> int:
        """A lane's recurrent state, as llama.cpp keeps it (F32): delta-net matrix and conv window."""
        key, value = self.k_heads * self.state, self.v_heads * self.state
        per_layer = self.v_heads * self.state * self.state + (self.conv - 1) * (2 * key + value)
        return 4 * per_layer * self.recurrent_layers()


QWEN35_1B = HybridShape("qwen3.5-like-1b", layers=24, width=1536, ffn=4096, heads=12, kv_heads=2, head_dim=128,
                        k_heads=16, v_heads=16, state=128, vocab=151936)
TINY_HYBRID = HybridShape("tiny-hybrid", layers=8, width=64, ffn=128, heads=4, kv_heads=2, head_dim=32,
                          k_heads=2, v_heads=4, state=32, vocab=512)
# Qwen3.5-35B-A3B's layers (the Qwen3.5-MoE family of the 397B-A17B, whose 3.6 GB a layer in
# Q4_0 would not fit twice on this machine), 8 of its 40: about 4.2 GB, 2 gated attention layers.
QWEN35_MOE_35B_8 = HybridShape("qwen3.5-moe-35b-a3b-8-layers", layers=8, width=2048, ffn=512, heads=16, kv_heads=2,
                               head_dim=256, k_heads=16, v_heads=32, state=128, vocab=248320, experts=256,
                               experts_used=8, shared_ffn=512)
TINY_MOE = HybridShape("tiny-moe", layers=4, width=64, ffn=32, heads=4, kv_heads=2, head_dim=32, k_heads=2,
                       v_heads=4, state=32, vocab=512, experts=8, experts_used=2, shared_ffn=32)
HYBRID_SHAPES = {s.name: s for s in (QWEN35_1B, TINY_HYBRID)}


def _tensors(s: HybridShape) -> list[tuple[str, tuple[int, ...], int]]:
    """(name, shape, kind) of every tensor: F32 `shape`, or Q4_0 (rows, cols) when kind is 1."""
    q4, f32 = 1, _F32
    key, value = s.k_heads * s.state, s.v_heads * s.state
    out: list[tuple[str, tuple[int, ...], int]] = [("token_embd.weight", (s.vocab, s.width), q4)]
    for i in range(s.layers):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (s.width,), f32), (b + "post_attention_norm.weight", (s.width,), f32)]
        if (i + 1) % s.interval == 0:
            out += _attention(s, b)
        else:
            out += [(b + "attn_qkv.weight", (2 * key + value, s.width), q4),
                    (b + "attn_gate.weight", (value, s.width), q4),
                    (b + "ssm_conv1d.weight", (2 * key + value, s.conv), f32), (b + "ssm_dt.bias", (s.v_heads,), f32),
                    (b + "ssm_a", (s.v_heads,), f32), (b + "ssm_beta.weight", (s.v_heads, s.width), q4),
                    (b + "ssm_alpha.weight", (s.v_heads, s.width), q4), (b + "ssm_norm.weight", (s.state,), f32),
                    (b + "ssm_out.weight", (s.width, value), q4)]
        out += _ffn(s, b)
    out += [t for i in range(s.layers, s.blocks) for t in _nextn(s, f"blk.{i}.")]
    return [*out, ("output_norm.weight", (s.width,), f32), ("output.weight", (s.vocab, s.width), q4)]


def _attention(s: HybridShape, b: str) -> list[tuple[str, tuple[int, ...], int]]:
    """Gated attention: the query and its gate in one projection, q and k normed."""
    q4, f32 = 1, _F32
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    return [(b + "attn_q.weight", (2 * q, s.width), q4), (b + "attn_k.weight", (kv, s.width), q4),
            (b + "attn_v.weight", (kv, s.width), q4), (b + "attn_output.weight", (s.width, q), q4),
            (b + "attn_q_norm.weight", (s.head_dim,), f32), (b + "attn_k_norm.weight", (s.head_dim,), f32)]


def _nextn(s: HybridShape, b: str) -> list[tuple[str, tuple[int, ...], int]]:
    """An MTP block as llama.cpp's qwen35 `load_block_mtp` reads it: a full-attention block with
    a dense FFN, and the projection of [embedded token, hidden row] with their norms and the head's
    (the token embeddings and output head are the model's own)."""
    assert not s.experts, "llama.cpp's qwen35 MTP block has a dense FFN: no nextn on qwen35moe here"
    out: list[tuple[str, tuple[int, ...], int]] = [
        (b + name, (s.width,), _F32) for name in ("attn_norm.weight", "post_attention_norm.weight")]
    out += [*_attention(s, b), *_ffn(s, b), (b + "nextn.eh_proj.weight", (s.width, 2 * s.width), 1)]
    return out + [(b + f"nextn.{name}.weight", (s.width,), _F32) for name in ("enorm", "hnorm", "shared_head_norm")]


def _ffn(s: HybridShape, b: str) -> list[tuple[str, tuple[int, ...], int]]:
    """A layer's FFN: SwiGLU, or with experts the router, the routed experts (one 3-D tensor
    each of gate, up and down) and the shared expert with its F32 gate row."""
    q4, f32 = 1, _F32
    if not s.experts:
        return [(b + "ffn_gate.weight", (s.ffn, s.width), q4), (b + "ffn_up.weight", (s.ffn, s.width), q4),
                (b + "ffn_down.weight", (s.width, s.ffn), q4)]
    e, sh = s.experts, s.shared_ffn
    return [(b + "ffn_gate_inp.weight", (e, s.width), f32), (b + "ffn_gate_exps.weight", (e, s.ffn, s.width), q4),
            (b + "ffn_up_exps.weight", (e, s.ffn, s.width), q4), (b + "ffn_down_exps.weight", (e, s.width, s.ffn), q4),
            (b + "ffn_gate_inp_shexp.weight", (s.width,), f32), (b + "ffn_gate_shexp.weight", (sh, s.width), q4),
            (b + "ffn_up_shexp.weight", (sh, s.width), q4), (b + "ffn_down_shexp.weight", (s.width, sh), q4)]


def _f32(name: str, shape: tuple[int, ...], rng: np.random.Generator, agreeing: bool) -> np.ndarray:
    if name.endswith("norm.weight"):
        return (np.zeros if agreeing and name.endswith(HEAD_NORMS) else np.ones)(shape, np.float32)
    if name.endswith("ssm_a"):
        return -np.exp(rng.standard_normal(shape)).astype(np.float32)  # A < 0: the state decays
    scale = 1 / np.sqrt(shape[-1]) if len(shape) > 1 else 0.05
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def write_hybrid_gguf(path: Path, shape: HybridShape, seed: int = 0, agreeing: bool = False) -> Path:
    """`shape` as a random-weight qwen35 (or qwen35moe) GGUF at `path`, one tensor in memory at a time.

    `agreeing`: the output norm and the MTP head's norm are zeros, so every row's logits are
    zero and the target's greedy pick and its MTP layer's are both token 0 (the first of a
    tie), always: every MTP draft is right (tests/mtp_models.py's `agreeing`, written here).
    The compute is the model's own, row for row; only what the rows say is fixed."""
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(path, shape.architecture)
    _metadata(writer, shape, agreeing)
    tensors = [(name, dims, kind != _F32) for name, dims, kind in _tensors(shape)]
    write_random_tensors(writer, tensors, lambda name, dims: _f32(name, dims, rng, agreeing), rng)
    return path


def _metadata(w: GGUFWriter, s: HybridShape, agreeing: bool) -> None:
    arch = s.architecture
    w.add_name(f"random {s.name} Q4_0")
    for key, value in (("context_length", 8192), ("embedding_length", s.width), ("block_count", s.blocks),
                       ("feed_forward_length", s.ffn), ("attention.head_count", s.heads),
                       ("attention.head_count_kv", s.kv_heads), ("attention.key_length", s.head_dim),
                       ("attention.value_length", s.head_dim), ("rope.dimension_count", s.head_dim // 2),
                       ("ssm.conv_kernel", s.conv), ("ssm.inner_size", s.v_heads * s.state),
                       ("ssm.state_size", s.state), ("ssm.group_count", s.k_heads),
                       ("ssm.time_step_rank", s.v_heads), ("full_attention_interval", s.interval)):
        w.add_key_value(f"{arch}.{key}", value, GGUFValueType.UINT32)
    if s.nextn:
        w.add_key_value(f"{arch}.nextn_predict_layers", s.nextn, GGUFValueType.UINT32)
    if s.experts:
        for key, value in (("expert_count", s.experts), ("expert_used_count", s.experts_used),
                           ("expert_feed_forward_length", s.ffn), ("expert_shared_feed_forward_length", s.shared_ffn)):
            w.add_key_value(f"{arch}.{key}", value, GGUFValueType.UINT32)
    w.add_key_value(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6, GGUFValueType.FLOAT32)
    w.add_key_value(f"{arch}.rope.freq_base", 10_000_000.0, GGUFValueType.FLOAT32)
    quarter = s.head_dim // 16  # M-RoPE sections, half the rotated dims: time, height, width
    w.add_key_value(f"{arch}.rope.dimension_sections", [2 * quarter, quarter, quarter, 0], GGUFValueType.ARRAY,
                    sub_type=GGUFValueType.INT32)
    w.add_file_type(2)  # MOSTLY_Q4_0
    _vocabulary(w, s.vocab, agreeing)


def _vocabulary(w: GGUFWriter, vocab: int, agreeing: bool) -> None:
    """shape_model's minimal SentencePiece vocabulary. An agreeing model's greedy token is id 0,
    which there is a plain piece (and `<unk>` the last id), so its reply streams text."""
    tokens = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)]]
    tokens += [f"<t{i}>" for i in range(len(tokens), vocab)]
    types = [2, 3, 3] + [6] * 256 + [1] * (vocab - 3 - 256)
    unk = 0
    if agreeing:
        tokens[0], tokens[-1], types[0], types[-1], unk = "<t0>", "<unk>", 1, 2, vocab - 1
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * vocab)
    w.add_token_types(types)
    w.add_unk_token_id(unk)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
