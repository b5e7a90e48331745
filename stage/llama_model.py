"""The one place a llama.cpp model is loaded, so every part of the project runs the same kernels.

The range engine, the draft, the tokenizer, the bench baseline and the test references all
load through here. These choices are made once, for all of them:

- **Extra buffer types.** llama.cpp repacks weights into CPU-specific layouts (CPU_REPACK,
  AMX). The AMX one segfaults at the first decode of several rows (upstream llama.cpp #20824;
  DESIGN.md §3 item 10 says where), so where the loaded library offers it, models load
  without extra buffer types. The library is asked which types it would use, not
  /proc/cpuinfo: a wheel built without AMX keeps its repacked kernels on an AMX CPU.
  `MESHPIPE_EXTRA_BUFTS=on|off` overrides the choice.
- **Memory-mapping.** With extra buffer types, llama.cpp repacks every Q4_0 matrix into an
  anonymous buffer while the mmapped file it read them from stays resident: a stage held its
  weights twice (BENCHMARKS.md, "Figures behind the code's choices"). So where extra buffer types are
  used, models load without mmap (read into their buffers once); elsewhere mmap stays.
  The numbers computed are the same either way. `MESHPIPE_MMAP=on|off` overrides the choice.
- **Flash attention.** With it on, a verify window of k rows gives logits bit-identical to k
  single-row decodes on SmolLM2 Q4_1, so speculation cannot change greedy output (README,
  "Numerics"). `MESHPIPE_FLASH_ATTN=on|off` overrides it.
- **The KV cache's types.** llama.cpp's default f16 cache sends a one-row graph with 512 KV
  cells or more down another flash-attention kernel than a graph of several rows: on two or
  more threads it splits the KV across them and sums the parts in another order, so a verify
  window parts from plain decoding past the first 256 tokens (issue 52). That path takes only
  an f16 or f32 cache with K and V alike; off it, every row count runs one kernel that gives
  each row to one thread whole, at any thread count. So K is cached in q8_0 and V in f16: as
  fast as llama.cpp's default here, a quarter less memory (DESIGN.md §9). K is bf16 where a
  head's size is not a multiple of q8_0's 32-element block, and V takes K's type where
  llama.cpp refuses unlike types (MLA). `MESHPIPE_KV_CACHE=f16` (or `K/V`) overrides it.

All are read from the environment so that processes the project spawns (local stages, the
bench baseline) make the same choice as their parent.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import llama_cpp
from llama_cpp import llama_cpp as L

from config.errors import MeshpipeError
from packages.gguf_header import read_scalars
from stage.engine_choice import engine_kind
from stage.ggml_lib import ggml

EXTRA_BUFTS_ENV = "MESHPIPE_EXTRA_BUFTS"
FLASH_ATTN_ENV = "MESHPIPE_FLASH_ATTN"
MMAP_ENV = "MESHPIPE_MMAP"
_CHOICES = {"on": True, "off": False}
_BROKEN_BUFTS = ("AMX",)  # extra buffer types that crash; see the module docstring


class LoadSettingError(MeshpipeError, ValueError):
    """An environment override with a value other than auto, on or off."""


def _setting(env: str, auto: bool) -> bool:
    value = os.environ.get(env, "auto").strip().lower()
    if value == "auto":
        return auto
    if value not in _CHOICES:
        raise LoadSettingError(f"{env}={value!r}: choose auto, on or off")
    return _CHOICES[value]


@functools.cache
def offered_extra_bufts() -> tuple[str, ...]:
    """The names of the extra buffer types the CPU backend of the loaded library would use."""
    return ggml.cpu_extra_bufts()


def use_extra_bufts() -> bool:
    """Whether models load with extra buffer types: yes unless the library offers a broken one."""
    return _setting(EXTRA_BUFTS_ENV, not any(b in _BROKEN_BUFTS for b in offered_extra_bufts()))


def use_mmap() -> bool:
    """Whether models are memory-mapped: not when extra buffer types repack the weights, as the
    mapped file would stay resident beside the repacked copy (the module docstring)."""
    return _setting(MMAP_ENV, not use_extra_bufts())


# Rows per graph compute (llama.cpp's n_ubatch). The CPU backend computes a graph of 64 rows
# or more on other kernels than a decode's: a prompt prefilled in such pieces differs in the
# last bits from the same tokens decoded one by one, so a prefix reused from an earlier
# request's KV, a resumed generation, or a window batched with a prefill could part from
# plain decoding at a near-tie (DESIGN.md §9). Below it, every row is computed as a
# single-row decode computes it, bit for bit, however the rows are batched; the price is
# prefill speed (SmolLM2 Q4_1, 1 thread, 1024 tokens: 8.9 s against 7.0 s in 128-row pieces).
INVARIANT_ROWS = 48


def flash_attn() -> bool:
    return _setting(FLASH_ATTN_ENV, True)


KV_CACHE_ENV = "MESHPIPE_KV_CACHE"
KV_TYPES = {"f32": 0, "f16": 1, "q8_0": 8, "bf16": 30}  # name -> enum ggml_type (ggml.h)
_BLOCK = {"q8_0": 32}  # a quantized cache's block, which must divide every head's size
KvCache = tuple[str, str]  # the K and V cache types
EXACT_KV: KvCache = ("q8_0", "f16")
LLAMA_KV: KvCache = ("f16", "f16")  # llama.cpp's own default
_SAME_TYPES = ("deepseek4",)  # llama.cpp refuses unlike K and V types for these and for MLA


def kv_cache_setting() -> KvCache | None:
    """MESHPIPE_KV_CACHE as (K, V) types: `f16`, `q8_0/f16`, ...; None for auto (the default)."""
    value = os.environ.get(KV_CACHE_ENV, "auto").strip().lower()
    if value == "auto":
        return None
    k, _, v = value.partition("/")
    if k not in KV_TYPES or (v or k) not in KV_TYPES:
        raise LoadSettingError(f"{KV_CACHE_ENV}={value!r}: choose auto, or a type or K/V pair of "
                               f"{', '.join(KV_TYPES)} (e.g. f16 for llama.cpp's default)")
    return k, v or k


def kv_cache_for(gguf: Path) -> KvCache:
    """The cache types a context on `gguf` gets: MESHPIPE_KV_CACHE, else the exact pair, its K
    in bf16 where q8_0's block does not divide a head, and V like K where llama.cpp needs it."""
    chosen = kv_cache_setting()
    if chosen is not None:
        return chosen
    header = _attention_header(gguf)
    sizes = [int(str(v)) for k, v in header.items() if k.endswith(("key_length", "value_length", "key_length_mla"))]
    k = EXACT_KV[0] if sizes and all(s % _BLOCK[EXACT_KV[0]] == 0 for s in sizes) else "bf16"
    same = any(key.endswith("key_length_mla") for key in header) or header.get("arch") in _SAME_TYPES
    return (k, k) if same else (k, EXACT_KV[1])


