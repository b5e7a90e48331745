"""The ggml functions the project calls directly, bound once from llama-cpp-python's libraries.

Reading graph nodes from an eval callback (the hidden-state tap, the numerics bench) and
asking the CPU backend which extra buffer types it would use (stage.llama_model).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
from llama_cpp import llama_cpp as L

_LIB = Path(L.__file__).parent / "lib"
_P = ctypes.c_void_p


def _bind(lib: ctypes.CDLL, signatures: dict[str, tuple[object, list[object]]]) -> ctypes.CDLL:
    for fn, (restype, argtypes) in signatures.items():
        getattr(lib, fn).restype, getattr(lib, fn).argtypes = restype, argtypes
    return lib


class _Ggml:
    callback_type = L.ggml_backend_sched_eval_callback  # cb_eval: (tensor, ask, user) -> bool

    def __init__(self) -> None:
        self.lib = _bind(ctypes.CDLL(str(_LIB / "libggml-base.so")), {
            "ggml_get_name": (ctypes.c_char_p, [_P]),
            "ggml_op_desc": (ctypes.c_char_p, [_P]),
            "ggml_nbytes": (ctypes.c_size_t, [_P]),
            "ggml_type_name": (ctypes.c_char_p, [ctypes.c_int]),
            "ggml_backend_tensor_get": (None, [_P, _P, ctypes.c_size_t, ctypes.c_size_t]),
            "ggml_backend_dev_backend_reg": (_P, [_P]),
            "ggml_backend_reg_get_proc_address": (_P, [_P, ctypes.c_char_p]),
            "ggml_backend_buft_name": (ctypes.c_char_p, [_P]),
        })
        self.registry = _bind(ctypes.CDLL(str(_LIB / "libggml.so")), {
            "ggml_backend_dev_by_type": (_P, [ctypes.c_int]),
        })

    def name(self, tensor: int) -> str:
        return (self.lib.ggml_get_name(tensor) or b"").decode()

    def rows(self, tensor: int, width: int) -> np.ndarray:
        """A computed float32 node's rows, copied out of ggml's buffer (the next decode reuses it)."""
        nbytes = self.lib.ggml_nbytes(tensor)
        out = np.empty(nbytes // 4, dtype=np.float32)
        self.lib.ggml_backend_tensor_get(tensor, out.ctypes.data, 0, nbytes)
        return out.reshape(-1, width)

    def op(self, tensor: int) -> str:
        return (self.lib.ggml_op_desc(tensor) or b"").decode()

    def type_name(self, tensor: int) -> str:
        return (self.lib.ggml_type_name(ctypes.c_int.from_address(tensor).value) or b"").decode()

    def cpu_extra_bufts(self) -> tuple[str, ...]:
        """Names of the extra buffer types the CPU backend would put weights in, in its order."""
        L.llama_backend_init()  # registers the backends
        cpu = self.registry.ggml_backend_dev_by_type(0)  # GGML_BACKEND_DEVICE_TYPE_CPU
        reg = self.lib.ggml_backend_dev_backend_reg(cpu)
        address = self.lib.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts")
        if not address:
            return ()
        bufts = ctypes.CFUNCTYPE(ctypes.POINTER(_P), _P)(address)(cpu)
        names: list[str] = []
        while bufts[len(names)]:
            names.append(self.lib.ggml_backend_buft_name(bufts[len(names)]).decode())
        return tuple(names)


ggml = _Ggml()
