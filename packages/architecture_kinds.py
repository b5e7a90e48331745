"""What kind of model each llama.cpp architecture is, and what a layer cut can break in it.

Research data, read from the vendored llama.cpp (llama_cpp_python 0.3.36, vendor/llama.cpp):
src/llama-arch.cpp (LLM_ARCH_NAMES, llm_arch_is_hybrid / _recurrent / _diffusion),
src/models/<arch>.cpp (load_arch_hparams, load_arch_tensors, graph), src/llama-model.cpp
(common hparams, load_swa_pattern), src/llama-hparams.cpp (set_swa_pattern) and
src/llama-graph.cpp (build_inp_embd).

A stage GGUF renumbers its layers from 0 and sets `{arch}.block_count` to the range length, so
`n_layer` inside llama.cpp is the stage's own count. Later stages feed hidden states as `batch.embd`
rows (`ubatch.token == nullptr`), and non-final stages read `l_out-{last}`.

Notes on shared code that the INDEX_RULES entries refer to:
- `load_swa_pattern(ml, N, dense_first=false)` (llama-model.cpp) first reads
  `{arch}.attention.sliding_window_pattern` as a per-layer array; otherwise it reads it as a scalar
  period (default N) and calls `set_swa_pattern(N, dense_first)` (llama-hparams.cpp):
  dense_first=false makes layer il full attention when `il % N == N - 1`, dense_first=true when
  `il % N == 0`. Only the stage-local index counts, so a cut must start at a multiple of N or the
  stage GGUF must carry the array form.
- `build_inp_embd` (llama-graph.cpp) multiplies the input by `f_embedding_scale` when it is non-zero
  and `(ubatch.token || n_deepstack_layers == 0)`, i.e. for every model without deepstack it scales
  raw `batch.embd` rows too, so a later stage scales the incoming hidden state again unless its
  GGUF drops `{arch}.embedding_scale`.
- `n_layer_dense_lead` (`{arch}.leading_dense_block_count`) makes the first K layers (by stage-local
  index) dense; a later stage's GGUF must set it to max(0, K - start) or the loader asks for the
  wrong FFN tensors.
- `n_layer_nextn` (`{arch}.nextn_predict_layers`): `n_layer()` = block_count - nextn; the last
  nextn blocks are MTP heads loaded past the main stack (`i >= n_layer`).
"""

from __future__ import annotations

TEXT = "text"
HYBRID = "hybrid"
RECURRENT = "recurrent"
ENCODER = "encoder"
ENCODER_DECODER = "encoder_decoder"
VISION = "vision"
AUDIO = "audio"
DIFFUSION = "diffusion"
SPECULATOR = "speculator"
UNKNOWN = "unknown"

