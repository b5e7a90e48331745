"""Which architectures may be split, where, and what each stage's GGUF must say (DESIGN.md §3).

A cut at layer c means one stage ends at c and the next starts there. A stage GGUF renumbers
its layers from 0 (packages/materialize.py), so whatever llama.cpp derives from the layer
index, reads from a per-layer array, counts from the front, or applies to a stage's input
must survive the cut. `RULES` says how, for every architecture proven by a test
(tests/test_architectures.py): split at every allowed cut equals the unsplit model, token
for token. Every other architecture of the vendored llama.cpp (llama-cpp-python 0.3.36) is
refused splitting with its reason, and served on one node unless it generates no text.
The llama.cpp functions named are in its `src/models/<arch>.cpp` and `src/llama-model.cpp`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from packages.architecture_kinds import (
    AUDIO,
    DIFFUSION,
    ENCODER,
    ENCODER_DECODER,
    HYBRID,
    INDEX_RULES,
    KINDS,
    RECURRENT,
    SPECULATOR,
    TEXT,
    UNKNOWN,
    VISION,
)
from packages.errors import PackageError


@dataclass(frozen=True)
class CutRule:
    """What a proven architecture's stages need besides renumbered layers."""

    # The graph takes something from the layer index that no metadata can carry: cuts fall
    # on multiples of it, so each stage sees the pattern in its own phase.
    period: int = 1
    # `load_swa_pattern(ml, n, dense_first)` makes sliding-window layers from the index unless
    # the per-layer array is present: the package writes the array, so every cut keeps it.
    swa_pattern: tuple[int, bool] | None = None
    # load_arch_hparams reads the per-layer sliding-window array itself (get_arr, required):
    # sliced like any per-layer array, but cuts must still leave a sliding layer in every stage.
    swa_array: bool = False
    # Keys whose value is a period the graph applies to the index (llama4's MoE every n-th
    # layer): cuts fall on multiples of it too.
    period_keys: tuple[str, ...] = ()
    # Counts of layers from the front (leading dense blocks): each stage gets its share.
    front_counts: tuple[str, ...] = ()
    # Scalars llama.cpp applies to embedding input of either kind (`build_inp_embd` scales
    # `batch.embd` too): neutral on stages after the first, which get hidden states.
    token_input_only: Mapping[str, Any] = field(default_factory=dict)
    # The graph multiplies whatever it is fed by √n_embd: later stages feed h / √n_embd.
    scales_any_input: bool = False
    # Tensors the graph adds to whatever it is fed (absolute position embeddings, gpt2.cpp):
    # zeros on stages after the first, which get hidden states that already hold them.
    input_tensors: tuple[str, ...] = ()
    # A hybrid whose every layer is either attention or recurrent: how load_arch_hparams tells the
    # recurrent ones (KV_HEADS or INTERVAL). llm_graph_input_mem_hybrid::set_input (llama-graph.cpp)
    # fills the inputs of both memories, and a stage without one kind of layer never gives that
    # kind's inputs a buffer: GGML_ASSERT(buffer) aborts the process. Cuts fall where a recurrent
    # layer follows an attention layer, so any choice of them leaves both kinds in every stage.
    recurrent_layers: str = ""
    # DSA with shared indexers (glm-dsa.cpp): a layer whose `attention.indexer.types` entry is 0
    # reuses the top-k of the previous full-indexer layer in the same graph, and a stage that
    # starts with one has none (GGML_ASSERT(prev_top_k)). Cuts fall on full-indexer layers only;
    # the package writes the array llama.cpp would default, so every stage slices it.
    shared_indexers: bool = False
    # The key counting the last layers that reuse earlier layers' KV (gemma4's
    # attention.shared_kv_layers): create_memory (llama-model.cpp) makes each of them read layer
    # n_layer_kv_from_start - 2 (sliding) or - 1 (full), n_layer_kv_from_start = n_layer - count
    # by the stage's own count, and asserts it is >= 2. The last stage keeps the count and both
    # source layers, every other stage gets 0, and no stage has fewer than 2 KV layers.
    kv_shared: str = ""
    # A layer of zero FFN width leaves the loop (`continue`) before naming its output l_out
    # (deci.cpp): a stage's hidden tap would find nothing, so no cut falls right after one.
    tap_needs_ffn: bool = False
    # dots3note's memory (llama_kv_cache_dsa_iswa, llama-model.cpp create_memory) holds a DSA cache of
    # the full-attention layers beside a cache of the sliding-window ones, and a stage without either
    # kind aborts (GGML_ASSERT(buffer) without a sliding layer, SIGFPE without a full one, measured).
    # Cuts fall where a full-attention layer follows a sliding one (by the per-layer sliding-window
    # array), so any choice of them leaves both kinds in every stage but the first and last, which
    # stage_refusal checks.
    full_follows_sliding: bool = False
    why: str = ""


# 0 in the per-layer `attention.head_count_kv` (lfm2.cpp, granite-hybrid.cpp)
KV_HEADS = "kv_heads"
# the per-layer `attention.recurrent_layers`, else `(il + 1) % full_attention_interval != 0`
# (default 4) from the stage's own index (qwen35.cpp, qwen3next.cpp)
INTERVAL = "interval"
# --- hyb: nemotron_h ---
# 0 in both the per-layer `attention.head_count_kv` and `feed_forward_length` (nemotron-h.cpp):
# a layer with KV heads is attention, one with an FFN length neither kind (it needs no memory input)
KV_AND_FF = "kv_and_ff"
# --- end hyb ---


_INDEX_FREE = "the graph reads nothing from the layer index"
_LEAD = ("leading_dense_block_count",)
_ONE_KIND = "a stage of one kind aborts in llm_graph_input_mem_hybrid::set_input (llama-graph.cpp)"
_GATED_DELTA = ("hybrid: gated delta-net layers where (il + 1) % full_attention_interval != 0 by the stage's own "
                "index ({}), so cuts fall on its multiples; " + _ONE_KIND)
