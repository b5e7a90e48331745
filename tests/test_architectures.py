"""Every proven architecture splits exactly, and speculates losslessly (issue 40).

For each architecture in `packages.architectures.RULES`, a tiny random-weight GGUF
(tests/tiny_models.py) is packaged, and:
- split-2 at every allowed cut, and a split-3, give the unsplit model's greedy tokens, and the
  unsplit chain's logprobs of each step's 3 best tokens bit for bit;
- each rule is needed: packaged and cut without it, some cut parts from the unsplit output
  (lfm2's: a stage of one kind of layer aborts, tests/test_tiny_recurrent.py, mesh tier),
  and a stage that keeps the whole per-layer arrays does not load;
- speculation with a draft of the same weights at another quantization (so some windows are
  rejected) gives the tokens of plain decoding, through the coordinator's request path.
All in-process, milliseconds a decode.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest
from chain import build_chain, close, greedy, greedy_scored, reference_greedy
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from inproc_requests import served_tokens
from tiny_models import WRITERS, write_tiny

from common.errors import EngineError
from common.sampling import SamplingParams
from mesh.backend import GenerationRequest
from packages import architectures, stage_metadata
from packages.architecture_kinds import KINDS
from packages.architectures import RULES, CutRule, allowed_cuts, package_verdict
from packages.errors import PackageError
from packages.gguf_files import KeyValue, metadata_of, open_gguf
from packages.manifest import load_manifest
from packages.materialize import materialize_stage
from packages.requantize import requantize
from packages.writer import write_package

PROVEN = sorted(RULES)
PROMPT = [1, *range(40, 60), 7, 7, 9]  # past every tiny sliding window
N = 12


def test_every_rule_has_a_tiny_model() -> None:
    assert sorted(WRITERS) == PROVEN


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("archs")
    return {arch: write_tiny(root / f"{arch}.gguf", arch) for arch in WRITERS}


def _package(gguf: Path, out: Path) -> Path:
    write_package(gguf, out, progress=lambda _: None)
    return out


def _splits(cuts: list[int]) -> list[list[int]]:
    """Every split-2, and one split-3 (the first and last allowed cuts)."""
    return [[c] for c in cuts] + ([[cuts[0], cuts[-1]]] if len(cuts) >= 2 else [])


def _chain_tokens(package: Path, cuts: list[int], cache: Path) -> list[int]:
    engines = build_chain(package, cuts, cache, lanes=1, ctx=128)
    try:
        return greedy(engines, PROMPT, N)
    finally:
        close(engines)


def _chain_scores(package: Path, cuts: list[int], cache: Path) -> list[tuple[tuple[int, float], ...]]:
    engines = build_chain(package, cuts, cache, lanes=1, ctx=128)
    try:
        return greedy_scored(engines, PROMPT, N)
    finally:
        close(engines)


@pytest.mark.parametrize("arch", PROVEN)
def test_split_equals_unsplit(arch: str, tiny: dict[str, Path], tmp_path: Path) -> None:
    """Tokens, and each step's 3 best logprobs bit for bit: the engines run the same kernels at the
    same thread count and KV type whatever the cut (DESIGN §9), and every family measured 0.0 apart."""
    gguf = tiny[arch]
    expected = reference_greedy(gguf, PROMPT, N)
    package = _package(gguf, tmp_path / "pkg")
    manifest, _ = load_manifest(package)
    assert manifest.allowed_cuts, f"{arch} is proven but allows no cut"
    unsplit = _chain_scores(package, [], tmp_path / "cache")
    assert [step[0][0] for step in unsplit] == expected  # unsplit, the engine's way
    for cuts in _splits(list(manifest.allowed_cuts)):
        assert _chain_scores(package, cuts, tmp_path / "cache") == unsplit, f"{arch} cut at {cuts}"


@contextlib.contextmanager
def _without_rule(arch: str) -> Iterator[None]:
    saved = RULES[arch]
    RULES[arch] = CutRule()
    try:
        yield
    finally:
        RULES[arch] = saved


# lfm2's rule only keeps an attention and a recurrent layer in every stage: without it, a stage
# of one kind aborts the process, which no test in it outlives (test_tiny_recurrent shows the
# abort in a process of its own). step35's and mimo2's only keep a sliding-window layer in every stage (its
# arrays are sliced whatever the rule): without it, llama_model::create_memory asserts is_swa_any
# on a stage of full-attention layers (test_no_stage_is_left_without_a_sliding_window_layer).
# smallthinker's rule-less cut at 1 leaves a stage of one full-attention layer, which aborts the
# same way: test_smallthinker_needs_its_rule cuts it at 2.
_ABORTS_WITHOUT_RULE = {"lfm2", "step35", "mimo2", "smallthinker"}
# gemma4's keeps each stage's own KV-sharing count: without it, a first stage keeps the whole
# model's and create_memory asserts n_layer_kv_from_start >= 2 (tests/test_gemma4_kv_sharing.py).
_ABORTS_WITHOUT_RULE |= {"gemma4"}
# hyb: as lfm2's (test_tiny_recurrent shows their [0,2) abort)
_ABORTS_WITHOUT_RULE |= {"nemotron_h", "nemotron_h_moe", "jamba", "plamo2", "kimi-linear"}
# maple's and spark2_5's, as step35's: their arrays are sliced whatever the rule
_ABORTS_WITHOUT_RULE |= {"maple", "spark2_5"}


@pytest.mark.parametrize("arch", [a for a in PROVEN if RULES[a] != CutRule(why=RULES[a].why)
                                  and a not in _ABORTS_WITHOUT_RULE])
def test_each_rule_is_needed(arch: str, tiny: dict[str, Path], tmp_path: Path) -> None:
    """Packaged and cut at every layer without its rule, some split parts from the model."""
    gguf = tiny[arch]
    expected = reference_greedy(gguf, PROMPT, N)
    ruled, _ = load_manifest(_package(gguf, tmp_path / "ruled"))
    with _without_rule(arch):
        package = _package(gguf, tmp_path / "pkg")
        # lazily, up to the first cut that parts, and the cuts the rule allows first: some others
        # abort in llama.cpp (a llama4 stage without a no-RoPE layer builds an attention-scale input
        # no node reads; a granitehybrid stage of one kind of layer leaves an input without a buffer)
        cuts = [*ruled.allowed_cuts, *(c for c in range(1, 8) if c not in ruled.allowed_cuts)]
        outputs = (_outcome(package, [c], tmp_path / "cache") for c in cuts)
        assert any(out != expected for out in outputs), f"{arch}: every cut matched without the rule"


def _outcome(package: Path, cuts: list[int], cache: Path) -> list[int] | str:
    try:
        return _chain_tokens(package, cuts, cache)
    except EngineError as exc:
        return str(exc)


def test_a_stage_keeping_whole_per_layer_arrays_does_not_load(tiny: dict[str, Path], tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    package = _package(tiny["qwen3"], tmp_path / "pkg")
    monkeypatch.setattr(stage_metadata, "PER_LAYER_KEYS", ())
    with pytest.raises(EngineError, match="could not load"):
        _chain_tokens(package, [4], tmp_path / "cache")


def test_a_family_that_cannot_be_cut_is_packaged_to_serve_on_one_node(tmp_path: Path) -> None:
    gguf = write_tiny(tmp_path / "talkie.gguf", "talkie")
    package = _package(gguf, tmp_path / "pkg")
    manifest, _ = load_manifest(package)
    assert manifest.allowed_cuts == ()
    verdict = package_verdict(manifest.architecture, manifest.allowed_cuts, manifest.layer_count)
    assert verdict == f"talkie: not split ({architectures.ONE_NODE['talkie']})"
    assert _chain_tokens(package, [], tmp_path / "cache") == reference_greedy(gguf, PROMPT, N)


@pytest.mark.parametrize("arch", sorted(architectures.ONE_NODE))
def test_a_text_family_that_cannot_be_cut_serves_on_one_node_with_its_reason(arch: str) -> None:
    architectures.require_servable(arch)
    assert allowed_cuts(arch, 8) == []
    assert architectures.split_refusal(arch) == architectures.ONE_NODE[arch]
    assert dict(architectures.table())[arch] == f"one node: {architectures.ONE_NODE[arch]}"
    assert arch not in RULES
    assert KINDS[arch] == "text"


@pytest.mark.parametrize(("arch", "reason"), [("qwen4exp", "cannot be cut: hyper-connections"),
                                              ("minimax-01", "cannot be cut: each lightning-attention layer's decay"),
                                              ("bert", "encoder"),
                                              ("clip", "vision"), ("llada", "diffusion"), ("t5", "encoder-decoder")])
def test_what_generates_no_text_or_cannot_roll_back_is_refused_with_its_reason(arch: str, reason: str) -> None:
    with pytest.raises(PackageError, match=f"cannot serve architecture '{arch}': .*{reason}"):
        architectures.require_servable(arch)
    assert allowed_cuts(arch, 8) == []


REQUESTS = [GenerationRequest(PROMPT, N, SamplingParams(), ignore_eos=True),
            GenerationRequest(PROMPT[:9], N, SamplingParams(temperature=0.9, seed=5), ignore_eos=True)]


@pytest.fixture(scope="module")
def quantized(tiny: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """(target, draft) per architecture: Q4_0, whose k-row decode equals k single rows, and Q8_0."""
    root = tmp_path_factory.mktemp("quantized")
    return {arch: (requantize(gguf, root / f"{arch}-q4_0.gguf", "Q4_0"),
                   requantize(gguf, root / f"{arch}-q8_0.gguf", "Q8_0")) for arch, gguf in tiny.items()}


@pytest.mark.parametrize("arch", PROVEN)
def test_speculation_is_lossless(arch: str, quantized: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    target, draft = quantized[arch]
    # the draft parts from the target within the answer, so some of its windows are rejected
    assert reference_greedy(draft, PROMPT, N) != reference_greedy(target, PROMPT, N)
    plain = asyncio.run(served_tokens(target, None, tmp_path, REQUESTS))
    drafted = asyncio.run(served_tokens(target, draft, tmp_path, REQUESTS))
    assert drafted == plain


def test_the_table_names_every_architecture_once_with_what_is_done_with_it() -> None:
    rows = dict(architectures.table())
    assert len(rows) == len(architectures.table()) == len(KINDS) - 1  # all but "(unknown)"
    assert sorted(a for a, verdict in rows.items() if verdict.startswith("split: ")) == PROVEN
    assert rows["bloom"].startswith("one node: the graph LayerNorms whatever it is fed")
    assert rows["mamba"].startswith("split: may be split at any layer; recurrent: a Mamba-1 mixer")


def test_no_stage_is_left_without_a_sliding_window_layer() -> None:
    """llama_model::create_memory asserts a sliding-window model's stage has a sliding layer:
    cuts fall where a sliding-window layer starts the next stage and one precedes it."""
    key = architectures.swa_key("gemma2")
    assert allowed_cuts("gemma2", 8, {key: [True, False] * 4}) == [2, 4, 6]
    assert allowed_cuts("olmo2", 8, {architectures.swa_key("olmo2"): [True, True, True, False] * 2}) == [1, 2, 4, 5, 6]
    assert allowed_cuts("gemma2", 8, {key: [False, True, False, True, True, True, True, True]}) == [3, 4, 5, 6, 7]
    assert allowed_cuts("gemma2", 8) == [2, 4, 6]  # no array: the pattern's period
    # step35 reads the array itself (required): full attention at 0 and 4 here
    step35 = {architectures.swa_key("step35"): [i % 4 != 0 for i in range(8)]}
    assert allowed_cuts("step35", 8, step35) == [2, 3, 5, 6, 7]


def test_no_hybrid_stage_is_left_with_one_kind_of_layer() -> None:
    """llm_graph_input_mem_hybrid::set_input aborts on a stage without an attention or a recurrent
    layer: cuts fall where a recurrent layer follows an attention layer, the last stage keeping one."""
    kv = "lfm2.attention.head_count_kv"
    assert allowed_cuts("lfm2", 12, {kv: [0, 0, 2] * 4}) == [3, 6, 9]
    assert allowed_cuts("lfm2", 8, {kv: [0, 0, 2] * 3}) == [3]  # [6,8) would hold no attention layer
    lfm2_1_2b = [8 if il in (2, 5, 8, 10, 12, 14) else 0 for il in range(16)]  # LFM2-1.2B's layers
    assert allowed_cuts("lfm2", 16, {kv: lfm2_1_2b}) == [3, 6, 9, 11, 13]
    assert allowed_cuts("lfm2", 12) == []  # no head_count_kv known: no cut
    # qwen35 marks recurrent layers by the index: cuts keep the interval's phase (4 by default)
    assert allowed_cuts("qwen35", 12) == [4, 8]
    assert allowed_cuts("qwen35", 12, {"qwen35.full_attention_interval": 3}) == [3, 6, 9]
    listed = [True, True, False, True, False, True, True, False]
    assert allowed_cuts("qwen35", 8, {"qwen35.attention.recurrent_layers": listed}) == [3, 5]
    assert allowed_cuts("falcon-h1", 8) == allowed_cuts("mamba2", 8) == list(range(1, 8))
    values = [KeyValue("lfm2.block_count", 12, GGUFValueType.UINT32, None),
              KeyValue(kv, [0, 0, 2] * 4, GGUFValueType.ARRAY, GGUFValueType.UINT32)]
    with pytest.raises(PackageError, match=r"lfm2 layers \[3,5\) cannot be a stage: its layers are all recurrent"):
        stage_metadata.stage_metadata("lfm2", values, 3, 5)
    with pytest.raises(PackageError, match="all attention"):
        stage_metadata.stage_metadata("lfm2", values, 2, 3)


@pytest.mark.parametrize(("arch", "layers"), [("gemma2", 46), ("gemma3", 62)])
def test_a_gemma_27b_is_not_split(arch: str, layers: int) -> None:
    """Its attention scale comes from `switch (n_layer())`: a stage would get another."""
    meta = {f"{arch}.block_count": layers}
    assert "attention scale from the total layer count" in (architectures.split_refusal(arch, meta) or "")
    assert allowed_cuts(arch, layers, meta) == []
    assert architectures.split_refusal(arch, {f"{arch}.block_count": layers - 4}) is None
    assert allowed_cuts(arch, layers - 4, {f"{arch}.block_count": layers - 4})


def test_command_r_plus_is_not_split() -> None:
    """command-r.cpp creates q/k norms only where n_layer >= 64: no stage of Command R+ would load them."""
    assert "q/k norms" in (architectures.split_refusal("command-r", {"command-r.block_count": 64}) or "")
    assert allowed_cuts("command-r", 64, {"command-r.block_count": 64}) == []
    assert allowed_cuts("command-r", 40, {"command-r.block_count": 40}) == list(range(1, 40))


def test_exaone4_32b_is_not_split() -> None:
    """exaone4.cpp turns its sliding window (and RoPE on sliding layers only) on where n_layer() is
    64: no stage of the 32B has it, and a 64-layer stage of a larger model would."""
    meta = {"exaone4.block_count": 65, "exaone4.nextn_predict_layers": 1}
    assert "sliding window" in (architectures.split_refusal("exaone4", meta) or "")
    assert allowed_cuts("exaone4", 64, meta) == []
    assert allowed_cuts("exaone4", 30, {"exaone4.block_count": 30}) == list(range(1, 30))
    assert 6 not in allowed_cuts("exaone4", 70, {"exaone4.block_count": 70})  # [6, 70) is 64 layers
    assert "64-layer" in (architectures.stage_refusal("exaone4", {}, 3, 67) or "")


def _deepseek2_meta(layers: int, vocab: int, q_lora_rank: int | None) -> list[KeyValue]:
    u32 = GGUFValueType.UINT32
    kvs = [KeyValue("deepseek2.block_count", layers, u32, None),
           KeyValue("deepseek2.vocab_size", vocab, u32, None),
           KeyValue("deepseek2.leading_dense_block_count", 3, u32, None)]
    if q_lora_rank is not None:
        kvs.append(KeyValue("deepseek2.attention.q_lora_rank", q_lora_rank, u32, None))
    return kvs


@pytest.mark.parametrize(("layers", "vocab", "q_lora_rank", "gating", "written_q"), [
    (27, 102400, None, 1, 0),  # V2-Lite: no q LoRA, softmax
    (48, 128256, 768, 1, 0),  # Lite by count and vocabulary: llama.cpp ignores the key
    (48, 154880, 768, 2, 768),  # GLM 4.7 Lite's default gating is sigmoid
    (61, 129280, 1536, 1, 1536),  # V3
])
def test_deepseek2_keys_its_layer_count_decides_are_written_for_the_full_model(
        layers: int, vocab: int, q_lora_rank: int | None, gating: int, written_q: int) -> None:
    """load_arch_hparams derives the gating function and whether q_lora_rank is read from
    n_layer(); the package writes them as the whole model derives them, so a stage keeps them."""
    metadata, main = stage_metadata.package_metadata("deepseek2", _deepseek2_meta(layers, vocab, q_lora_rank))
    values = {kv.key: kv.value for kv in metadata}
    assert main == layers
    assert values["deepseek2.expert_gating_func"] == gating
    assert values["deepseek2.attention.q_lora_rank"] == written_q


def test_a_deepseek2_stage_that_llama_cpp_would_read_as_lite_is_refused() -> None:
    metadata, main = stage_metadata.package_metadata("deepseek2", _deepseek2_meta(61, 129280, 1536))
    values = {kv.key: kv.value for kv in metadata}
    cuts = allowed_cuts("deepseek2", main, values)
    assert not {26, 27, 34, 35} & set(cuts)
    assert {25, 28, 33, 36} <= set(cuts)
    with pytest.raises(PackageError, match=r"\[10,36\) cannot be a stage: .*26-layer deepseek2 as Lite"):
        stage_metadata.stage_metadata("deepseek2", metadata, 10, 36)
    assert architectures.stage_refusal("deepseek2", values, 10, 38) is None


def test_a_glm4moe_package_runs_m_rope_so_later_stages_take_hidden_states(tiny: dict[str, Path]) -> None:
    """glm4-moe.cpp aborts on embedding input without M-RoPE; text-only GLM-4.5 has no sections,
    so the package writes some (same position in each: equal to NEOX RoPE), and keeps a model's own."""
    metadata, _ = stage_metadata.package_metadata("glm4moe", metadata_of(open_gguf(tiny["glm4moe"])))
    values = {kv.key: kv.value for kv in metadata}
    assert "glm4moe.rope.dimension_sections" not in {kv.key for kv in metadata_of(open_gguf(tiny["glm4moe"]))}
    assert values["glm4moe.rope.dimension_sections"] == [2, 2, 0, 0]  # 8 rotary dims: 4 pairs
    own = [*metadata[:-1], KeyValue("glm4moe.rope.dimension_sections", [8, 12, 12, 0], GGUFValueType.ARRAY,
                                    GGUFValueType.INT32)]
    again, _ = stage_metadata.package_metadata("glm4moe", own)
    assert {kv.key: kv.value for kv in again}["glm4moe.rope.dimension_sections"] == [8, 12, 12, 0]