KINDS: dict[str, str] = {
    "clip": VISION,  # dummy for llama-quantize; build_arch_graph aborts (runtime is tools/mtmd/clip.cpp)
    "llama": TEXT,
    "llama4": TEXT,
    "deci": TEXT,  # per-layer head_count/feed_forward_length arrays (0 = skipped attention/FFN)
    "falcon": TEXT,
    "grok": TEXT,
    "gpt2": TEXT,
    "gptj": TEXT,  # listed in LLM_ARCH_NAMES but llama_model_mapping has no case: llama.cpp cannot load it
    "gptneox": TEXT,
    "mpt": TEXT,
    "baichuan": TEXT,
    "starcoder": TEXT,
    "refact": TEXT,
    "bert": ENCODER,
    "modern-bert": ENCODER,
    "nomic-bert": ENCODER,  # uses llama_model_bert::graph
    "nomic-bert-moe": ENCODER,  # uses llama_model_bert::graph
    "neo-bert": ENCODER,
    "jina-bert-v2": ENCODER,  # uses llama_model_bert::graph
    "jina-bert-v3": ENCODER,  # uses llama_model_bert::graph
    "eurobert": ENCODER,
    "bloom": TEXT,
    "stablelm": TEXT,
    "qwen": TEXT,
    "qwen2": TEXT,
    "qwen2moe": TEXT,
    "qwen2vl": TEXT,  # the language model of Qwen2-VL (M-RoPE sections); the vision tower is a separate clip file
    "qwen3": TEXT,
    "qwen3moe": TEXT,
    "qwen3next": HYBRID,
    "qwen3vl": TEXT,  # Qwen3-VL language model, with deepstack
    "qwen3vlmoe": TEXT,  # Qwen3-VL MoE language model, with deepstack
    "qwen35": HYBRID,
    "qwen35moe": HYBRID,
    "qwen4exp": HYBRID,
    "phi2": TEXT,
    "phi3": TEXT,
    "phimoe": TEXT,  # uses llama_model_phi3::graph
    "plamo": TEXT,
    "plamo2": HYBRID,
    "plamo3": TEXT,
    "codeshell": TEXT,
    "orion": TEXT,
    "internlm2": TEXT,
    "minicpm": TEXT,  # uses llama_model_granite::graph
    "minicpm3": TEXT,
    "gemma": TEXT,
    "gemma2": TEXT,
    "gemma3": TEXT,
    "gemma3n": TEXT,
    "gemma4": TEXT,
    "gemma4-assistant": SPECULATOR,  # MTP-only drafter: only n_layer_nextn blocks, needs the gemma4 target's h_nextn
    "gemma-embedding": ENCODER,  # gemma3-like graph with causal_attn = false, pooled embeddings
    "starcoder2": TEXT,
    "mamba": RECURRENT,
    "mamba2": RECURRENT,  # uses llama_model_mamba::graph
    "maple": TEXT,  # attention-only (per-layer SWA array, MoE), not in llm_arch_is_hybrid
    "jamba": HYBRID,
    "falcon-h1": HYBRID,
    "xverse": TEXT,
    "command-r": TEXT,
    "cohere2": TEXT,
    "cohere2moe": TEXT,
    "dbrx": TEXT,
    "olmo": TEXT,
    "olmo2": TEXT,
    "olmoe": TEXT,
    "muse-glimmer": TEXT,
    "openelm": TEXT,  # per-layer head_count/head_count_kv/feed_forward_length arrays only
    "arctic": TEXT,
    "deepseek": TEXT,
    "deepseek2": TEXT,
    "deepseek2-ocr": TEXT,  # DeepSeek-OCR language decoder; uses llama_model_deepseek2::graph
    "deepseek32": TEXT,  # DeepSeek-V3.2: MLA + DSA indexer, attention-only
    "deepseek4": HYBRID,
    "chatglm": TEXT,
    "glm4": TEXT,
    "glm4moe": TEXT,
    "glm-dsa": TEXT,  # attention-only (MLA + DSA indexer), not in llm_arch_is_hybrid
    "bitnet": TEXT,
    "t5": ENCODER_DECODER,
    "t5encoder": ENCODER,  # uses llama_model_t5::graph<true> (encoder half only)
    "jais": TEXT,
    "jais2": TEXT,
    "nemotron": TEXT,
    "nemotron_h": HYBRID,
    "nemotron_h_moe": HYBRID,
    "exaone": TEXT,
    "exaone4": TEXT,
    "exaone-moe": TEXT,
    "rwkv6": RECURRENT,
    "rwkv6qwen2": RECURRENT,
    "rwkv7": RECURRENT,
    "arwkv7": RECURRENT,
    "granite": TEXT,
    "granitemoe": TEXT,  # uses llama_model_granite::graph
    "granitehybrid": HYBRID,
    "graniteswitch": TEXT,  # granite + adapter router layer; asserts ubatch.token
    "granite_swa": TEXT,  # attention-only granite with per-layer SWA/rope arrays
    "chameleon": TEXT,  # image tokens are vocabulary tokens; causal text-style generation
    "wavtokenizer-dec": AUDIO,
    "plm": TEXT,
    "bailingmoe": TEXT,
    "bailingmoe2": TEXT,
    "bailingmoe3": HYBRID,
    "dots1": TEXT,
    "dots3note": TEXT,  # attention-only (MLA + DSA indexer), per-layer SWA array
    "arcee": TEXT,
    "afmoe": TEXT,
    "laguna": TEXT,
    "ernie4_5": TEXT,
    "ernie4_5-moe": TEXT,  # class derives from ernie4_5 (same file ernie4-5.cpp loader)
    "hunyuan-moe": TEXT,
    "hunyuan-dense": TEXT,  # uses llama_model_hunyuan_vl::graph
    "hunyuan_vl": TEXT,  # HunyuanOCR/VL language decoder (rope sections)
    "hy_v3": TEXT,
    "hy_v4": TEXT,  # attention-only, but hyper-connections: the residual is hc x n_embd
    "smollm3": TEXT,
    "gpt-oss": TEXT,  # LLM_ARCH_OPENAI_MOE, src/models/openai-moe.cpp
    "lfm2": HYBRID,
    "lfm2moe": HYBRID,
    "dream": DIFFUSION,
    "smallthinker": TEXT,
    "llada": DIFFUSION,
    "llada-moe": DIFFUSION,
    "seed_oss": TEXT,
    "grovemoe": TEXT,
    "apertus": TEXT,
    "minimax-01": HYBRID,
    "hrm_text": TEXT,  # causal, but block_count is an expanded slot count over shared weights
    "minimax-m2": TEXT,
    "minimax-m3": TEXT,  # attention-only (MiniMax sparse attention), not in llm_arch_is_hybrid
    "cogvlm": TEXT,  # LM with per-layer vision experts, chosen by ubatch.token
    "rnd1": DIFFUSION,
    "pangu-embedded": TEXT,  # openPangu-Embedded 1B/7B: a causal text LLM ("embedded" = on-device), not embeddings
    "mistral3": TEXT,
    "eagle3": SPECULATOR,  # draft head fed with target_layers hidden states
    "dflash": SPECULATOR,  # block-diffusion draft head fed with target_layers hidden states
    "mistral4": TEXT,  # derives from deepseek2, uses llama_model_deepseek2::graph
    "paddleocr": TEXT,  # PaddleOCR-VL language decoder, derives from ernie4_5
    "mimo2": TEXT,
    "step35": TEXT,
    "spark2_5": TEXT,
    "llama-embed": ENCODER,  # llama graph<embed=true>: build_attn_inp_no_cache, no KV cache, pooling
    "maincoder": TEXT,
    "kimi-linear": HYBRID,
    "kimi-k3": HYBRID,
    "glm5-next": HYBRID,
    "talkie": TEXT,  # plain causal LM with a logit scale
    "mellum": TEXT,
    "nanbeige": TEXT,  # looped: physical layers repeated num_loops times
    "qwen3tts": AUDIO,  # TTS talker; reuses llama_model_qwen3vl hparams/tensors/graph
    "pockettts": AUDIO,  # pocket-tts CALM backbone: no lm_head, audio latents come from the flow net in the mmproj
    "(unknown)": UNKNOWN,
}