RULES: dict[str, CutRule] = {
    "llama": CutRule(why=f"{_INDEX_FREE} (llama.cpp)"),
    "mistral3": CutRule(why=f"{_INDEX_FREE}; attention temperature follows the position (mistral3.cpp)"),
    "qwen2": CutRule(why=f"{_INDEX_FREE} (qwen2.cpp)"),
    "qwen3": CutRule(why=f"{_INDEX_FREE} (qwen3.cpp)"),
    "qwen3moe": CutRule(why=f"{_INDEX_FREE}; every layer is MoE (qwen3moe.cpp)"),
    "step35": CutRule(swa_array=True,
                      why="sliding-window layers by the per-layer array, with their own head counts and RoPE; "
                          "dense or MoE by the tensors; nextn layers dropped (step35.cpp)"),
    "mimo2": CutRule(swa_array=True,
                     why="sliding-window layers by the per-layer array, with their own head counts and RoPE; "
                         "dense or MoE by the tensors; nextn layers dropped (mimo2.cpp)"),
    # Only with M-RoPE sections (split_refusal): glm4.cpp aborts on hidden-state input without them.
    "glm4": CutRule(why=f"{_INDEX_FREE}; nextn layers dropped; M-RoPE, so later stages take hidden states "
                        "(glm4.cpp)"),
    "qwen2moe": CutRule(why=f"{_INDEX_FREE}; every layer is MoE with a gated shared expert (qwen2moe.cpp)"),
    "olmoe": CutRule(why=f"{_INDEX_FREE}; every layer is MoE (olmoe.cpp)"),
    "minimax-m2": CutRule(why=f"{_INDEX_FREE}; every layer is MoE (minimax-m2.cpp)"),
    # Only Seed-OSS-36B's model type comes from n_layer() (64), and the graph never reads it.
    "seed_oss": CutRule(why=f"{_INDEX_FREE} (seed-oss.cpp)"),
    # The loader makes every layer past the lead MoE, the graph only every step-th of them: a
    # model runs only with step 1, and the step's phase is kept anyway.
    "ernie4_5-moe": CutRule(front_counts=_LEAD, period_keys=("interleave_moe_layer_step",),
                            why="dense FFN where il < n_layer_dense_lead, MoE past it "
                                "(ernie4-5.cpp, ernie4-5-moe.cpp)"),
    # Only with no sliding window (split_refusal): exaone4.cpp turns it on for 64 layers alone.
    "exaone4": CutRule(why=f"{_INDEX_FREE} without a sliding window; nextn layers dropped (exaone4.cpp)"),
    "hy_v3": CutRule(why=f"{_INDEX_FREE}; dense or MoE by the router's presence; nextn layers dropped (hy-v3.cpp)"),
    "cohere2": CutRule(swa_pattern=(4, False),
                       why="load_swa_pattern(ml, 4); RoPE on sliding-window layers only (cohere2.cpp)"),
    "phi3": CutRule(why="sliding window on every layer or none: set_swa_pattern(1) (phi3.cpp)"),
    "gemma2": CutRule(swa_pattern=(2, False), scales_any_input=True,
                      why="load_swa_pattern(ml, 2); the graph scales every input by √n_embd (gemma2.cpp)"),
    "gemma3": CutRule(swa_pattern=(6, False),
                      why="load_swa_pattern(ml, 6); only token input is scaled (gemma3.cpp)"),
    "gpt-oss": CutRule(swa_pattern=(2, False), why="load_swa_pattern(ml, 2) (openai-moe.cpp)"),
    "olmo2": CutRule(swa_pattern=(4, False), why="load_swa_pattern(ml, 4) when sliding_window > 0 (olmo2.cpp)"),
    "granite": CutRule(token_input_only={"embedding_scale": 0.0},
                       why="build_inp_embd applies f_embedding_scale to embd input too (llama-graph.cpp)"),
    "smollm3": CutRule(period=4, why="no RoPE where (il + 1) % n_no_rope_layer_step(4) == 0 (smollm3.cpp)"),
    # The package also writes what load_arch_hparams derives from n_layer() (gating function,
    # a Lite model's q_lora_rank), and no stage may have a Lite layer count (stage_refusal).
    "deepseek2": CutRule(front_counts=_LEAD,
                         why="dense FFN where il < n_layer_dense_lead; nextn layers dropped; gating and "
                             "q_lora_rank written as the whole model derives them (deepseek2.cpp)"),
    # llama_model_mistral4 is deepseek2's loader and graph under another name (models.h); its
    # attention temperature (Mistral Large's) follows the position, not the layer.
    "mistral4": CutRule(front_counts=_LEAD,
                        why="deepseek2's loader and graph: dense FFN where il < n_layer_dense_lead; nextn "
                            "layers dropped; gating and q_lora_rank written as the whole model derives them "
                            "(mistral4.cpp, deepseek2.cpp)"),
    # The package also writes M-RoPE sections: the graph aborts on embedding input without them
    # (stage_metadata._glm4moe_keys).
    "glm4moe": CutRule(front_counts=_LEAD,
                       why="dense FFN where il < n_layer_dense_lead; nextn layers dropped; M-RoPE sections "
                           "written so later stages take hidden states (glm4-moe.cpp)"),
    # Cuts on multiples of 4 also keep a no-RoPE layer in every stage: llama_model_llama4::graph
    # builds the attention-temperature input whatever the layers, only no-RoPE layers read it,
    # and a graph without one aborts setting it ("tensor buffer not set").
    "llama4": CutRule(period=4, swa_pattern=(4, False), period_keys=("interleave_moe_layer_step",),
                      why="chunked attention load_swa_pattern(ml, 4); no RoPE and MoE by "
                          "(il + 1) % step (llama4.cpp)"),
    # Recurrent and hybrid families: a layer's state shapes come from the ssm.* keys, the same in
    # every stage, and each stage's memory holds its own layers' conv and SSM states.
    "mamba2": CutRule(why=f"recurrent: a Mamba-2 mixer in every layer; {_INDEX_FREE} (mamba.cpp, mamba2.cpp)"),
    # mamba2's graph (mamba.cpp picks the mixer by the architecture): the dt/B/C norms by their
    # tensors' presence or ssm.dt_b_c_rms, the same in every stage.
    "mamba": CutRule(why=f"recurrent: a Mamba-1 mixer in every layer; {_INDEX_FREE} (mamba.cpp)"),
    # QRWKV-6 takes its input as it comes (no LayerNorm on the embeddings, unlike rwkv6.cpp) and
    # neither rescales nor passes anything but the residual from layer to layer.
    "rwkv6qwen2": CutRule(why=f"recurrent: RWKV-6 time mixing and a SwiGLU FFN in every layer; {_INDEX_FREE} "
                              "(rwkv6qwen2.cpp, rwkv6-base.cpp)"),
    "falcon-h1": CutRule(why="hybrid: attention and a Mamba-2 mixer side by side in every layer, so every stage "
                             f"holds both; {_INDEX_FREE} (falcon-h1.cpp)"),
    "lfm2": CutRule(recurrent_layers=KV_HEADS,
                    why=f"hybrid: short-convolution layers where head_count_kv is 0 (lfm2.cpp); {_ONE_KIND}"),
    "granitehybrid": CutRule(recurrent_layers=KV_HEADS, token_input_only={"embedding_scale": 0.0},
                             why="hybrid: Mamba-2 layers where head_count_kv is 0 (granite-hybrid.cpp); "
                                 f"{_ONE_KIND}; build_inp_embd applies f_embedding_scale to embd input too"),
    "qwen35": CutRule(recurrent_layers=INTERVAL, why=_GATED_DELTA.format("qwen35.cpp")),
    "qwen3next": CutRule(recurrent_layers=INTERVAL, why=_GATED_DELTA.format("qwen3next.cpp")),
    # qwen35's layers with an MoE FFN in every one (a shared expert gated per token): nothing
    # more from the index; its MTP layers past the main stack are dropped like any nextn layers.
    "qwen35moe": CutRule(recurrent_layers=INTERVAL, why=_GATED_DELTA.format("qwen35moe.cpp")),
    # --- DSA (issue 54): MLA with a lightning indexer whose keys have a cache of their own, one per
    # layer (llama_kv_cache_dsa, llama-model.cpp create_memory); each stage's cache holds its layers'.
    # deepseek32.cpp runs an indexer on every layer and derives nothing from n_layer() but the
    # model type, which nothing reads.
    "deepseek32": CutRule(front_counts=_LEAD,
                          why="MLA and an indexer in every layer, each with its own cache; dense FFN where "
                              "il < n_layer_dense_lead; nextn layers dropped (deepseek32.cpp)"),
    "glm-dsa": CutRule(front_counts=_LEAD, shared_indexers=True,
                       why="MLA with a DSA indexer: shared-indexer layers reuse the previous full layer's "
                           "top-k, so a stage starts at a full-indexer layer; dense FFN where "
                           "il < n_layer_dense_lead; nextn layers dropped (glm-dsa.cpp)"),
    # Only without per-layer inputs (split_refusal): E2B and E4B add to every layer an input
    # computed from the token ids, which a later stage has not.
    "gemma4": CutRule(swa_array=True, kv_shared="attention.shared_kv_layers",
                      why="sliding-window layers by the per-layer array, with their own head widths and RoPE; "
                          "the last shared_kv_layers reuse the KV of the two layers before them, which stay in "
                          "the last stage; no stage under 2 layers (gemma4.cpp, llama-model.cpp create_memory)"),
    # --- hyb: nemotron_h ---
    # Its FFN-only layers are neither kind: cuts fall where a recurrent layer follows an attention
    # layer with only FFN layers between, and the tap reads the name its graph gives a layer's output.
    "nemotron_h": CutRule(recurrent_layers=KV_AND_FF,
                          why="hybrid: Mamba-2 layers where head_count_kv and feed_forward_length are 0, "
                              "attention where head_count_kv is not and feed_forward_length is, FFN layers "
                              f"otherwise (nemotron-h.cpp); {_ONE_KIND}"),
    # llama_model_nemotron_h_moe is nemotron_h's loader and graph (models.h): every FFN layer routed
    # where expert_count is set, nothing more from the index; its MTP block dropped like nextn layers.
    "nemotron_h_moe": CutRule(recurrent_layers=KV_AND_FF,
                              why="hybrid: nemotron_h's loader and graph, Mamba-2 layers where head_count_kv and "
                                  "feed_forward_length are 0, attention where only the latter is, MoE FFN layers "
                                  f"otherwise (nemotron-h.cpp, nemotron-h-moe.cpp); {_ONE_KIND}"),
    # hyb: dense or MoE by the router's presence; a Mamba-1 layer's state from the ssm.* keys.
    "jamba": CutRule(recurrent_layers=KV_HEADS,
                     why="hybrid: Mamba-1 layers where head_count_kv is 0, attention without RoPE elsewhere, "
                         f"dense or MoE FFN by the router's presence (jamba.cpp); {_ONE_KIND}"),
    # hyb: lfm2's graph (models.h) with MoE past the leading dense blocks, by the index.
    "lfm2moe": CutRule(recurrent_layers=KV_HEADS, front_counts=_LEAD,
                       why="hybrid: short-convolution layers where head_count_kv is 0, dense FFN where "
                           f"il < n_layer_dense_lead, MoE past it (lfm2moe.cpp, lfm2.cpp); {_ONE_KIND}"),
    # hyb: the layer's l_out is the tap (h_nextn names the normed output, a tensor of its own).
    "bailingmoe3": CutRule(recurrent_layers=KV_HEADS, front_counts=_LEAD,
                           why="hybrid: Kimi delta-attention layers where head_count_kv is 0, gated MLA elsewhere; "
                               "dense FFN where il < n_layer_dense_lead, MoE past it (bailingmoe3.cpp); "
                               f"{_ONE_KIND}"),
    # A Mamba layer's state shapes from the ssm.* keys; its layers name their output ffn_residual
    # (tap_name).
    "plamo2": CutRule(recurrent_layers=KV_HEADS,
                      why="hybrid: Mamba layers where head_count_kv is 0, attention with RoPE elsewhere; every "
                          f"layer's output named ffn_residual, read by the tap (plamo2.cpp); {_ONE_KIND}"),
    # bailingmoe3's kinds of layer (KDA and MLA) without its gate, and MLA without RoPE; shared expert
    # beside the routed ones past the lead.
    "kimi-linear": CutRule(recurrent_layers=KV_HEADS, front_counts=_LEAD,
                           why="hybrid: Kimi delta-attention layers where head_count_kv is 0, MLA elsewhere; dense "
                               "FFN where il < n_layer_dense_lead, MoE past it (kimi-linear.cpp); " + _ONE_KIND),
    # --- end hyb ---
    # Older dense families (issue 54): their graphs read nothing from the index but per-layer
    # arrays, and take the input as it comes (no scale, norm or position embedding added to it).
    **{arch: CutRule(why=f"{_INDEX_FREE} ({source})") for arch, source in (
        ("arcee", "arcee.cpp"), ("xverse", "xverse.cpp"), ("internlm2", "internlm2.cpp"), ("exaone", "exaone.cpp"),
        ("maincoder", "maincoder.cpp"), ("orion", "orion.cpp"), ("starcoder2", "starcoder2.cpp"),
        ("stablelm", "stablelm.cpp"), ("olmo", "olmo.cpp"), ("qwen", "qwen.cpp"), ("refact", "refact.cpp"),
        ("codeshell", "codeshell.cpp"), ("phi2", "phi2.cpp"), ("falcon", "falcon.cpp"), ("nemotron", "nemotron.cpp"),
        ("jais2", "jais2.cpp"), ("gptneox", "gptneox.cpp"), ("chatglm", "chatglm.cpp"),
        ("pangu-embedded", "pangu-embed.cpp"), ("plamo", "plamo.cpp"),
        ("hunyuan-dense", "hunyuan-vl.cpp"),
    )},
    "gemma": CutRule(scales_any_input=True, why="the graph scales every input by √n_embd (gemma.cpp)"),
    "minicpm": CutRule(token_input_only={"embedding_scale": 0.0},
                       why="build_inp_embd applies f_embedding_scale to embd input too; the residual scale "
                           "is written as 1.4/√n_layer of the whole model (minicpm.cpp)"),
    "granitemoe": CutRule(token_input_only={"embedding_scale": 0.0},
                          why="every layer MoE; build_inp_embd applies f_embedding_scale to embd input too "
                              "(granite-moe.cpp, the granite graph)"),
    "qwen2vl": CutRule(why=f"{_INDEX_FREE}; M-RoPE: later stages pass 4 positions a row (qwen2vl.cpp)"),
    "jais": CutRule(why=f"{_INDEX_FREE}; ALiBi from the position (jais.cpp)"),
    **{arch: CutRule(input_tensors=("position_embd.weight",),
                     why=f"the graph adds position embeddings to any input: zeros after stage 0 ({arch}.cpp)")
       for arch in ("gpt2", "starcoder", "mpt")},
    # Older families (issue 54, part 3).
    **{arch: CutRule(why=f"{_INDEX_FREE}; {what} ({arch}.cpp)") for arch, what in (
        ("arctic", "a dense FFN beside the experts in every layer"), ("dbrx", "every layer MoE"),
        ("bitnet", "the head is the token embeddings"),
    )},
    "phimoe": CutRule(why=f"{_INDEX_FREE}; every layer MoE (phimoe.cpp, phi3's graph without a sliding window)"),
    "deepseek": CutRule(front_counts=_LEAD, why="dense FFN where il < n_layer_dense_lead (deepseek.cpp)"),
    "dots1": CutRule(front_counts=_LEAD, why="dense FFN where il < n_layer_dense_lead (dots1.cpp)"),
    "bailingmoe": CutRule(why=f"{_INDEX_FREE}; every layer MoE: leading_dense_block_count is read and never "
                              "used (bailingmoe.cpp)"),
    "hunyuan-moe": CutRule(why=f"{_INDEX_FREE}; every layer MoE with a shared expert (hunyuan-moe.cpp)"),
    "grok": CutRule(token_input_only={"embedding_scale": 0.0},
                    why="build_inp_embd applies f_embedding_scale to embd input too; its default (78.38) "
                        "is written out so a later stage can turn it off (grok.cpp)"),
    # Older families (issue 54, part 4). ernie4_5 and paddleocr call ggml_get_rows(inp_out_ids) on
    # the last layer unguarded: build_inp_out_ids never returns null, and a stage that is not the
    # last outputs every row, so the rows it keeps are all of them.
    "ernie4_5": CutRule(why=f"{_INDEX_FREE}; its last layer keeps the output rows, all of them on a "
                            "stage that is not the last (ernie4-5.cpp)"),
    "paddleocr": CutRule(why=f"{_INDEX_FREE}; M-RoPE: later stages pass 4 positions a row; its last layer "
                             "keeps the output rows (paddleocr.cpp, ernie4_5's loader)"),
    "bailingmoe2": CutRule(front_counts=_LEAD,
                           why="dense FFN where il < n_layer_dense_lead; nextn layers dropped (bailingmoe2.cpp)"),
    "mellum": CutRule(swa_pattern=(4, False),
                      why="load_swa_pattern(ml, 4) when sliding_window > 0; every layer MoE (mellum.cpp)"),
    "plamo3": CutRule(swa_pattern=(8, False),
                      why="load_swa_pattern(ml, 8) when sliding_window > 0: full attention where il % 8 == 7 "
                          "(plamo3.cpp)"),
    "laguna": CutRule(swa_pattern=(4, True), front_counts=_LEAD,
                      why="load_swa_pattern(ml, 4, dense_first) when sliding_window > 0: full attention where "
                          "il % 4 == 0; dense FFN where il < n_layer_dense_lead (laguna.cpp)"),
    "exaone-moe": CutRule(swa_pattern=(4, False), front_counts=_LEAD,
                          why="load_swa_pattern(ml, 4), RoPE on sliding-window layers only; dense FFN where "
                              "il < n_layer_dense_lead; nextn layers dropped (exaone-moe.cpp)"),
    "cohere2moe": CutRule(swa_pattern=(4, True), front_counts=_LEAD,
                          why="load_swa_pattern(ml, 4, dense_first): full attention where il % 4 == 0, RoPE on "
                              "sliding-window and leading dense layers; dense FFN where il < n_layer_dense_lead; "
                              "nextn layers dropped (cohere2moe.cpp)"),
    # With a sliding window, no RoPE where il % n_no_rope_layer_step (4, no key) == 0: cuts keep
    # the phase, and no stage may have 4 layers (stage_refusal).
    "smallthinker": CutRule(period=4, swa_pattern=(4, True),
                            why="load_swa_pattern(ml, 4, dense_first) when sliding_window > 0, and no RoPE "
                                "where il % 4 == 0 unless the stage has 4 layers; MoE routed from the layer "
                                "input (smallthinker.cpp)"),
    "apertus": CutRule(why=f"{_INDEX_FREE} but the per-layer xIELU arrays (xielu.*, without the arch prefix), "
                           "sliced like any per-layer array (apertus.cpp)"),
    "afmoe": CutRule(period=4, swa_pattern=(4, False), front_counts=_LEAD, scales_any_input=True,
                     why="load_swa_pattern(ml, 4) when sliding_window > 0 and no RoPE where (il + 1) % 4 == 0; "
                         "dense FFN where il < n_layer_dense_lead; the graph scales every input by √n_embd "
                         "(afmoe.cpp)"),
    "deci": CutRule(tap_needs_ffn=True,
                    why="per-layer head counts and FFN widths sliced; attention-free (0 heads) and linear "
                        "(0 KV heads) layers by the arrays; no cut right after a layer of zero FFN width, which "
                        "names no l_out (deci.cpp)"),
    # Text only: token input pads the deepstack columns with zeros (build_inp_embd), which layers
    # il < n_deepstack_layers add; later stages, fed n_embd-wide hidden states, run with none.
    **{arch: CutRule(token_input_only={"n_deepstack_layers": 0},
                     why=f"{_INDEX_FREE} but the deepstack columns, zeros for text, which widen the input: "
                         f"off after stage 0; M-RoPE, 4 positions a row on later stages ({arch}.cpp)")
       for arch in ("qwen3vl", "qwen3vlmoe")},
    "deepseek2-ocr": CutRule(front_counts=_LEAD,
                             why="dense FFN where il < n_layer_dense_lead; multi-head attention with NEOX RoPE "
                                 "in deepseek2's graph, nothing it derives from n_layer() (deepseek2ocr.cpp)"),
    "openelm": CutRule(why=f"{_INDEX_FREE} but per-layer head counts and FFN widths, sliced; the head is the "
                           "token embeddings (openelm.cpp)"),
    "command-r": CutRule(why=f"{_INDEX_FREE}; not Command R+ (64 layers or more), whose q/k norms load_arch_tensors "
                             "creates only where n_layer >= 64 (command-r.cpp)"),
    # Text families (issue 54, part 5). maple's and spark2_5's arrays are sliced whatever the rule;
    # swa_array keeps a sliding layer in every stage (create_memory asserts is_swa_any).
    "maple": CutRule(swa_array=True,
                     why="sliding-window layers by the per-layer array (get_arr), RoPE on them only, with their "
                         "own RoPE base; every layer MoE, its SwiGLU clamp per layer (maple.cpp)"),
    "spark2_5": CutRule(swa_array=True,
                        why="sliding-window layers by the per-layer array (get_arr), with their own head counts "
                            "and RoPE; a sigmoid gate per head on the attention output (spark2-5.cpp)"),
    # Only without deepstack inputs (split_refusal), as granite's.
    "granite_swa": CutRule(swa_array=True, token_input_only={"embedding_scale": 0.0},
                           why="sliding-window layers by the per-layer array (get_arr) and RoPE by the per-layer "
                               "rope_pattern, both sliced; build_inp_embd applies f_embedding_scale to embd input "
                               "too (granite-swa.cpp)"),
    "dots3note": CutRule(front_counts=_LEAD, full_follows_sliding=True,
                         why="MLA in two geometries: full-attention layers with a DSA indexer and sliding-window "
                             "layers, both by per-layer arrays, sliced; a stage holds both kinds, so it starts at a "
                             "full-attention layer that follows a sliding one; dense FFN where "
                             "il < n_layer_dense_lead; nextn layers dropped (dots3note.cpp)"),
    "hunyuan_vl": CutRule(why=f"{_INDEX_FREE}; with XDRoPE sections (M-RoPE) later stages pass 4 positions a row; "
                              "the NTK alpha scales the RoPE base of every layer alike (hunyuan-vl.cpp)"),
}

