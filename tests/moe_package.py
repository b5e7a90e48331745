"""A hand-written mixture-of-experts package for the planner's and the page's tests.

Not a model llama.cpp decodes: only the tensors whose parameters and bytes count. Its layers
are dense first, then mixture of experts (as DeepSeek's leading dense blocks are), written
under `qwen3moe`, an architecture `write_package` serves.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFValueType, GGUFWriter

from packages.manifest import Manifest
from packages.writer import write_package

WIDTH, FF, EXPERTS, USED = 16, 32, 8, 2
ATTENTION = 4 * WIDTH * WIDTH + 2 * WIDTH  # q, k, v, output; the two norms
DENSE = ATTENTION + 3 * WIDTH * FF
EXPERT_WEIGHTS = 3 * EXPERTS * FF * WIDTH  # ffn_{gate,up,down}_exps
ROUTER = EXPERTS * WIDTH  # ffn_gate_inp
MOE = ATTENTION + ROUTER + EXPERT_WEIGHTS
MOE_ACTIVE = ATTENTION + ROUTER + EXPERT_WEIGHTS * USED // EXPERTS


def write_moe_gguf(path: Path, dense: int = 2, moe: int = 4, used: int | list[int] = USED) -> Path:
    """`dense` dense layers, then `moe` layers of EXPERTS experts, `used` of them per token
    (a list: `qwen3moe.expert_used_count` as a per-layer array)."""
    rng = np.random.default_rng(0)

    def w(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    writer = GGUFWriter(path, "qwen3moe")
    writer.add_block_count(dense + moe)
    writer.add_embedding_length(WIDTH)
    writer.add_context_length(64)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_expert_count(EXPERTS)
    if isinstance(used, list):
        writer.add_key_value("qwen3moe.expert_used_count", used, GGUFValueType.ARRAY, sub_type=GGUFValueType.UINT32)
    else:
        writer.add_expert_used_count(used)
    writer.add_tensor("token_embd.weight", w(32, WIDTH))
    writer.add_tensor("output_norm.weight", w(WIDTH))
    writer.add_tensor("output.weight", w(32, WIDTH))
    for i in range(dense + moe):
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            writer.add_tensor(f"blk.{i}.{name}.weight", w(WIDTH, WIDTH))
        writer.add_tensor(f"blk.{i}.attn_norm.weight", w(WIDTH))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", w(WIDTH))
        if i < dense:
            for name in ("ffn_gate", "ffn_up", "ffn_down"):
                writer.add_tensor(f"blk.{i}.{name}.weight", w(FF, WIDTH))
        else:
            writer.add_tensor(f"blk.{i}.ffn_gate_inp.weight", w(EXPERTS, WIDTH))
            for name in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
                writer.add_tensor(f"blk.{i}.{name}.weight", w(EXPERTS, FF, WIDTH))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_moe_package(tmp: Path, dense: int = 2, moe: int = 4, used: int | list[int] = USED) -> tuple[Path, Manifest]:
    src = write_moe_gguf(tmp / "moe.gguf", dense, moe, used)
    out = tmp / "moe-package"
    return out, write_package(src, out, progress=lambda _: None)