@pytest.mark.parametrize(("arch", "kept"), [("qwen3", {0: {"token_embd.weight"}, 4: {"output.weight"}}),
                                            ("gemma3", {0: {"token_embd.weight"}, 3: set(), 6: {"token_embd.weight"}})])
def test_a_stage_holds_zeros_for_what_the_loader_requires_and_it_never_reads(
        arch: str, kept: dict[int, set[str]], tiny: dict[str, Path], tmp_path: Path) -> None:
    """qwen3's head is untied: stage 0 never reads it, the last stage never reads the embeddings.
    gemma3 ties its head to the embeddings, which only a middle stage does not read."""
    package = _package(tiny[arch], tmp_path / "pkg")
    manifest, sha = load_manifest(package)
    bounds = [*kept, manifest.layer_count]
    for a, b in itertools.pairwise(bounds):
        shared = {t.name: t for t in GGUFReader(materialize_stage(package, manifest, sha, a, b, tmp_path / "c")).tensors
                  if t.name in ("token_embd.weight", "output.weight")}
        real = {n for n, t in shared.items() if t.data.any()}
        assert real == kept[a], (a, b)
        assert all(shared[n].tensor_type == GGMLQuantizationType.Q4_1 for n in set(shared) - real)


def test_a_split_with_iq1_s_zeros_equals_unsplit(tmp_path: Path) -> None:
    """Where the width is a multiple of 256 the zeros are IQ1_S, llama.cpp's smallest type."""
    gguf = write_tiny(tmp_path / "wide.gguf", "qwen3", width=256)
    package = _package(gguf, tmp_path / "pkg")
    manifest, sha = load_manifest(package)
    later = GGUFReader(materialize_stage(package, manifest, sha, 4, 8, tmp_path / "c")).tensors
    assert next(t for t in later if t.name == "token_embd.weight").tensor_type == GGMLQuantizationType.IQ1_S
    assert _chain_tokens(package, [4], tmp_path / "c") == reference_greedy(gguf, PROMPT, N)