# The per-layer DSA indexer kinds (1 full, 0 shared) of glm-dsa.cpp, read over n_layer().
INDEXER_TYPES = "{}.attention.indexer.types"

# Architectures whose hparams llama_model_deepseek2::load_arch_hparams reads (llama_model_mistral4
# derives from it, models.h): what it derives from n_layer() is written for the whole model.
DEEPSEEK2_HPARAMS = ("deepseek2", "mistral4")

# Refusal reasons, by what llama.cpp says the architecture is (packages/architecture_kinds.py).
_NOT_TEXT = {
    # Only for an architecture this table does not name (every hybrid and recurrent family of 0.3.36
    # is in RULES, ONE_NODE_STATEFUL or CANNOT_CUT).
    HYBRID: "hybrid attention and recurrent layers: no tiny model of it measured, neither a cut nor a rollback",
    RECURRENT: "recurrent layers: no tiny model of it measured, neither a cut nor a rollback",
    ENCODER: "an encoder (embeddings or reranking), not a text generator",
    ENCODER_DECODER: "an encoder-decoder model; meshpipe serves decoder-only models",
    VISION: "a vision tower, not a text generator",
    AUDIO: "an audio model, not a text generator",
    DIFFUSION: "a diffusion language model: it does not decode left to right",
    SPECULATOR: "a draft head that needs its target model's hidden states",
    UNKNOWN: "not an architecture llama.cpp 0.3.36 knows",
}
UNPROVEN = "splitting is not yet proven for it: served on one node"
# Text families whose graph cannot be cut, with the rule that stands in the way: served on one node.
ONE_NODE: dict[str, str] = {
    "baichuan": "the graph takes RoPE (7B, 32 layers) or ALiBi (13B, 40 layers) from the model type, which "
                "load_arch_hparams derives from n_layer(): a stage of any other count has neither (baichuan.cpp)",
    "bloom": "the graph LayerNorms whatever it is fed (token_embd_norm): a later stage would normalize the "
             "hidden state again (bloom.cpp)",
    "talkie": "every layer adds the normalized token embeddings (embd_skip): a later stage has no tokens (talkie.cpp)",
    "minicpm3": "the residual scale is 1.4/√n_layer of the stage's own layers, with no key to carry the whole "
                "model's, and every input is scaled by 12 (minicpm3.cpp)",
    "gptj": "llama.cpp 0.3.36 lists it but has no model class for it: it cannot load",
    "hy_v4": "hyper-connections: hc_init widens the embedding into hc streams and a layer hands on all of "
             "them ([n_embd, hc, n_tokens]), where a later stage takes one n_embd row (hy-v4.cpp)",
    "cogvlm": "ubatch.token picks the text or the vision experts of every layer: a later stage, fed hidden "
              "states, would run the vision experts (cogvlm.cpp)",
    "graniteswitch": "the graph asserts token input (GGML_ASSERT(ubatch.token)): a later stage cannot run "
                     "(granite-switch.cpp)",
    "hrm_text": "block_count must equal layers_per_stack * h_cycles * (l_cycles + 1) (asserted), the stacks "
                "re-run over cycles on shared weights (hrm-text.cpp)",
    "nanbeige": "num_loops runs the physical layers again, with a loop norm at (il + 1) % n_phys: a stage "
                "holds part of a loop (nanbeige.cpp)",
    "gemma3n": "layers past n_layer_kv_from_start (20, fixed) reuse earlier layers' KV, and per-layer inputs "
               "come from the tokens (gemma3n.cpp)",
    # Split exactly at any cut past the leading dense blocks (a stage of dense layers alone leaves
    # the sparse attention's inputs without a buffer: GGML_ASSERT(buffer)), but not lossless to
    # speculate with, on one node or many (tests/test_minimax_m3.py).
    "minimax-m3": "its sparse attention (MSA) takes a window's rows by the mask path and one row by the gather "
                  "path, which differ (by ~0.1 in the logits of a tiny model): a verified window is not the "
                  "tokens of plain decoding (minimax-m3.cpp)",
    # Older families (issue 54, part 4): split bit for bit on tiny models, not lossless to speculate.
    "grovemoe": "with experts_per_group > 1, speculation on a Q4_0 target parted from plain decoding (measured; "
                "1 does not): the chunk experts' ids are the routed ids scaled by 1/n_group_experts "
                "(build_moe_ffn); the graph reads nothing from the index and a 4-layer tiny model splits bit for "
                "bit (grovemoe.cpp)",
    "chameleon": "its head writes -FLT_MAX over logits [4, 8196) with ggml_set_1d, which reaches the first output "
                 "row only (a vocabulary shorter than 8196 aborts): a 4-layer tiny model splits bit for bit, but a "
                 "verify window's later rows keep the image tokens, so sampled speculation parted from plain "
                 "decoding (chameleon.cpp)",
    # Text families (issue 54, part 5); tests/test_architectures.py cuts a tiny one with its rule.
    "muse-glimmer": "the graph RMS-normalizes whatever it is fed (embd_norm, without a weight) and the residual "
                    "carries the normalized input: a later stage would normalize the hidden state, losing its "
                    "scale; a tiny model cut at 4, the sliding-window phase kept, parts at the second token "
                    "(muse-glimmer.cpp)",
    # Older families (issue 54, part 3).
    "plm": "the graph hands the KV cache V as one 2-D row per token where llama_kv_cache::cpy_v reads heads, "
           "so building it aborts (GGML_ASSERT in ggml_set_rows) with the flash attention every engine runs "
           "(plm.cpp): it cannot run at all",
}
# Recurrent families whose graph cannot be cut, served on one node: their state rolls back by
# checkpoint like any recurrent memory's (llama_memory_recurrent, the state API), which speculation on
# one node proves lossless (tests/test_recurrent_one_node.py).
_V_FIRST = ("every layer after the first mixes in the first layer's value (v_first, rwkv7-base.cpp): a later stage "
            "would take its own first layer's instead, which a cut cannot carry")