def _attention_header(gguf: Path) -> dict[str, object]:
    """The architecture and head sizes a GGUF declares; a head's size from the width and head
    count where the header gives none."""
    arch = str(read_scalars(gguf, ["general.architecture"]).get("general.architecture", ""))
    keys = [f"{arch}.attention.{k}" for k in ("key_length", "value_length", "key_length_mla", "head_count")]
    found: dict[str, object] = {**read_scalars(gguf, [*keys, f"{arch}.embedding_length"]), "arch": arch}
    heads, width = found.pop(keys[3], None), found.pop(f"{arch}.embedding_length", None)
    if keys[0] not in found and heads and width:
        found[keys[0]] = int(str(width)) // int(str(heads))
    return found


def kv_row_invariant(kv: KvCache) -> bool:
    """Whether attention computes a row the same bits whatever rows share its graph and however
    many threads run it: flash attention on, off the split-KV path that an f16 or f32 cache
    with K and V alike takes for a one-row graph (ggml-cpu/ops.cpp, DESIGN.md §9)."""
    return flash_attn() and (kv[0] != kv[1] or kv[0] not in ("f16", "f32"))


def model_params(vocab_only: bool = False) -> L.llama_model_params:
    params = L.llama_model_default_params()
    params.use_extra_bufts = use_extra_bufts()
    params.load_mode = L.LLAMA_LOAD_MODE_MMAP if use_mmap() else L.LLAMA_LOAD_MODE_NONE
    params.vocab_only = vocab_only
    return params


