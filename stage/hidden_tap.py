"""Capture a layer's residual output from inside llama.cpp and stop the graph there.

llama.cpp calls `cb_eval` for every graph node, first asking whether we want it. We say
yes only for `l_out-{last}`, copy it out when it is computed, and answer False, which
makes the scheduler skip the rest of the graph (final norm and lm_head). The KV cache
has been written by then, so the decode counts. DESIGN.md §3 step 3.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np
from llama_cpp import llama_cpp as L

_ggml = ctypes.CDLL(os.path.join(os.path.dirname(L.__file__), "lib", "libggml-base.so"))
_ggml.ggml_get_name.restype = ctypes.c_char_p
_ggml.ggml_get_name.argtypes = [ctypes.c_void_p]
_ggml.ggml_nbytes.restype = ctypes.c_size_t
_ggml.ggml_nbytes.argtypes = [ctypes.c_void_p]
_ggml.ggml_backend_tensor_get.restype = None
_ggml.ggml_backend_tensor_get.argtypes = [
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t
]


class HiddenTap:
    """Collects the named tensor once per ubatch; `take()` returns the rows in batch order."""

    def __init__(self, last_layer: int, width: int) -> None:
        self.name = f"l_out-{last_layer}".encode()
        self.width = width
        self.chunks: list[np.ndarray] = []
        get_name = _ggml.ggml_get_name
        name = self.name

        def on_eval(tensor: int, ask: bool, _user: int) -> bool:
            if ask:
                return bool(get_name(tensor) == name)
            self._copy(tensor)
            return False

        # Keep a reference: llama.cpp holds only the raw function pointer.
        self.callback = L.ggml_backend_sched_eval_callback(on_eval)

    def _copy(self, tensor: int) -> None:
        nbytes = _ggml.ggml_nbytes(tensor)
        out = np.empty(nbytes // 4, dtype=np.float32)
        _ggml.ggml_backend_tensor_get(tensor, out.ctypes.data, 0, nbytes)
        self.chunks.append(out.reshape(-1, self.width))

    def take(self) -> np.ndarray:
        rows = self.chunks[0] if len(self.chunks) == 1 else np.concatenate(self.chunks)
        self.chunks = []
        return rows