ONE_NODE_STATEFUL: dict[str, str] = {
    "rwkv6": "the graph LayerNorms whatever it is fed (token_embd_norm, the RWKV ln0): a later stage would "
             "normalize the hidden state again (rwkv6.cpp)",
    "rwkv7": "the graph LayerNorms whatever it is fed (token_embd_norm, the RWKV ln0), and " + _V_FIRST
             + " (rwkv7.cpp)",
    "arwkv7": _V_FIRST + " (arwkv7.cpp)",
}
# Hybrids whose graph cannot be cut, and what serving one on one node would also need: refused.
_HC = ("hyper-connections: hc_init repeats the embedding into {} streams and every layer reads and writes the "
       "[n_embd, {}, n_tokens] residual, where a stage takes one n_embd row")
_NO_TINY = "a tiny model of it to prove its state's rollback by checkpoint, which none is written for"
CANNOT_CUT: dict[str, str] = {
    "deepseek4": _HC.format("hc_mult", "hc_mult") + " (deepseek4.cpp); one node would also need its compressed "
                 "KV cache (llama_kv_cache_dsv4) rolled back, which removes positions inside a sequence only "
                 "within its own n_rs_seq rows and one removal at a time (seq_rm), and " + _NO_TINY,
    "glm5-next": _HC.format("hyper_connection.count (4)", "hc") + " (glm5-next.cpp); one node would also "
                 "need " + _NO_TINY,
    "qwen4exp": _HC.format("hyper_connection.count", "hc") + ", and PLE layers read per-layer n-gram embeddings "
                "of the tokens (build_inp_ple) (qwen4exp.cpp); one node would also need " + _NO_TINY,
    "kimi-k3": "cross-layer residual attention (attn_res_block_size > 0): every layer mixes over a bank of earlier "
               "layers' inputs, pushed where il % block_size == 0 by the stage's own index, which a cut would have "
               "to carry whole (kimi-k3.cpp); one node would also need " + _NO_TINY,
    "minimax-01": "each lightning-attention layer's decay slope is scaled by 1 - il / (n_layer - 1), from the "
                  "stage's own index and layer count, with no key to carry the whole model's (a 1-layer stage "
                  "divides by zero) (minimax-01.cpp); one node would also need " + _NO_TINY,
}
# exaone4.cpp's load_arch_hparams sets a sliding window (pattern 4) only where n_layer() is this.
_EXAONE4_SWA_LAYERS = 64
# smallthinker.cpp's n_no_rope_layer_step with a sliding window (llama_hparams' default, no key).
_SMALLTHINKER_NO_ROPE_STEP = 4
# Layer counts from which llama.cpp derives a 27B's attention scale.
_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def kind_of(architecture: str) -> str:
    return KINDS.get(architecture, UNKNOWN)


