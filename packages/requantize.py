"""Requantize a GGUF with llama.cpp: how the embedded package gets its draft (DESIGN.md §8).

SmolLM2 Q4_1 requantized to Q4_0 agrees with the original on about 3 of 4 greedy tokens:
a realistic draft that ships with the package instead of being downloaded.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

from llama_cpp import llama_cpp as L

from packages.errors import PackageError
from packages.integrity import atomic_file

# F32 and F16 dequantize: the bench's cost-realistic target is the embedded model in F32
FTYPES = {"Q4_0": L.LLAMA_FTYPE_MOSTLY_Q4_0, "Q8_0": L.LLAMA_FTYPE_MOSTLY_Q8_0,
          "IQ4_NL": L.LLAMA_FTYPE_MOSTLY_IQ4_NL, "F32": L.LLAMA_FTYPE_ALL_F32, "F16": L.LLAMA_FTYPE_MOSTLY_F16}
_silent = L.llama_log_callback(lambda level, text, user: None)


def requantize(src: Path, dest: Path, quant: str, threads: int = 2) -> Path:
    if quant not in FTYPES:
        raise PackageError(f"cannot requantize to {quant}; choose one of {', '.join(FTYPES)}")
    params = L.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize, params.nthread = FTYPES[quant], True, threads
    L.llama_log_set(_silent, None)  # it logs every tensor
    with atomic_file(dest) as tmp:
        if L.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params)) != 0:
            raise PackageError(f"llama.cpp could not requantize {src.name} to {quant}")
    return dest