def test_a_text_only_glm4_is_not_split() -> None:
    """glm4.cpp aborts on hidden-state input without M-RoPE, and its NORM RoPE is not M-RoPE's:
    split only with the model's own sections."""
    assert "without M-RoPE sections" in (architectures.split_refusal("glm4", {"glm4.block_count": 40}) or "")
    assert allowed_cuts("glm4", 40, {"glm4.block_count": 40}) == []
    assert allowed_cuts("glm4", 4, {"glm4.rope.dimension_sections": [8, 12, 12, 0]}) == [1, 2, 3]


def test_smallthinker_needs_its_rule(tiny: dict[str, Path], tmp_path: Path) -> None:
    """Cut out of its period of 4 without the rule, smallthinker parts from the model (RoPE and the
    sliding window from the stage's own index); with its sliding window, no stage may have 4 layers,
    where smallthinker.cpp ropes every layer."""
    gguf = tiny["smallthinker"]
    with _without_rule("smallthinker"):
        package = _package(gguf, tmp_path / "pkg")
        assert _outcome(package, [2], tmp_path / "cache") != reference_greedy(gguf, PROMPT, N)
    meta = {"smallthinker.attention.sliding_window": 4}
    assert "4-layer" in (architectures.stage_refusal("smallthinker", meta, 8, 12) or "")
    assert architectures.stage_refusal("smallthinker", {}, 8, 12) is None
    assert allowed_cuts("smallthinker", 24, {**meta, architectures.swa_key("smallthinker"): [
        i % 4 != 0 for i in range(24)]}) == [8, 12, 16]