def keeps_state(architecture: str) -> bool:
    """Whether some layers keep recurrent state, which rolls back by checkpoint, not by trim."""
    return kind_of(architecture) in (HYBRID, RECURRENT)


def require_servable(architecture: str) -> None:
    """Refuse what meshpipe cannot serve even on one node, with the reason."""
    kind = kind_of(architecture)
    if kind != TEXT and architecture not in RULES and architecture not in ONE_NODE_STATEFUL:
        why = f"cannot be cut: {CANNOT_CUT[architecture]}" if architecture in CANNOT_CUT else _NOT_TEXT[kind]
        raise PackageError(f"cannot serve architecture '{architecture}': {why}")


def split_refusal(architecture: str, metadata: Mapping[str, Any] | None = None) -> str | None:
    """Why this model may not be split, or None when it may."""
    if architecture not in RULES:
        # a text model: one node, with its reason where one is known
        known = ONE_NODE.get(architecture) or ONE_NODE_STATEFUL.get(architecture) or CANNOT_CUT.get(architecture)
        return known or _NOT_TEXT.get(kind_of(architecture), UNPROVEN)
    blocks = (metadata or {}).get(f"{architecture}.block_count")
    if architecture in _27B_LAYERS and blocks == _27B_LAYERS[architecture]:
        # load_arch_hparams (gemma2.cpp, gemma3.cpp) takes the 27B's query scale
        # 1/sqrt(n_embd / n_head) from `type`, which is switch (n_layer()): a stage of fewer
        # layers gets 1/sqrt(head_dim) instead
        return (f"{architecture} with {blocks} layers (27B) takes its attention scale from the total "
                f"layer count")
    sections = (metadata or {}).get("glm4.rope.dimension_sections")
    if architecture == "glm4" and metadata is not None and not (isinstance(sections, list) and len(sections) >= 2
                                                                and sections[0] > 0 and sections[1] > 0):
        # glm4.cpp aborts on embedding input unless the model uses M-RoPE, and text-only GLM-4
        # rotates adjacent pairs (LLAMA_ROPE_TYPE_NORM) where M-RoPE rotates halves (as NEOX):
        # unlike glm4moe's NEOX, no sections can be written in without changing the model
        return "glm4 without M-RoPE sections (text-only GLM-4) cannot take hidden states in a later stage"
    if architecture == "command-r" and int(blocks or 0) >= 64:
        # a stage of fewer layers would not load the q/k norms the whole model has (command-r.cpp)
        return f"command-r with {blocks} layers (Command R+) has q/k norms llama.cpp loads only for 64 layers or more"
    nextn = int((metadata or {}).get(f"{architecture}.nextn_predict_layers") or 0)
    if architecture == "exaone4" and blocks is not None and int(blocks) - nextn == _EXAONE4_SWA_LAYERS:
        # the graph uses RoPE only on sliding-window layers then: a stage of fewer layers has no
        # sliding window and ropes every layer
        return "exaone4 with 64 layers (32B) has a sliding window llama.cpp turns on for 64 layers only"
    if architecture == "gemma4" and int((metadata or {}).get("gemma4.embedding_length_per_layer_input") or 0) > 0:
        # gemma4.cpp: per_layer_tok_embd rows of the token ids, mixed with stage 0's embeddings, feed
        # every layer; fed hidden states, a later stage would take the padding token's rows instead
        return ("gemma4 with per-layer inputs (E2B, E4B): every layer adds an input computed from the token "
                "ids, which a later stage does not have")
    deepstack = (metadata or {}).get(f"{architecture}.deepstack_mapping")
    if architecture in ("granite", "granite_swa") and isinstance(deepstack, list) and max(deepstack, default=-1) >= 0:
        # granite.cpp, granite-swa.cpp: the input is as wide as the distinct indices of a stage's slice
        # make it (n_embd_inp), and a layer adds a column of it, which a later stage's input does not hold
        return (f"{architecture} with deepstack inputs (Granite Vision): layers add columns of the widened "
                "embedding input, which a later stage does not have")
    if architecture == "llama4" and (metadata or {}).get("llama4.attention.sliding_window") == 0:
        # llama4.cpp then sets n_no_rope_layer_step = n_layer(): a stage's last layer would skip RoPE
        return "llama4 without chunked attention takes its RoPE rule from the total layer count"
    return None


