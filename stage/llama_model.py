"""The one place a llama.cpp model is loaded, so every part of the project runs the same kernels.

The range engine, the draft, the tokenizer, the bench baseline and the test references all
load through here. Two choices are made once, for all of them:

- **Extra buffer types.** llama.cpp repacks weights into CPU-specific layouts (CPU_REPACK,
  AMX). The AMX one segfaults at the first decode of several rows (upstream llama.cpp #20824;
  DESIGN.md §3 item 10 says where), so where the loaded library offers it, models load
  without extra buffer types. The library is asked which types it would use, not
  /proc/cpuinfo: a wheel built without AMX keeps its repacked kernels on an AMX CPU.
  `MESHPIPE_EXTRA_BUFTS=on|off` overrides the choice.
- **Memory-mapping.** With extra buffer types, llama.cpp repacks every Q4_0 matrix into an
  anonymous buffer while the mmapped file it read them from stays resident: a stage held its
  weights twice (peak RSS 2.19x its share on the 8B shape). So where extra buffer types are
  used, models load without mmap (read into their buffers once); elsewhere mmap stays.
  The numbers computed are the same either way. `MESHPIPE_MMAP=on|off` overrides the choice.
- **Flash attention.** With it on, a verify window of k rows gives logits bit-identical to k
  single-row decodes on SmolLM2 Q4_1, so speculation cannot change greedy output (README,
  "Numerics"). `MESHPIPE_FLASH_ATTN=on|off` overrides it.

Both are read from the environment so that processes the project spawns (local stages, the
bench baseline) make the same choice as their parent.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from pathlib import Path
from typing import Any

import llama_cpp
from llama_cpp import llama_cpp as L

from config.errors import MeshpipeError
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


def model_params(vocab_only: bool = False) -> L.llama_model_params:
    params = L.llama_model_default_params()
    params.use_extra_bufts = use_extra_bufts()
    params.load_mode = L.LLAMA_LOAD_MODE_MMAP if use_mmap() else L.LLAMA_LOAD_MODE_NONE
    params.vocab_only = vocab_only
    return params


def flash_attn_type() -> int:
    return L.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn() else L.LLAMA_FLASH_ATTN_TYPE_DISABLED


def load_model(gguf: Path) -> ctypes.c_void_p | None:
    """A llama_model* for the low-level API (the range engine and the draft)."""
    return L.llama_model_load_from_file(str(gguf).encode(), model_params())


_patching = threading.Lock()


def open_llama(gguf: Path, **kwargs: Any) -> llama_cpp.Llama:
    """llama-cpp-python's high-level Llama, loaded with this module's choices.

    Llama takes no use_extra_bufts argument; it reads llama_model_default_params() while it
    is built, so that function answers with this module's params for the duration.
    """
    kwargs.setdefault("verbose", False)
    kwargs.setdefault("flash_attn", flash_attn())
    kwargs.setdefault("n_ubatch", INVARIANT_ROWS)
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
