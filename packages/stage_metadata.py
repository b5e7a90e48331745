"""The metadata a package keeps, and what each stage's GGUF says (DESIGN.md §3 step 1).

Two passes. `package_metadata` runs once, when a package is written: it drops the layers past
the main stack and writes out the sliding-window pattern llama.cpp would derive from the
index. `stage_metadata` runs for each stage [a, b): the layer count, per-layer arrays sliced,
counts from the front shifted, and scalars meant for token input made neutral after stage 0.
The layers past the main stack (nextn/MTP) keep their entries of the per-layer arrays apart
(`nextn_entries`, in each MTP artifact), and `with_mtp` puts them back on a final stage that runs them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from gguf import GGUFValueType

from packages.architecture_kinds import PER_LAYER_KEYS
from packages.architectures import (
    DEEPSEEK2_HPARAMS,
    INDEXER_TYPES,
    MTP_FROM_LAYER_0,
    RULES,
    deepseek2_is_lite,
    deepseek2_vocab,
    kv_shared_layers,
    stage_refusal,
    swa_key,
)
from packages.errors import PackageError
from packages.gguf_files import KeyValue


def package_metadata(arch: str, metadata: Sequence[KeyValue]) -> tuple[list[KeyValue], int]:
    """(the package's metadata, its layer count): nextn layers dropped, the swa pattern written."""
    kvs = {kv.key: kv for kv in metadata}
    blocks = int(kvs[f"{arch}.block_count"].value)
    # Multi-token-prediction layers sit past the main stack: llama.cpp builds the decode
    # graph over n_layer() = block_count - nextn_predict_layers, and only a final stage that
    # drafts with them loads them (deepseek2.cpp, glm4-moe.cpp): they travel as artifacts of
    # their own, with their entries of the per-layer arrays (`nextn_entries`).
    main = main_layers(arch, metadata)
    out = [_layers(kv, arch, 0, main, blocks) for kv in metadata]
    out = [replace(kv, value=0) if kv.key == f"{arch}.nextn_predict_layers" else kv for kv in out]
    rule = RULES.get(arch)
    pattern = kvs.get(swa_key(arch))
    if rule is not None and rule.swa_pattern is not None and (pattern is None or not isinstance(pattern.value, list)):
        n = int(pattern.value) if pattern is not None else rule.swa_pattern[0]
        out = [kv for kv in out if kv.key != swa_key(arch)]
        out.append(KeyValue(swa_key(arch), swa_layers(n, rule.swa_pattern[1], main), GGUFValueType.ARRAY,
                            GGUFValueType.BOOL))
    if arch in DEEPSEEK2_HPARAMS:
        out = _deepseek2_keys(out, main, arch)
    if arch == "glm4moe":
        out = _glm4moe_keys(out)
    if rule is not None and rule.shared_indexers:
        out = _indexer_types(out, arch, main)
    if arch in ("minicpm", "grok"):
        out = _scale_defaults(out, arch, main)
    return out, main


def main_layers(arch: str, metadata: Sequence[KeyValue]) -> int:
    """block_count less the nextn layers: llama.cpp's n_layer()."""
    values = {kv.key: kv.value for kv in metadata}
    return int(values[f"{arch}.block_count"]) - int(values.get(f"{arch}.nextn_predict_layers") or 0)


def nextn_entries(arch: str, metadata: Sequence[KeyValue]) -> list[list[KeyValue]]:
    """For each nextn layer, its entry of every per-layer array that covers all block_count
    layers (one-entry arrays of the same type): the package's arrays stop at the main stack,
    and a final stage that runs the nextn layers must give llama.cpp arrays of its block_count
    (`get_key_or_arr(..., n_layer_all)`). Arrays of the main stack alone (n_layer() long, as
    the indexer kinds) and arrays the package derives (the swa pattern) have no entry: llama.cpp
    reads no nextn value from them."""
    blocks = next(int(kv.value) for kv in metadata if kv.key == f"{arch}.block_count")
    arrays = [kv for kv in metadata if kv.key.removeprefix(f"{arch}.") in PER_LAYER_KEYS
              and isinstance(kv.value, list) and len(kv.value) == blocks]
    return [[replace(kv, value=kv.value[i:i + 1]) for kv in arrays]
            for i in range(main_layers(arch, metadata), blocks)]


def with_mtp(arch: str, metadata: Sequence[KeyValue], entries: Sequence[Sequence[KeyValue]]) -> list[KeyValue]:
    """A final stage's metadata with its nextn layers after its own: block_count and
    nextn_predict_layers counting them, each per-layer array extended by their entries. An
    architecture that runs MTP from layer 0 only (MTP_FROM_LAYER_0) goes without M-RoPE sections."""
    if arch in MTP_FROM_LAYER_0:
        metadata = [kv for kv in metadata if kv.key != f"{arch}.rope.dimension_sections"]
    n = len(entries)
    tails: dict[str, list[object]] = {}
    for layer in entries:
        for kv in layer:
            if isinstance(kv.value, list):
                tails.setdefault(kv.key, []).extend(kv.value)
    nextn_key, count_key = f"{arch}.nextn_predict_layers", f"{arch}.block_count"
    out = []
    for kv in metadata:
        if kv.key == count_key:
            kv = replace(kv, value=int(kv.value) + n)
        elif kv.key == nextn_key:
            kv = replace(kv, value=n)
        elif kv.key in tails and isinstance(kv.value, list):
            kv = replace(kv, value=[*kv.value, *tails[kv.key]])
        out.append(kv)
    if not any(kv.key == nextn_key for kv in metadata):
        out.append(KeyValue(nextn_key, n, GGUFValueType.UINT32, None))
    return out


def _scale_defaults(metadata: list[KeyValue], arch: str, main: int) -> list[KeyValue]:
    """The scales load_arch_hparams defaults where the keys are absent, written out, so a stage
    keeps the whole model's residual scale and a later stage can turn the embedding scale off:
    llama_model_minicpm's 12 and 1.4/√n_layer(), llama_model_grok's 78.38367176906169."""
    have = {kv.key for kv in metadata}
    f32 = GGUFValueType.FLOAT32
    defaults = {"minicpm.embedding_scale": 12.0, "minicpm.residual_scale": 1.4 / math.sqrt(main)} \
        if arch == "minicpm" else {"grok.embedding_scale": 78.38367176906169}
    return [*metadata, *(KeyValue(key, value, f32, None) for key, value in defaults.items() if key not in have)]


def _glm4moe_keys(metadata: list[KeyValue]) -> list[KeyValue]:
    """llama_model_glm4_moe::graph aborts on embedding input unless the model uses M-RoPE
    ("This GGUF does not support multimodal"), and text-only GLM-4.5 GGUFs carry no
    rope.dimension_sections, so a later stage could not run. Sections are written where absent:
    with the same position in every section (llm_graph_input_pos::set_input widens token
    positions so; the engine does for embedding input), ggml's M-RoPE rotates as NEOX RoPE,
    the graph's rope type without sections (llama_model_rope_type), bit for bit."""
    key = "glm4moe.rope.dimension_sections"
    values = {kv.key: kv.value for kv in metadata}
    sections = values.get(key)
    if isinstance(sections, list) and len(sections) >= 2 and sections[0] > 0 and sections[1] > 0:
        return metadata  # already M-RoPE (hparams.use_mrope)
    half = int(values["glm4moe.rope.dimension_count"]) // 2
    out = [kv for kv in metadata if kv.key != key]
    out.append(KeyValue(key, [half - half // 2, half // 2, 0, 0], GGUFValueType.ARRAY, GGUFValueType.INT32))
    return out


def _deepseek2_keys(metadata: list[KeyValue], main: int, arch: str) -> list[KeyValue]:
    """What llama_model_deepseek2::load_arch_hparams derives from n_layer() (and the vocabulary),
    written out as the full model derives it, so no stage's own layer count changes it:
    - without expert_gating_func, sigmoid for 47 or 48 layers with a 154880 vocabulary (GLM 4.7
      Lite), else softmax;
    - a Lite model (26 or 27 layers, or 48 with a 128256 vocabulary) never reads q_lora_rank, so
      it is 0 whatever the key says; 0 makes any stage load attn_q as the model does. A model
      with a q LoRA keeps it, and a stage of a Lite layer count is refused (stage_refusal)."""
    values = {kv.key: kv.value for kv in metadata}
    out = list(metadata)
    if f"{arch}.expert_gating_func" not in values:
        sigmoid = main in (47, 48) and deepseek2_vocab(values, arch) == 154880
        out.append(KeyValue(f"{arch}.expert_gating_func", 2 if sigmoid else 1, GGUFValueType.UINT32, None))
    if deepseek2_is_lite(main, values, arch):
        out = [kv for kv in out if kv.key != f"{arch}.attention.q_lora_rank"]
        out.append(KeyValue(f"{arch}.attention.q_lora_rank", 0, GGUFValueType.UINT32, None))
    return out


# GLM-5.2's indexer kinds, which glm-dsa.cpp defaults to by index for a 1M-token context.
_GLM_5_2_INDEXER_TYPES = [1, 1] + [1, 0, 0, 0] * 19
_GLM_5_2_CONTEXT = 1048576


def _indexer_types(metadata: list[KeyValue], arch: str, main: int) -> list[KeyValue]:
    """llama_model_glm_dsa::load_arch_hparams defaults the per-layer indexer kinds from the index
    where the key is absent (every layer full before GLM-5.2's context, else GLM-5.2's table):
    written out for the main stack, so a stage's slice keeps each layer's kind."""
    key = INDEXER_TYPES.format(arch)
    values = {kv.key: kv.value for kv in metadata}
    if isinstance(values.get(key), list):
        return metadata
    if int(values.get(f"{arch}.context_length") or 0) < _GLM_5_2_CONTEXT:
        types = [1] * main
    else:
        types = (_GLM_5_2_INDEXER_TYPES + [0] * main)[:main]
    out = [kv for kv in metadata if kv.key != key]
    out.append(KeyValue(key, types, GGUFValueType.ARRAY, GGUFValueType.UINT32))
    return out


def swa_layers(n_pattern: int, dense_first: bool, layers: int) -> list[bool]:
    """Which layers use the sliding window, as llama.cpp's `set_swa_pattern` derives them."""
    if dense_first:
        return [n_pattern == 0 or il % n_pattern != 0 for il in range(layers)]
    return [n_pattern == 0 or il % n_pattern < n_pattern - 1 for il in range(layers)]


def stage_metadata(arch: str, metadata: Sequence[KeyValue], start: int, end: int) -> list[KeyValue]:
    """The package's metadata as the stage [start, end) must see it."""
    blocks = next(int(kv.value) for kv in metadata if kv.key == f"{arch}.block_count")
    rule = RULES.get(arch)
    values = {kv.key: kv.value for kv in metadata}
    refusal = stage_refusal(arch, values, start, end)
    if refusal is not None:
        raise PackageError(f"{arch} layers [{start},{end}) cannot be a stage: {refusal}")
    out = []
    for kv in metadata:
        kv = _layers(kv, arch, start, end, blocks)
        suffix = kv.key.removeprefix(f"{arch}.")
        if rule is not None and suffix in rule.front_counts:
            kv = replace(kv, value=min(max(int(kv.value) - start, 0), end - start))
        if rule is not None and rule.kv_shared and suffix == rule.kv_shared:
            kv = replace(kv, value=kv_shared_layers(arch, values, start, end))
        if rule is not None and start > 0 and suffix in rule.token_input_only:
            kv = replace(kv, value=rule.token_input_only[suffix])
        out.append(kv)
    return out


def _layers(kv: KeyValue, arch: str, start: int, end: int, blocks: int) -> KeyValue:
    """The layer count, or a per-layer array's slice, for layers [start, end)."""
    if kv.key == f"{arch}.block_count":
        return replace(kv, value=end - start, sub_type=None)
    suffix = kv.key.removeprefix(f"{arch}.")
    if suffix in PER_LAYER_KEYS and isinstance(kv.value, list) and len(kv.value) == blocks:
        return replace(kv, value=kv.value[start:end])
    return kv