def allowed_cuts(architecture: str, layer_count: int, metadata: Mapping[str, Any] | None = None) -> list[int]:
    """Interior cut points (0 < c < layer_count) that keep the model's computation unchanged:
    none for an architecture not proven, which still serves on one node."""
    if split_refusal(architecture, metadata) is not None:
        return []
    step = period(architecture, metadata)
    meta = metadata or {}
    cuts: Sequence[int] = range(step, layer_count, step)
    sliding = meta.get(swa_key(architecture))
    if _slides(RULES[architecture]) and isinstance(sliding, list):
        # With a sliding window, llama_model::create_memory (llama-model.cpp) asserts
        # `hparams.is_swa_any()`: a stage of full-attention layers only aborts the process. A
        # stage starting at a sliding-window layer has one, and so does the first stage when a
        # layer before the cut slides. (Without the array, cuts fall on multiples of the
        # pattern, whose first layer slides.)
        # The stage after a cut holds at least the `step` layers from it: one of them sliding will do
        # (smallthinker's cuts fall on its full-attention layers, sliding ones right after).
        cuts = [c for c in cuts if any(sliding[c:c + step]) and any(sliding[:c])]
    if RULES[architecture].recurrent_layers:
        # A stage that starts with a recurrent layer and ends with an attention layer holds both
        # kinds whatever the other cuts (stage_refusal checks the first and last stages). Where
        # the stage's own index tells the kinds (INTERVAL without the per-layer array), these are
        # the interval's multiples, which keep the pattern's phase too.
        recurrent = recurrent_layers(architecture, meta, layer_count)
        attention = attention_layers(architecture, meta, layer_count)
        cuts = [c for c in cuts if recurrent[c] and _last_mixer_is_attention(recurrent[:c], attention[:c])]
    if RULES[architecture].shared_indexers:
        full = meta.get(INDEXER_TYPES.format(architecture))
        # no array (a model the package has not seen): no cut, rather than guess the default
        cuts = [c for c in cuts if isinstance(full, list) and c < len(full) and full[c]]
    if RULES[architecture].kv_shared:
        # the last stage holds the KV-sharing layers and both their sources
        shared = int(meta.get(f"{architecture}.{RULES[architecture].kv_shared}") or 0)
        cuts = [c for c in cuts if shared == 0 or c <= layer_count - shared - 2]
    if RULES[architecture].tap_needs_ffn:
        cuts = [c for c in cuts if ffn_widths(architecture, meta, layer_count)[c - 1] > 0]
    if RULES[architecture].full_follows_sliding:
        # no array (a model the package has not seen): no cut, rather than guess the layers' kinds
        sliding = meta.get(swa_key(architecture))
        cuts = [c for c in cuts if isinstance(sliding, list) and c < len(sliding) and sliding[c - 1] and not sliding[c]]
    # the first and last stages of a split in two; a stage between cuts is checked when it is
    # materialized (stage_metadata)
    return [c for c in cuts if stage_refusal(architecture, meta, 0, c) is None
            and stage_refusal(architecture, meta, c, layer_count) is None]