INDEX_RULES: dict[str, str] = {
    # --- families the brief names ---
    "llama4": (
        "llama4.cpp: load_swa_pattern(ml, 4) (dense_first=false, chunked attention, full at il%4==3); "
        "graph uses RoPE only when (il+1) % n_no_rope_layer_step != 0 with n_no_rope_layer_step=4 "
        "(or = n_layer() when sliding_window==0, so every stage's own last layer becomes NoPE); "
        "load_arch_tensors/graph make layer i MoE when (i+1) % interleave_moe_layer_step == 0."
    ),
    "gemma": (
        "gemma.cpp graph: ggml_scale(inpL, sqrtf(n_embd)) unconditionally, so a later stage's embd input is rescaled."
    ),
    "gemma2": (
        "gemma2.cpp: load_swa_pattern(ml, 2) (dense_first=false: full at odd il); graph scales inpL by "
        "sqrtf(n_embd) unconditionally (also raw embd input); load_arch_hparams sets f_attention_scale "
        "from type == LLM_TYPE_27B, and type comes from switch (hparams.n_layer()) (46 layers), so a 27B "
        "stage gets 1/sqrt(head_dim) instead of 1/sqrt(n_embd/n_head)."
    ),
    "gemma3": (
        "gemma3.cpp: load_swa_pattern(ml, 6) (dense_first=false: full at il%6==5) when sliding_window>0; "
        "f_attention_scale depends on type == LLM_TYPE_27B from switch (hparams.n_layer()) (62 layers), "
        "so 27B stages get the wrong query scale; the sqrtf(n_embd) input scale is conditioned on "
        "ubatch.token (cut-safe)."
    ),
    "gpt-oss": "openai-moe.cpp: load_swa_pattern(ml, 2) (dense_first=false: SWA at even il, full at odd il).",
    "olmo2": (
        "olmo2.cpp: load_swa_pattern(ml, 4) (dense_first=false: full at il%4==3) when sliding_window>0 "
        "(OLMo3); is_swa(il) also selects the RoPE scaling per layer."
    ),
    "granite": (
        "granite.cpp: f_embedding_scale (embedding_scale) is applied in llama-graph.cpp build_inp_embd to "
        "embd input too unless deepstack is present; deepstack_mapping is a per-layer get_arr indexed by il "
        "(il>0 adds a view of t_inp_embd columns); rope_pattern is per-layer (filled uniformly from "
        "rope.scaling.finetuned)."
    ),
    "granitemoe": (
        "granite-moe.cpp loads f_embedding_scale and uses llama_model_granite::graph, so build_inp_embd "
        "(llama-graph.cpp) scales a later stage's embd input again."
    ),
    "minicpm": (
        "minicpm.cpp defaults f_embedding_scale=12 (embedding_scale overrides) and uses the granite graph, "
        "so build_inp_embd (llama-graph.cpp) scales every stage's embd input by it."
    ),
    "smollm3": (
        "smollm3.cpp: n_no_rope_layer_step=4 hard-coded; graph uses RoPE only when (il+1) % 4 != 0 (NoPE at il%4==3)."
    ),
    "deepseek2": (
        "deepseek2.cpp: leading_dense_block_count (n_layer_dense_lead) decides dense vs MoE in "
        "load_arch_tensors and graph; nextn_predict_layers (n_layer_nextn) MTP blocks are loaded at "
        "i >= n_layer() and the MTP graph uses il = n_layer(); load_arch_hparams treats n_layer() 26/27 "
        "(or 48 with n_vocab 128256) as a Lite model without q_lora_rank, and with no expert_gating_func "
        "picks sigmoid only for n_layer() 47/48 and n_vocab 154880."
    ),
    "glm4moe": (
        "glm4-moe.cpp: leading_dense_block_count (n_layer_dense_lead) in loader and graph; MTP blocks at "
        "i >= n_layer() via nextn_predict_layers (probe blk.{n_layer}.nextn.eh_proj), MTP graph "
        "il = n_layer() + nextn_layer_offset."
    ),
    "cohere2": (
        "cohere2.cpp: load_swa_pattern(ml, 4) (dense_first=false: full at il%4==3); graph applies RoPE only "
        "on SWA layers (is_swa(il))."
    ),
    "exaone4": (
        "exaone4.cpp: SWA (n_swa=4096, load_swa_pattern(ml, 4), dense_first=false) is enabled only when "
        "hparams.n_layer() == 64 (32B), so any cut of the 32B drops SWA and, because the graph uses RoPE "
        "only on SWA layers or when swa_type is NONE, changes RoPE; loader treats i >= n_layer() "
        "(nextn_predict_layers) as MTP blocks."
    ),
    "ernie4_5-moe": (
        "ernie4-5.cpp/ernie4-5-moe.cpp: layer il is MoE when il >= leading_dense_block_count and "
        "(il+1) % interleave_moe_layer_step == 0 (loader only checks n_layer_dense_lead)."
    ),
    "apertus": (
        "apertus.cpp: per-layer xIELU arrays xielu.alpha_n/alpha_p/beta/eps (no arch prefix) read with "
        "get_key_or_arr(..., n_layer()) and indexed by il in the graph."
    ),
    # --- the rest, as far as checked ---
    "afmoe": (
        "afmoe.cpp: graph ggml_scale(inpL, sqrtf(n_embd)) unconditionally; RoPE only when "
        "(il+1) % n_no_rope_layer_step(default 4) != 0; load_swa_pattern(ml, 4) (dense_first=false); "
        "leading_dense_block_count."
    ),
    "minicpm3": (
        "minicpm3.cpp graph: ggml_scale(inpL, 12.0f) unconditionally, and residual scale_res = "
        "1.4/sqrtf(n_layer) uses the stage-local n_layer, so any cut changes every residual."
    ),
    "grok": (
        "grok.cpp defaults f_embedding_scale=78.38 (embedding_scale overrides), applied by build_inp_embd "
        "(llama-graph.cpp) to a later stage's embd input too."
    ),
    "granite_swa": (
        "granite-swa.cpp: sliding_window_pattern array (get_arr), rope_pattern array, deepstack_mapping "
        "array indexed by il, per-layer expert_used_count; f_embedding_scale via build_inp_embd."
    ),
    "graniteswitch": (
        "granite-switch.cpp: appends a router layer at index n_layer() (n_layer_nextn repurposed to 1, "
        "has_rope false there), graph GGML_ASSERTs ubatch.token and scales inpL by f_embedding_scale "
        "itself, so non-first stages cannot run."
    ),
    "cogvlm": (
        "cogvlm.cpp graph: ubatch.token picks text vs vision-expert weights for every layer, so a later "
        "stage's embd input runs through the vision experts."
    ),
    "qwen3vl": (
        "qwen3vl.cpp: il < n_deepstack_layers (num_deepstack_layers) adds columns (il+1)*n_embd of "
        "t_inp_embd, and n_embd_inp = n_embd*(1+n_deepstack_layers), so later stages need it set to 0."
    ),
    "qwen3vlmoe": (
        "qwen3vlmoe.cpp: il < n_deepstack_layers adds deepstack columns of t_inp_embd; n_embd_inp grows "
        "with num_deepstack_layers."
    ),
    "gemma3n": (
        "gemma3n.cpp: load_swa_pattern(ml, 5); n_layer_kv_from_start=20 hard-coded (later layers reuse "
        "earlier KV), il < n_layer_sparsity, AltUp streams and per-layer token inputs (ubatch.token) "
        "make it unsplittable."
    ),
    "gemma4": (
        "gemma4.cpp: sliding_window_pattern array (get_arr); n_layer_kv_from_start = n_layer_all - "
        "attention.shared_kv_layers, and create_memory (llama-model.cpp) makes layers from there reuse the KV "
        "of layer n_layer_kv_from_start - 2 (sliding) or - 1 (full), asserting n_layer_kv_from_start >= 2 "
        "on every stage: the last stage must hold both source layers, and no stage may have one layer; with "
        "embedding_length_per_layer_input > 0 (E2B, E4B) each layer adds an input computed from the token ids "
        "(per_layer_tok_embd) and stage 0's embeddings, which on embd input become the padding token's row "
        "and the incoming hidden state: it would have to cross the wire; the sqrt(n_embd) input scale is "
        "conditioned on ubatch.token."
    ),
    "exaone-moe": (
        "exaone-moe.cpp: load_swa_pattern(ml, 4) (dense_first=false); leading_dense_block_count; MTP "
        "blocks at i >= n_layer()."
    ),
    "cohere2moe": (
        "cohere2moe.cpp: load_swa_pattern(ml, 4, true) (full at il%4==0); leading_dense_block_count; "
        "MTP at il = n_layer()."
    ),
    "laguna": (
        "laguna.cpp: load_swa_pattern(ml, 4, /*dense_first=*/true) (full at il%4==0); leading_dense_block_count."
    ),
    "smallthinker": (
        "smallthinker.cpp: with sliding_window, load_swa_pattern(ml, 4, true) and NoPE at il%4==0 "
        "(n_no_rope_layer_step default 4); without it, n_no_rope_layer_step = n_layer() (all RoPE)."
    ),
    "mellum": "mellum.cpp: load_swa_pattern(ml, 4) (dense_first=false) when sliding_window is set.",
    "muse-glimmer": "muse-glimmer.cpp: load_swa_pattern(ml, 4) (dense_first=false); RoPE only on SWA layers.",
    "plamo3": "plamo3.cpp: load_swa_pattern(ml, 8) (dense_first=false: full at il%8==7) when sliding_window is set.",
    "maple": "maple.cpp: sliding_window_pattern array (get_arr) and per-layer swiglu_clamp_exp (get_key_or_arr).",
    "spark2_5": "spark2-5.cpp: sliding_window_pattern read as a per-layer array (get_arr, required).",
    "mimo2": (
        "mimo2.cpp: sliding_window_pattern array (get_arr); MTP blocks at i >= n_layer() "
        "(nextn_predict_layers), MTP graph il = n_layer() + nextn_layer_offset."
    ),
    "step35": (
        "step35.cpp: sliding_window_pattern array; per-layer swiglu_clamp_exp/swiglu_clamp_shexp; MTP "
        "at il = n_layer() + nextn_layer_offset."
    ),
    "dots3note": (
        "dots3note.cpp: sliding_window_pattern and attention.indexer.types arrays (get_arr); "
        "leading_dense_block_count; MTP blocks at i >= n_layer()."
    ),
    "glm-dsa": (
        "glm-dsa.cpp: attention.indexer.types per layer (get_key_or_arr, n_layer()) — shared-indexer "
        "layers reuse the previous full layer's top-k; leading_dense_block_count; MTP at n_layer()."
    ),
    "deepseek32": (
        "deepseek32.cpp: leading_dense_block_count; MTP blocks at i >= n_layer(), MTP graph il = "
        "n_layer() + nextn_layer_offset."
    ),
    "mistral4": (
        "mistral4 reuses deepseek2's load_arch_hparams/tensors/graph: leading_dense_block_count, nextn MTP "
        "blocks and the n_layer()-based Lite detection."
    ),
    "command-r": (
        "command-r.cpp load_arch_tensors creates attn_q_norm/attn_k_norm only when n_layer >= 64 (Command R+), "
        "so a stage of fewer layers leaves those tensors unloaded and skips QK-norm."
    ),
    "baichuan": (
        "baichuan.cpp: type comes from switch (hparams.n_layer()) (32 -> 7B RoPE, 40 -> 13B ALiBi with "
        "f_max_alibi_bias=8); any other stage count is LLM_TYPE_UNKNOWN, which the graph treats like 13B "
        "(no RoPE, no inp_pos) but without the ALiBi bias, so every cut breaks."
    ),
    "deepseek2-ocr": "deepseek2ocr.cpp: leading_dense_block_count in loader; deepseek2 graph.",
    "deepseek": "deepseek.cpp: leading_dense_block_count decides dense vs MoE in loader and graph.",
    "dots1": "dots1.cpp: leading_dense_block_count decides dense vs MoE in loader and graph.",
    "bailingmoe": "bailingmoe.cpp: loads leading_dense_block_count (n_layer_dense_lead).",
    "bailingmoe2": "bailingmoe2.cpp: leading_dense_block_count in loader and graph; MTP blocks at i >= n_layer().",
    "minimax-m3": (
        "minimax-m3.cpp: leading_dense_block_count decides dense vs MoE in loader and graph, and sparse (MSA) "
        "attention with an indexer cache where il >= n_layer_dense_lead (create_memory filters the indexer "
        "cache so); the MSA inputs are built whatever the layers, so a stage of dense layers alone aborts "
        "(GGML_ASSERT(buffer)); a batch of rows takes the mask path and one row the gather path, which differ."
    ),
    "glm4": "glm4.cpp: loads MTP (nextn) blocks past the main stack (i >= n_layer()).",
    "hy_v3": "hy-v3.cpp: MTP blocks at i >= n_layer(), MTP graph il = n_layer() + nextn_layer_offset.",
    "hy_v4": (
        "hy-v4.cpp: hyper-connections expand the embedding to hc streams (hc_init) and l_out is the "
        "[n_embd, hc, n_tokens] tensor; attention.indexer.types per layer; per-layer swiglu_clamp_exp; "
        "leading_dense_block_count."
    ),
    "hrm_text": (
        "hrm-text.cpp: block_count must equal layers_per_stack*h_cycles*(l_cycles+1) (asserted), the "
        "stacks are re-run over cycles and l_out is named per slot s; not cuttable."
    ),
    "nanbeige": (
        "nanbeige.cpp: num_loops repeats the physical layers (n_layer_all expanded), and a loop_norm is "
        "inserted when (il+1) % n_phys == 0; cuts must respect the loop structure."
    ),
    "ernie4_5": "ernie4-5.cpp graph: at il == n_layer-1 it always calls ggml_get_rows(inp_out_ids) (no null check).",
    "paddleocr": "paddleocr.cpp graph: at il == n_layer-1 it always calls ggml_get_rows(inp_out_ids) (no null check).",
    "bitnet": (
        "bitnet.cpp names two tensors l_out per layer (before and after build_cvec); the last is the layer output."
    ),
    "gptneox": "gptneox.cpp names l_out in two branches (parallel and sequential residual); one per layer is built.",
    "nemotron_h": (
        "nemotron-h.cpp names a layer's output nemotron_h_block_out, and l_out only an FFN layer's output before "
        "its residual: the hidden tap reads the former (architectures.tap_name)."
    ),
    "nemotron_h_moe": "nemotron-h-moe.cpp runs nemotron_h's graph: a layer's output is nemotron_h_block_out.",
    # --- frontier hybrids whose residual is not one hidden state (issue 54, the DSA branch) ---
    "glm5-next": (
        "glm5-next.cpp: hyper-connections (hyper_connection.count, asserted 4): hc_init repeats the embedding "
        "into hc streams and each layer reads and writes the [n_embd, hc, n_tokens] residual, so a cut would "
        "have to carry hc x n_embd a row where a stage takes n_embd; KDA recurrent layers where head_count_kv "
        "is 0; attention.indexer.types per layer over n_layer()."
    ),
    "deepseek4": (
        "deepseek4.cpp: hyper-connections: hc_init repeats the embedding into hc_mult streams, the residual "
        "between layers is [n_embd, hc_mult, n_tokens] (n_embd_out = hc_mult x n_embd), which a cut would have "
        "to carry where a stage takes n_embd; per-layer attention.compress_ratios (get_arr, at least block_count "
        "long); the MTP graph asserts token input."
    ),
    "kimi-k3": (
        "kimi-k3.cpp: with attn_res_block_size > 0, cross-layer residual attention: every layer mixes over a "
        "bank of the inputs of earlier layers (res_push where il % block_size == 0 by the stage's own index), "
        "which a cut would have to carry whole; KDA recurrent layers where head_count_kv is 0; leading dense "
        "blocks; MLA without RoPE."
    ),
}