def flash_attn_type() -> int:
    return L.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn() else L.LLAMA_FLASH_ATTN_TYPE_DISABLED


def load_model(gguf: Path, mtp: bool = False) -> ctypes.c_void_p | None:
    """A llama_model* for the low-level API (the range engine and the draft); with `mtp`, its
    multi-token-prediction layers too (llama.cpp skips them otherwise)."""
    params = model_params()
    params.load_mtp = mtp
    return L.llama_model_load_from_file(str(gguf).encode(), params)


_patching = threading.Lock()


def open_llama(gguf: Path, **kwargs: Any) -> llama_cpp.Llama:
    """llama-cpp-python's high-level Llama, loaded with this module's choices.

    Llama takes no use_extra_bufts argument; it reads llama_model_default_params() while it
    is built, so that function answers with this module's params for the duration.
    """
    kwargs.setdefault("verbose", False)
    kwargs.setdefault("flash_attn", flash_attn())
    kwargs.setdefault("n_ubatch", INVARIANT_ROWS)
    if not kwargs.get("vocab_only"):
        k, v = kv_cache_for(gguf)
        kwargs.setdefault("type_k", KV_TYPES[k])
        kwargs.setdefault("type_v", KV_TYPES[v])
    kwargs.setdefault("use_mmap", use_mmap())  # Llama sets load_mode from it, over the params
    original = L.llama_model_default_params
    params = model_params()
    with _patching:
        L.llama_model_default_params = lambda: params
        try:
            return llama_cpp.Llama(str(gguf), **kwargs)
        finally:
            L.llama_model_default_params = original


def architecture(model: ctypes.c_void_p) -> str:
    """The model's `general.architecture`, as llama.cpp read it."""
    buf = ctypes.create_string_buffer(64)
    n = L.llama_model_meta_val_str(model, b"general.architecture", buf, len(buf))
    return buf.value.decode() if n >= 0 else ""


def numerics_promise(threads: int, engines: Iterable[str] = ()) -> str:
    """What speculation promises about the numbers on this process's llama.cpp settings (and
    the other engines' the local stages run), said by `mesh serve` at start (DESIGN.md §9 holds
    the measurements quoted)."""
    others = dict.fromkeys(n for e in engines if (n := engine_kind(e).numerics))
    return "; ".join([_llama_promise(threads), *others])


def _llama_promise(threads: int) -> str:
    kv = kv_cache_setting() or EXACT_KV  # auto's fallbacks are row-invariant too
    name = "/".join(kv) if kv[0] != kv[1] else kv[0]
    if kv_row_invariant(kv) or (flash_attn() and threads <= 1):
        how = f"the {name} KV cache" + ("" if kv_row_invariant(kv) else " on one thread")
        return (f"flash attention with {how} computes a verify window's rows as plain decoding does: "
                f"output with speculation equals --no-draft bit for bit, logprobs included, where the "
                f"model's matmuls are row-invariant too (Q4_0 and Q4_1 measured); a K-quant model may "
                f"part at a near tie (Gemma-3 Q4_K_M: logits within 1.61)")
    why = ("flash attention is off: K·Q of several rows runs another kernel than one row's (logits within "
           "1.14 on SmolLM2)" if not flash_attn() else
           f"the {name} KV cache splits a one-row decode's attention across {threads} threads past 512 cells "
           f"(logits within 0.98 on SmolLM2)")
    return (f"WARNING: {why}, so speculative output may part from --no-draft at near ties (DESIGN.md §9); "
            f"leave {KV_CACHE_ENV} and {FLASH_ATTN_ENV} unset for bit-identical output")
