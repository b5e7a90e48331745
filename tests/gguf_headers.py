"""Header-only GGUFs of frontier models' published shapes: metadata and tensor infos with
the real shapes and types, and no tensor data (the file ends where the header does), so
`mesh plan` can be tested on a 700B model in milliseconds.

Shapes are llama.cpp's (`create_tensor` in vendor/llama.cpp/src/models/<arch>.cpp, ggml
order: the input dimension first), sized from each model's published config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

Shape = tuple[int, ...]
Q = GGMLQuantizationType


def write_header(path: Path, arch: str, metadata: dict[str, Any], tensors: list[tuple[str, Shape]],
                 experts: GGMLQuantizationType | None = None) -> Path:
    """Write only the header: GGUFWriter's header, metadata and tensor infos, then close
    without the data. `experts` is the type of `_exps` tensors (default: as any matrix)."""
    writer = GGUFWriter(path, arch)
    for key, value in metadata.items():
        _add(writer, key if key.startswith(("general.", "split.")) else f"{arch}.{key}", value)
    for name, shape in tensors:
        kind = experts if experts is not None and "_exps." in name else _type(shape)
        block, size = GGML_QUANT_SIZES[kind]
        writer.add_tensor_info(name, tuple(reversed(shape)), np.dtype(np.float32),
                               int(np.prod(shape)) * size // block, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    return path


def _add(writer: GGUFWriter, key: str, value: Any) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, list):
        writer.add_array(key, value)
    else:
        writer.add_string(key, str(value))


def _type(shape: Shape) -> GGMLQuantizationType:
    """Q4_K where a row is whole super-blocks, else Q8_0, and norms and vectors F32 (as a
    Q4_K_M file keeps them)."""
    if len(shape) == 1 or shape[0] % 32:
        return Q.F32
    return Q.Q4_K if shape[0] % 256 == 0 else Q.Q8_0


def _globals(n_embd: int, vocab: int) -> list[tuple[str, Shape]]:
    return [("token_embd.weight", (n_embd, vocab)), ("output_norm.weight", (n_embd,)),
            ("output.weight", (n_embd, vocab))]


def _moe(il: int, n_embd: int, n_ff: int, experts: int, shared: int) -> list[tuple[str, Shape]]:
    out = [(f"blk.{il}.ffn_gate_inp.weight", (n_embd, experts)),
           (f"blk.{il}.ffn_gate_exps.weight", (n_embd, n_ff, experts)),
           (f"blk.{il}.ffn_up_exps.weight", (n_embd, n_ff, experts)),
           (f"blk.{il}.ffn_down_exps.weight", (n_ff, n_embd, experts))]
    if shared:
        out += [(f"blk.{il}.ffn_gate_shexp.weight", (n_embd, shared)), (f"blk.{il}.ffn_up_shexp.weight",
                (n_embd, shared)), (f"blk.{il}.ffn_down_shexp.weight", (shared, n_embd))]
    return out


def qwen35_397b(path: Path) -> Path:
    """Qwen3.5-397B-A17B: 60 layers of 4096, 15 x (3 gated delta-net + 1 gated attention),
    512 experts of 1024 (10 routed + 1 shared), 32 query / 2 KV heads of 256, one MTP layer."""
    e, layers = 4096, 60
    tensors = _globals(e, 248320)
    for il in range(layers + 1):
        tensors += [(f"blk.{il}.attn_norm.weight", (e,)), (f"blk.{il}.post_attention_norm.weight", (e,))]
        if (il + 1) % 4 == 0 or il == layers:  # full attention, and the MTP layer's
            tensors += [(f"blk.{il}.attn_q.weight", (e, 256 * 32 * 2)), (f"blk.{il}.attn_k.weight", (e, 512)),
                        (f"blk.{il}.attn_v.weight", (e, 512)), (f"blk.{il}.attn_output.weight", (8192, e)),
                        (f"blk.{il}.attn_q_norm.weight", (256,)), (f"blk.{il}.attn_k_norm.weight", (256,))]
        else:  # gated delta-net: 16 QK heads and 64 V heads of 128
            tensors += [(f"blk.{il}.attn_qkv.weight", (e, 12288)), (f"blk.{il}.attn_gate.weight", (e, 8192)),
                        (f"blk.{il}.ssm_conv1d.weight", (4, 12288)), (f"blk.{il}.ssm_dt.bias", (64,)),
                        (f"blk.{il}.ssm_a", (64,)), (f"blk.{il}.ssm_beta.weight", (e, 64)),
                        (f"blk.{il}.ssm_alpha.weight", (e, 64)), (f"blk.{il}.ssm_norm.weight", (128,)),
                        (f"blk.{il}.ssm_out.weight", (8192, e))]
        tensors += [*_moe(il, e, 1024, 512, 1024), (f"blk.{il}.ffn_gate_inp_shexp.weight", (e,))]
    tensors.append((f"blk.{layers}.nextn.eh_proj.weight", (2 * e, e)))
    meta = {"block_count": layers + 1, "nextn_predict_layers": 1, "embedding_length": e,
            "context_length": 262144, "attention.head_count": 32, "attention.head_count_kv": 2,
            "attention.key_length": 256, "attention.value_length": 256, "expert_count": 512,
            "expert_used_count": 10, "expert_feed_forward_length": 1024,
            "expert_shared_feed_forward_length": 1024, "full_attention_interval": 4, "ssm.conv_kernel": 4,
            "ssm.inner_size": 8192, "ssm.state_size": 128, "ssm.time_step_rank": 64, "ssm.group_count": 16}
    return write_header(path, "qwen35moe", meta, tensors)


def _mla_layer(il: int, e: int, heads: int, q_lora: int, k_mla: int, v_mla: int,
               indexer: tuple[int, int]) -> list[tuple[str, Shape]]:
    """Multi-head latent attention (kv_lora 512, RoPE 64) with a DSA indexer (heads, key length)."""
    nope, (ih, ik) = k_mla - 64, indexer
    return [(f"blk.{il}.attn_norm.weight", (e,)), (f"blk.{il}.attn_q_a_norm.weight", (q_lora,)),
            (f"blk.{il}.attn_kv_a_norm.weight", (512,)), (f"blk.{il}.attn_q_a.weight", (e, q_lora)),
            (f"blk.{il}.attn_q_b.weight", (q_lora, heads * k_mla)), (f"blk.{il}.attn_kv_a_mqa.weight", (e, 576)),
            (f"blk.{il}.attn_k_b.weight", (nope, 512, heads)), (f"blk.{il}.attn_v_b.weight", (512, v_mla, heads)),
            (f"blk.{il}.attn_output.weight", (heads * v_mla, e)), (f"blk.{il}.ffn_norm.weight", (e,)),
            (f"blk.{il}.indexer.k_norm.weight", (ik,)), (f"blk.{il}.indexer.k_norm.bias", (ik,)),
            (f"blk.{il}.indexer.proj.weight", (e, ih)), (f"blk.{il}.indexer.attn_k.weight", (e, ik)),
            (f"blk.{il}.indexer.attn_q_b.weight", (q_lora, ih * ik))]


def _dsa_model(path: Path, arch: str, c: dict[str, int]) -> Path:
    """A DeepSeek-V3.2-like model: MLA + DSA indexer, `lead` dense layers, then MoE; one MTP layer."""
    e, layers = c["embd"], c["layers"]
    tensors = _globals(e, c["vocab"])
    for il in range(layers + 1):
        tensors += _mla_layer(il, e, c["heads"], c["q_lora"], c["k_mla"], c["v_mla"], (c["ih"], 128))
        if il < 3:
            tensors += [(f"blk.{il}.ffn_gate.weight", (e, c["ff"])), (f"blk.{il}.ffn_up.weight", (e, c["ff"])),
                        (f"blk.{il}.ffn_down.weight", (c["ff"], e))]
        else:
            tensors += [*_moe(il, e, 2048, 256, 2048), (f"blk.{il}.exp_probs_b.bias", (256,))]
    tensors.append((f"blk.{layers}.nextn.eh_proj.weight", (2 * e, e)))
    meta = {"block_count": layers + 1, "nextn_predict_layers": 1, "embedding_length": e, "vocab_size": c["vocab"],
            "attention.head_count": c["heads"], "attention.head_count_kv": 1, "attention.q_lora_rank": c["q_lora"],
            "attention.kv_lora_rank": 512, "attention.key_length_mla": c["k_mla"],
            "attention.value_length_mla": c["v_mla"], "rope.dimension_count": 64, "leading_dense_block_count": 3,
            "feed_forward_length": c["ff"], "expert_count": 256, "expert_used_count": 8, "expert_shared_count": 1,
            "expert_feed_forward_length": 2048, "expert_gating_func": 2, "attention.indexer.head_count": c["ih"],
            "attention.indexer.key_length": 128, "attention.indexer.top_k": 2048}
    return write_header(path, arch, meta, tensors)


def deepseek_v32(path: Path) -> Path:
    """DeepSeek-V3.2: 61 layers of 7168 (3 dense), 256 experts of 2048 (8 routed + 1 shared),
    128 heads, q LoRA 1536, an indexer of 64 heads."""
    return _dsa_model(path, "deepseek32", {"embd": 7168, "layers": 61, "vocab": 129280, "heads": 128,
                                           "q_lora": 1536, "k_mla": 192, "v_mla": 128, "ih": 64, "ff": 18432})


def glm5(path: Path) -> Path:
    """GLM-5: 78 layers of 6144 (3 dense), 256 experts of 2048 (8 routed + 1 shared), 64 heads,
    q LoRA 2048, key 256 and value 256 per head, an indexer of 32 heads."""
    return _dsa_model(path, "glm-dsa", {"embd": 6144, "layers": 78, "vocab": 154880, "heads": 64,
                                        "q_lora": 2048, "k_mla": 256, "v_mla": 256, "ih": 32, "ff": 12288})


def gpt_oss_120b(path: Path) -> Path:
    """gpt-oss-120b: 36 layers of 2880, 128 MXFP4 experts of 2880 (4 routed), 64 query / 8 KV
    heads of 64, sliding window on every other layer."""
    e, layers = 2880, 36
    tensors = _globals(e, 201088)
    for il in range(layers):
        tensors += [(f"blk.{il}.attn_norm.weight", (e,)), (f"blk.{il}.post_attention_norm.weight", (e,)),
                    (f"blk.{il}.attn_q.weight", (e, 4096)), (f"blk.{il}.attn_k.weight", (e, 512)),
                    (f"blk.{il}.attn_v.weight", (e, 512)), (f"blk.{il}.attn_output.weight", (4096, e)),
                    (f"blk.{il}.attn_output.bias", (e,)), (f"blk.{il}.attn_sinks.weight", (64,)),
                    (f"blk.{il}.ffn_gate_inp.bias", (128,)), (f"blk.{il}.ffn_gate_exps.bias", (e, 128)),
                    (f"blk.{il}.ffn_up_exps.bias", (e, 128)), (f"blk.{il}.ffn_down_exps.bias", (e, 128))]
        tensors += _moe(il, e, e, 128, 0)
    meta = {"block_count": layers, "embedding_length": e, "context_length": 131072, "attention.head_count": 64,
            "attention.head_count_kv": 8, "attention.key_length": 64, "attention.value_length": 64,
            "attention.sliding_window": 128, "expert_count": 128, "expert_used_count": 4,
            "expert_feed_forward_length": e}
    return write_header(path, "gpt-oss", meta, tensors, experts=Q.MXFP4)


SHAPES = {"qwen3.5-397b-a17b": qwen35_397b, "deepseek-v3.2": deepseek_v32, "glm-5": glm5,
          "gpt-oss-120b": gpt_oss_120b}
