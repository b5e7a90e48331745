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


class _Ggml:
    """The few ggml-base functions an eval callback needs to read a graph node."""

    callback_type = L.ggml_backend_sched_eval_callback

    def __init__(self) -> None:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(L.__file__), "lib", "libggml-base.so"))
        for fn, restype, argtypes in [
            ("ggml_get_name", ctypes.c_char_p, [ctypes.c_void_p]),
            ("ggml_op_desc", ctypes.c_char_p, [ctypes.c_void_p]),
            ("ggml_nbytes", ctypes.c_size_t, [ctypes.c_void_p]),
            ("ggml_type_name", ctypes.c_char_p, [ctypes.c_int]),
            ("ggml_backend_tensor_get", None, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]),
        ]:
            getattr(lib, fn).restype, getattr(lib, fn).argtypes = restype, argtypes
        self.lib = lib

    def name(self, tensor: int) -> str:
        return (self.lib.ggml_get_name(tensor) or b"").decode()

    def op(self, tensor: int) -> str:
        return (self.lib.ggml_op_desc(tensor) or b"").decode()

    def type_name(self, tensor: int) -> str:
        return (self.lib.ggml_type_name(ctypes.c_int.from_address(tensor).value) or b"").decode()


ggml = _Ggml()


class HiddenTap:
    """Collects the named tensor once per ubatch; `take()` returns the rows in batch order."""

    def __init__(self, last_layer: int, width: int) -> None:
        self.name = f"l_out-{last_layer}".encode()
        self.width = width
        self.chunks: list[np.ndarray] = []
        get_name = ggml.lib.ggml_get_name
        name = self.name

        def on_eval(tensor: int, ask: bool, _user: int) -> bool:
            if ask:
                return bool(get_name(tensor) == name)
            self._copy(tensor)
            return False

        # Keep a reference: llama.cpp holds only the raw function pointer.
        self.callback = ggml.callback_type(on_eval)

    def _copy(self, tensor: int) -> None:
        nbytes = ggml.lib.ggml_nbytes(tensor)
        out = np.empty(nbytes // 4, dtype=np.float32)
        ggml.lib.ggml_backend_tensor_get(tensor, out.ctypes.data, 0, nbytes)
        self.chunks.append(out.reshape(-1, self.width))

    def take(self) -> np.ndarray:
        rows = self.chunks[0] if len(self.chunks) == 1 else np.concatenate(self.chunks)
        self.chunks = []
        return rows