def stage_refusal(architecture: str, metadata: Mapping[str, Any], start: int, end: int) -> str | None:
    """Why layers [start, end) of a package (its metadata) cannot be one stage, or None: what
    llama.cpp decides from a stage's own layers that no key can override."""
    if architecture in DEEPSEEK2_HPARAMS and int(metadata.get(f"{architecture}.attention.q_lora_rank") or 0) > 0 \
            and deepseek2_is_lite(end - start, metadata, architecture):
        # llama_model_deepseek2::load_arch_hparams skips q_lora_rank for a "Lite" layer count
        # (26, 27, or 48 with a 128256 vocabulary): such a stage would look for attn_q, which a
        # model with a q LoRA does not have.
        return (f"llama.cpp reads a {end - start}-layer {architecture} as Lite and ignores its "
                "q_lora_rank (deepseek2.cpp load_arch_hparams)")
    if architecture == "exaone4" and end - start == _EXAONE4_SWA_LAYERS:
        return "llama.cpp turns on a sliding window for a 64-layer exaone4 stage (exaone4.cpp load_arch_hparams)"
    if architecture == "smallthinker" and end - start == _SMALLTHINKER_NO_ROPE_STEP \
            and metadata.get("smallthinker.attention.sliding_window"):
        # smallthinker.cpp ropes every layer where n_no_rope_layer_step == n_layer(): a 4-layer stage
        # would rope the layers the whole model leaves unroped
        return "llama.cpp ropes every layer of a 4-layer smallthinker stage (smallthinker.cpp graph)"
    rule = RULES.get(architecture)
    if rule is not None and rule.kv_shared:
        shared = kv_shared_layers(architecture, metadata, start, end)
        if end - start - shared < 2:
            return (f"llama.cpp asserts a {architecture} stage has 2 layers or more of its own KV "
                    "(n_layer_kv_from_start >= 2, llama-model.cpp create_memory)")
    if rule is not None and rule.full_follows_sliding:
        sliding = metadata.get(swa_key(architecture))
        if not isinstance(sliding, list) or {bool(s) for s in sliding[start:end]} != {True, False}:
            return (f"a {architecture} stage needs a full-attention and a sliding-window layer: its memory "
                    "(llama_kv_cache_dsa_iswa) aborts without either (llama-model.cpp create_memory)")
    if rule is not None and rule.recurrent_layers:
        recurrent = recurrent_layers(architecture, metadata, end)[start:end]
        attention = attention_layers(architecture, metadata, end)[start:end]
        if not (any(recurrent) and any(attention)):
            return (f"its layers are all {'recurrent' if any(recurrent) else 'attention'}, and "
                    "llm_graph_input_mem_hybrid::set_input aborts unless a stage holds both kinds (llama-graph.cpp)")
    return None


# Architectures whose MTP (nextn) layers only a final stage from layer 0 runs, with the reason a
# later one cannot (issue 56). Such a stage leaves out the M-RoPE sections the package writes in
# (stage_metadata.with_mtp): it takes tokens, where M-RoPE at equal positions is NEOX RoPE.
MTP_FROM_LAYER_0: dict[str, str] = {
    "glm4moe": "its MTP graph ropes with ggml_rope_ext at the model's rope type, M-RoPE once the GGUF has "
               "the sections a later stage needs for hidden-state input, and ggml aborts on M-RoPE without "
               "sections (glm4-moe.cpp graph_mtp, ggml-cpu/ops.cpp)",
}


def mtp_refusal(architecture: str, start: int) -> str | None:
    """Why a final stage from layer `start` cannot run the MTP layers, or None."""
    reason = MTP_FROM_LAYER_0.get(architecture)
    return f"{architecture} runs MTP on a single stage only: {reason}" if reason and start > 0 else None


def kv_shared_layers(architecture: str, metadata: Mapping[str, Any], start: int, end: int) -> int:
    """How many of stage [start, end)'s last layers reuse earlier layers' KV (RULES[...].kv_shared):
    the whole model's count from the back, cut to the stage."""
    key = f"{architecture}.{RULES[architecture].kv_shared}"
    blocks = int(metadata.get(f"{architecture}.block_count") or end)
    return min(max(int(metadata.get(key) or 0) - (blocks - end), 0), end - start)


def recurrent_layers(architecture: str, metadata: Mapping[str, Any], layer_count: int) -> list[bool]:
    """Which of the first `layer_count` layers of a hybrid (RULES[...].recurrent_layers) are
    recurrent, as llama.cpp's load_arch_hparams marks them for the whole model."""
    prefix = f"{architecture}."
    if RULES[architecture].recurrent_layers == INTERVAL:
        listed = metadata.get(f"{prefix}attention.recurrent_layers")
        if isinstance(listed, list):
            return [bool(r) for r in listed[:layer_count]]
        step = int(metadata.get(f"{prefix}full_attention_interval") or 4)  # llama.cpp's default
        return [(il + 1) % step != 0 for il in range(layer_count)]
    if RULES[architecture].recurrent_layers == KV_AND_FF:  # hyb: nemotron-h.cpp's is_recr_impl
        kv = _per_layer(metadata, f"{prefix}attention.head_count_kv", layer_count)
        ff = _per_layer(metadata, f"{prefix}feed_forward_length", layer_count)
        return [k == 0 and f == 0 for k, f in zip(kv, ff, strict=True)]
    # n_head_kv defaults to n_head; with neither known every layer counts as recurrent, which
    # allows no cut
    kv = metadata.get(f"{prefix}attention.head_count_kv", metadata.get(f"{prefix}attention.head_count"))
    heads = kv[:layer_count] if isinstance(kv, list) else [kv] * layer_count
    return [int(n or 0) == 0 for n in heads]


# --- hyb: layers of neither kind (nemotron_h's FFN layers) ---
def attention_layers(architecture: str, metadata: Mapping[str, Any], layer_count: int) -> list[bool]:
    """Which of the first `layer_count` layers of a hybrid are attention layers: all that are not
    recurrent, but where some layers are neither (KV_AND_FF: KV heads and no FFN, the layers
    llama_model::create_memory gives KV for nemotron_h, llama-model.cpp)."""
    if RULES[architecture].recurrent_layers != KV_AND_FF:
        return [not r for r in recurrent_layers(architecture, metadata, layer_count)]
    kv = _per_layer(metadata, f"{architecture}.attention.head_count_kv", layer_count)
    ff = _per_layer(metadata, f"{architecture}.feed_forward_length", layer_count)
    return [k > 0 and f == 0 for k, f in zip(kv, ff, strict=True)]