# --- hyb: qwen4exp ---
# Why no cut can carry its residual, whatever the memories: the graph widens the embedding into
# hyper-connection streams and hands a layer on as all of them.
INDEX_RULES["qwen4exp"] = (
    "qwen4exp.cpp cannot be cut: the residual between layers is hyper_connection.count streams of n_embd "
    "(l_last is n_embd x hc), while a stage's input is n_embd wide and build_inp_embd's output is repeated into "
    "hc identical copies (hc_init), so a later stage cannot be handed the streams; PLE layers also read "
    "per-layer n-gram embeddings from the tokens (build_inp_ple)."
)
# --- end hyb ---


# Metadata key suffixes (after "{arch}.") that llama.cpp reads as per-layer arrays.
PER_LAYER_KEYS: tuple[str, ...] = (
    # get_key_or_arr(..., n_layer_all): an array must have exactly block_count entries.
    "expert_used_count",  # llama-model.cpp:1333 (load_hparams); granite-swa.cpp:14
    "feed_forward_length",  # llama-model.cpp:1395
    "attention.head_count",  # llama-model.cpp:1396
    "attention.head_count_kv",  # llama-model.cpp:1404
    "expert_feed_forward_length",  # models/*: llama4, qwen2moe, qwen3moe, deepseek2, glm4-moe, openai-moe, ...
    "swiglu_clamp_exp",  # bailingmoe3:26, deepseek4:36, dflash:62, glm5-next:34, hy-v4:39, maple:16, step35:28
    "swiglu_clamp_shexp",  # bailingmoe3:27, deepseek4:37, dflash:63, glm5-next:35, step35:29
    "attention.recurrent_layers",  # qwen3next:17, qwen35:17, qwen35moe:20, qwen4exp:131, minimax-01:12
    # qwen4exp:65 (get_key_or_arr); deepseek4:61 (get_arr, length >= block_count); dflash:70 (get_arr)
    "attention.compress_ratios",
    # get_key_or_arr(..., n_layer()): length block_count - nextn_predict_layers.
    "attention.indexer.types",  # glm-dsa:66, glm5-next:47, hy-v4:59; dots3note:40 (get_arr)
    # get_arr (length not checked against block_count; element il applies to layer il).
    "attention.sliding_window_pattern",  # llama-model.cpp:3435 load_swa_pattern (array form); gemma4:6,
    # gemma4-assistant:7, maple:10, mimo2:12, step35:26, spark2-5:8, granite-swa:17, dots3note:34, dflash:100
    "attention.rope_pattern",  # granite-swa.cpp:43
    "deepstack_mapping",  # granite.cpp:13, granite-swa.cpp:22
    # Full key names, NOT "{arch}."-prefixed (LLM_KV_XIELU_* in llama-arch.cpp:428-431); read with
    # get_key_or_arr(..., n_layer()) in apertus.cpp:6-9.
    "xielu.alpha_n",
    "xielu.alpha_p",
    "xielu.beta",
    "xielu.eps",
)
# Arrays whose values are layer indices rather than one entry per layer (also break under
# renumbering): "ple.layers" (qwen4exp.cpp:75) and "target_layers" (eagle3.cpp:6, dflash.cpp:37).