def test_muse_glimmer_cannot_be_cut(tmp_path: Path) -> None:
    """muse-glimmer.cpp RMS-normalizes any input before its first layer: with its sliding-window rule
    (load_swa_pattern(ml, 4)) a cut at 4 keeps the pattern's phase, and still parts from the model."""
    gguf = write_tiny(tmp_path / "muse-glimmer.gguf", "muse-glimmer")
    RULES["muse-glimmer"] = CutRule(swa_pattern=(4, False))
    try:
        package = _package(gguf, tmp_path / "pkg")
        assert _chain_tokens(package, [], tmp_path / "cache") == reference_greedy(gguf, PROMPT, N)
        assert _chain_tokens(package, [4], tmp_path / "cache") != reference_greedy(gguf, PROMPT, N)
    finally:
        del RULES["muse-glimmer"]
    assert allowed_cuts("muse-glimmer", 8) == []


@pytest.mark.parametrize("arch", ["granite", "granite_swa"])
def test_a_granite_with_deepstack_inputs_is_not_split(arch: str) -> None:
    """Granite Vision's layers add columns of an input widened by the deepstack count, which a stage's
    slice of deepstack_mapping changes and a later stage's hidden state does not hold."""
    meta = {f"{arch}.deepstack_mapping": [-1, 0, -1, 1, -1, -1]}
    assert "deepstack" in (architectures.split_refusal(arch, meta) or "")
    assert allowed_cuts(arch, 6, meta) == []
    assert architectures.split_refusal(arch, {f"{arch}.deepstack_mapping": [-1] * 6}) is None


def test_no_dots3note_stage_is_left_without_either_attention_kind() -> None:
    """dots3note's memory aborts on a stage without a full-attention layer (SIGFPE) or without a sliding
    one (GGML_ASSERT(buffer)): cuts fall where a full layer follows a sliding one, the first and last
    stages holding both kinds."""
    key = architectures.swa_key("dots3note")
    sliding = [i not in (0, 3, 6) for i in range(8)]
    assert allowed_cuts("dots3note", 8, {key: sliding}) == [3, 6]
    assert allowed_cuts("dots3note", 8, {key: [True, False] * 4}) == [3, 5]  # [0,1) and [7,8) would hold one kind
    assert allowed_cuts("dots3note", 8) == []  # no array: no cut
    assert "full-attention and a sliding-window layer" in (
        architectures.stage_refusal("dots3note", {key: sliding}, 4, 6) or "")