def _per_layer(metadata: Mapping[str, Any], key: str, layer_count: int) -> list[int]:
    """A per-layer key's values (a scalar repeated), 0 where unknown."""
    value = metadata.get(key)
    values = value[:layer_count] if isinstance(value, list) else [value] * layer_count
    return [int(v or 0) for v in values]


def _last_mixer_is_attention(recurrent: Sequence[bool], attention: Sequence[bool]) -> bool:
    """Whether the last layer of either kind is an attention layer (layers of neither skipped)."""
    kinds = [a for r, a in zip(recurrent, attention, strict=True) if r or a]
    return bool(kinds) and kinds[-1]
# --- end hyb ---
def ffn_widths(architecture: str, metadata: Mapping[str, Any], layer_count: int) -> list[int]:
    """Each layer's FFN width, from the per-layer array or the one value for all; unknown counts as
    zero, which allows no cut after it."""
    widths = metadata.get(f"{architecture}.feed_forward_length")
    if isinstance(widths, list):
        return [int(w) for w in widths[:layer_count]]
    return [int(widths or 0)] * layer_count


def deepseek2_vocab(metadata: Mapping[str, Any], architecture: str = "deepseek2") -> int:
    """n_vocab as llama_model_deepseek2::load_arch_hparams reads it: vocab_size, else the token list."""
    size = metadata.get(f"{architecture}.vocab_size")
    return int(size) if size is not None else len(metadata.get("tokenizer.ggml.tokens") or ())


def deepseek2_is_lite(layers: int, metadata: Mapping[str, Any], architecture: str = "deepseek2") -> bool:
    """`is_lite` of llama_model_deepseek2::load_arch_hparams, for a model of `layers` = n_layer()."""
    return layers in (26, 27) or (layers == 48 and deepseek2_vocab(metadata, architecture) == 128256)


def period(architecture: str, metadata: Mapping[str, Any] | None = None) -> int:
    """Cuts fall on multiples of this: 1 where nothing is taken from the index."""
    rule, meta = RULES[architecture], metadata or {}
    steps = [rule.period]
    if rule.swa_pattern is not None and not isinstance(meta.get(swa_key(architecture)), list):
        # no per-layer array (a package written before it was added): keep the pattern's phase
        steps.append(int(meta.get(swa_key(architecture)) or rule.swa_pattern[0]))
    steps += [int(meta.get(f"{architecture}.{key}") or 1) for key in rule.period_keys]
    return math.lcm(*steps)


def _slides(rule: CutRule) -> bool:
    """Whether the rule's model has sliding-window layers told by the per-layer array."""
    return rule.swa_pattern is not None or rule.swa_array


def swa_key(architecture: str) -> str:
    return f"{architecture}.attention.sliding_window_pattern"


def describe_rule(architecture: str, metadata: Mapping[str, Any] | None = None) -> str:
    """One line for `mesh package` and `mesh serve`: proven with its rule, or why not."""
    refusal = split_refusal(architecture, metadata)
    if refusal is not None:
        return f"{architecture}: not split ({refusal})"
    n = period(architecture, metadata)
    where = "any layer" if n == 1 else f"every {n}th layer"
    if _slides(RULES[architecture]) and isinstance((metadata or {}).get(swa_key(architecture)), list):
        where = f"{where} that starts with a sliding-window layer"
    if RULES[architecture].recurrent_layers:
        where = "a recurrent layer that follows an attention layer"
    if RULES[architecture].shared_indexers:
        where = "a layer with a full indexer"
    if RULES[architecture].full_follows_sliding:
        where = "a full-attention layer that follows a sliding-window layer"
    return f"{architecture}: may be split at {where}; {RULES[architecture].why}"


# Graphs that name the last layer's output again after `l_out`: step35.cpp calls
# cb(cur, "h_nextn", -1) on the un-normed residual after its loop, and a tensor keeps its last
# name, so a stage's tap reads that one.
_LAST_OUTPUT = {"step35": "h_nextn"}


# hyb: nemotron-h.cpp (and nemotron-h-moe's, the same graph) names each layer's output after its
# residual nemotron_h_block_out, and l_out nothing, or an FFN's output before the residual.
_LAYER_OUTPUT = dict.fromkeys(("nemotron_h", "nemotron_h_moe"), "nemotron_h_block_out")
# plamo2.cpp names a layer's output after its FFN residual and never l_out.
_LAYER_OUTPUT["plamo2"] = "ffn_residual"


def tap_name(architecture: str, last_layer: int) -> str:
    """The graph's name for the output of a stage's last layer, which the hidden tap reads."""
    if architecture in _LAYER_OUTPUT:
        return f"{_LAYER_OUTPUT[architecture]}-{last_layer}"
    return _LAST_OUTPUT.get(architecture, f"l_out-{last_layer}")


def hidden_input_scale(architecture: str, width: int) -> float:
    """What a later stage multiplies hidden states by before feeding them: 1/√n_embd where the
    graph scales any input by √n_embd. Exact where √n_embd is a power of two, else within an
    ulp or so of the unsplit model."""
    rule = RULES.get(architecture)
    return 1.0 / math.sqrt(width) if rule is not None and rule.scales_any_input else 1.0


def package_verdict(architecture: str, cuts: Sequence[int], layer_count: int) -> str:
    """What a package's own cuts say: where it may be split and why, or why not."""
    if not cuts:
        return f"{architecture}: not split ({split_refusal(architecture) or 'the package lists no allowed cut'})"
    where = "any layer" if list(cuts) == list(range(1, layer_count)) else f"layers {', '.join(map(str, cuts))}"
    why = RULES[architecture].why if architecture in RULES else "as its package lists"
    return f"{architecture}: may be split at {where}; {why}"


def table() -> list[tuple[str, str]]:
    """Every architecture of the vendored llama.cpp, with what meshpipe does with it."""
    rows = []
    for arch in sorted(a for a, kind in KINDS.items() if kind != UNKNOWN):
        needs = f"; {INDEX_RULES[arch]}" if arch in INDEX_RULES else ""
        if arch in RULES:
            rows.append((arch, f"split: {describe_rule(arch).split(': ', 1)[1]}"))
        elif arch in ONE_NODE or arch in ONE_NODE_STATEFUL:
            rows.append((arch, f"one node: {ONE_NODE.get(arch) or ONE_NODE_STATEFUL[arch]}"))
        elif arch in CANNOT_CUT:
            rows.append((arch, f"refused: cannot be cut: {CANNOT_CUT[arch]}"))
        elif kind_of(arch) == TEXT:
            rows.append((arch, f"one node: {UNPROVEN.split(':')[0]}{needs}"))
        else:
            rows.append((arch, f"refused: {_NOT_TEXT[kind_of(arch)]}{needs}"))
    return rows


def check_range(start: int, end: int, layer_count: int, cuts: Sequence[int]) -> None:
    """Refuse empty, out-of-bounds, or disallowed-boundary layer ranges."""
    if end <= start:
        raise PackageError(f"layer range [{start},{end}) is empty")
    if start < 0 or end > layer_count:
        raise PackageError(f"layer range [{start},{end}) is outside [0,{layer_count})")
    boundaries = {0, layer_count, *cuts}
    for edge in (start, end):
        if edge not in boundaries:
            raise PackageError(
                f"cut at layer {edge} is not allowed for this architecture; "
                f"allowed cuts: {list(cuts) or 'none'}"
            )
