"""A random-weight Q4_0 llama GGUF of a real model's shape, for `mesh bench --scenarios shapes`.

Nothing is quantized: every Q4_0 block (32 weights in 18 bytes, an f16 scale and 16 bytes
of 4-bit values) is written as random bytes with its scale overwritten by a small f16, so
llama.cpp computes finite numbers and the 8B shape writes in seconds. The tensors are
streamed (GGUFWriter's tensor infos first, then each tensor as it is made), so memory holds
one tensor at a time. Every matrix is Q4_0, the token embeddings and the output head
included (a llama.cpp Q4_0 file of Llama-3.1-8B keeps its head in Q6_K: the head here is
about 6% smaller than that one's); norms are F32 ones. Llama 3.1's `rope_freqs` (its RoPE
scaling beyond 8k) is left out: the bench never decodes past a few hundred positions.

The vocabulary is a minimal SentencePiece one (llama.cpp's loader needs a valid tokenizer):
unknown, BOS and EOS, the 256 `<0xNN>` byte tokens, then `<tN>` pieces up to the shape's size,
so the embeddings and the head have the real model's rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter

Q4_0_BLOCK, Q4_0_BYTES = 32, 18  # weights per block, bytes per block (f16 scale + 16 bytes of nibbles)
_SPECIALS = 3  # <unk>, <s>, </s>


@dataclass(frozen=True)
class Shape:
    """The dimensions of a llama-architecture model."""

    name: str
    layers: int
    width: int  # embedding length
    ffn: int  # feed-forward length
    heads: int
    kv_heads: int
    vocab: int
    rope_base: float = 500000.0

    @property
    def head_dim(self) -> int:
        return self.width // self.heads

    def matrices(self) -> list[tuple[str, int, int]]:
        """(name, rows, columns) of every Q4_0 tensor, in file order; norms are not listed."""
        kv = self.kv_heads * self.head_dim
        layer = [("attn_q", self.width, self.width), ("attn_k", kv, self.width), ("attn_v", kv, self.width),
                 ("attn_output", self.width, self.width), ("ffn_gate", self.ffn, self.width),
                 ("ffn_up", self.ffn, self.width), ("ffn_down", self.width, self.ffn)]
        return [("token_embd.weight", self.vocab, self.width),
                *[(f"blk.{i}.{n}.weight", r, c) for i in range(self.layers) for n, r, c in layer],
                ("output.weight", self.vocab, self.width)]

    def write(self, path: Path, seed: int = 0) -> Path:
        return write_shape_gguf(path, self, seed)

    def weight_bytes(self) -> int:
        """Bytes of tensor data: every matrix in Q4_0, and the F32 norms."""
        q = sum(r * c // Q4_0_BLOCK * Q4_0_BYTES for _, r, c in self.matrices())
        return q + 4 * self.width * (2 * self.layers + 1)


LLAMA_3_1_8B = Shape("llama-3.1-8b", layers=32, width=4096, ffn=14336, heads=32, kv_heads=8, vocab=128256)
TINY = Shape("tiny", layers=2, width=64, ffn=128, heads=4, kv_heads=2, vocab=512)  # the fast test's
SHAPES = {s.name: s for s in (LLAMA_3_1_8B, TINY)}


def q4_0_bytes(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q4_0 blocks of a rows x cols matrix, each scale 1/(4.6 sqrt(cols)): a random 4-bit
    value less 8 has a deviation of about 4.6, so a product with a unit vector stays near unit size."""
    if cols % Q4_0_BLOCK:
        raise ValueError(f"a Q4_0 row needs a multiple of {Q4_0_BLOCK} columns, not {cols}")
    n = rows * cols // Q4_0_BLOCK * Q4_0_BYTES
    data = rng.bit_generator.random_raw(-(-n // 8)).view(np.uint8)[:n].reshape(rows, -1)
    blocks = data.reshape(-1, Q4_0_BYTES)
    blocks[:, 0:2] = np.frombuffer(np.float16(1 / (4.6 * math.sqrt(cols))).tobytes(), np.uint8)
    return data


def write_shape_gguf(path: Path, shape: Shape, seed: int = 0) -> Path:
    """`shape` as a random-weight Q4_0 llama GGUF at `path`."""
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(path, "llama")
    _metadata(writer, shape)
    # a norm (0 rows): F32 ones of `cols`
    tensors = [(name, (rows, cols) if rows else (cols,), rows > 0) for name, rows, cols in _tensor_order(shape)]
    write_random_tensors(writer, tensors, lambda _, dims: np.ones(dims, np.float32), rng)
    return path


def write_random_tensors(writer: GGUFWriter, tensors: Sequence[tuple[str, tuple[int, ...], bool]],
                         f32: Callable[[str, tuple[int, ...]], np.ndarray], rng: np.random.Generator) -> None:
    """Declare each (name, dims, quantized) tensor, then write them as they are made, one in
    memory at a time: random Q4_0 rows of the last dim's columns where quantized (a 3-D tensor
    is a stack of matrices, an MoE's experts), else `f32(name, dims)`."""
    for name, dims, quantized in tensors:
        if quantized:
            rows, cols = int(np.prod(dims[:-1])), dims[-1]
            writer.add_tensor_info(name, (*dims[:-1], cols // Q4_0_BLOCK * Q4_0_BYTES), np.dtype(np.uint8),
                                   rows * cols // Q4_0_BLOCK * Q4_0_BYTES, raw_dtype=GGMLQuantizationType.Q4_0)
        else:
            writer.add_tensor_info(name, dims, np.dtype(np.float32), 4 * int(np.prod(dims)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, dims, quantized in tensors:
        if quantized:
            data = q4_0_bytes(int(np.prod(dims[:-1])), dims[-1], rng).reshape(*dims[:-1], -1)
        else:
            data = f32(name, dims)
        writer.write_tensor_data(data)
    writer.close()


def _tensor_order(shape: Shape) -> list[tuple[str, int, int]]:
    """Every tensor as llama.cpp's converter orders them; a norm has 0 rows."""
    matrices = {name: (r, c) for name, r, c in shape.matrices()}
    out = [("token_embd.weight", *matrices["token_embd.weight"])]
    for i in range(shape.layers):
        names = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up",
                 "ffn_down"]
        for n in names:
            full = f"blk.{i}.{n}.weight"
            out.append((full, *matrices[full]) if full in matrices else (full, 0, shape.width))
    return [*out, ("output_norm.weight", 0, shape.width), ("output.weight", *matrices["output.weight"])]


def _metadata(writer: GGUFWriter, shape: Shape) -> None:
    writer.add_name(f"random {shape.name} Q4_0")
    writer.add_context_length(8192)
    writer.add_embedding_length(shape.width)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_base)
    writer.add_file_type(2)  # MOSTLY_Q4_0
    tokens = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)]]
    if shape.vocab < len(tokens):
        raise ValueError(f"a vocabulary needs at least {len(tokens)} tokens, not {shape.vocab}")
    tokens += [f"<t{i}>" for i in range(len(tokens), shape.vocab)]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * shape.vocab)
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * (shape.vocab - _SPECIALS - 256))
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
