"""A GGUF's scalar metadata, read by ggml's own parser (the one llama.cpp loads models with).

`gguf.GGUFReader` decodes every entry of every array as it opens a file: for a tokenizer of
49k tokens and 48k merges that is 2-4 s, paid at each `mesh serve` start only to check three
numbers. ggml reads the same header in C, skipping what is not asked for (about 20 ms).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
from pathlib import Path

from packages.errors import PackageError

Scalar = str | int | float | bool

_P = ctypes.c_void_p


class _InitParams(ctypes.Structure):
    _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", _P)]  # struct gguf_init_params, by value


# enum gguf_type -> the getter of that scalar type, and its C result type
_GETTERS: dict[int, tuple[str, type]] = {
    0: ("gguf_get_val_u8", ctypes.c_uint8), 1: ("gguf_get_val_i8", ctypes.c_int8),
    2: ("gguf_get_val_u16", ctypes.c_uint16), 3: ("gguf_get_val_i16", ctypes.c_int16),
    4: ("gguf_get_val_u32", ctypes.c_uint32), 5: ("gguf_get_val_i32", ctypes.c_int32),
    6: ("gguf_get_val_f32", ctypes.c_float), 7: ("gguf_get_val_bool", ctypes.c_bool),
    8: ("gguf_get_val_str", ctypes.c_char_p), 10: ("gguf_get_val_u64", ctypes.c_uint64),
    11: ("gguf_get_val_i64", ctypes.c_int64), 12: ("gguf_get_val_f64", ctypes.c_double),
}


@functools.cache
def _ggml() -> ctypes.CDLL:
    """libggml-base from llama-cpp-python's wheel, found without importing llama_cpp."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        raise PackageError("llama-cpp-python is not installed: it reads GGUF headers")
    lib = ctypes.CDLL(str(Path(spec.submodule_search_locations[0]) / "lib" / "libggml-base.so"))
    lib.gguf_init_from_file.restype, lib.gguf_init_from_file.argtypes = _P, [ctypes.c_char_p, _InitParams]
    lib.gguf_find_key.restype, lib.gguf_find_key.argtypes = ctypes.c_int64, [_P, ctypes.c_char_p]
    lib.gguf_get_kv_type.restype, lib.gguf_get_kv_type.argtypes = ctypes.c_int, [_P, ctypes.c_int64]
    lib.gguf_free.restype, lib.gguf_free.argtypes = None, [_P]
    for name, restype in _GETTERS.values():
        getattr(lib, name).restype, getattr(lib, name).argtypes = restype, [_P, ctypes.c_int64]
    return lib


def read_scalars(path: Path, keys: list[str]) -> dict[str, Scalar]:
    """The values of those `keys` the header holds (an array's key is left out)."""
    if not path.is_file():
        raise PackageError(f"missing file: {path}")
    lib = _ggml()
    ctx = lib.gguf_init_from_file(os.fsencode(path), _InitParams(True, None))
    if not ctx:
        raise PackageError(f"not a valid GGUF file: {path} (ggml could not read its header)")
    try:
        found: dict[str, Scalar] = {}
        for key in keys:
            at = lib.gguf_find_key(ctx, key.encode())
            getter = _GETTERS.get(lib.gguf_get_kv_type(ctx, at)) if at >= 0 else None
            if getter is not None:
                value = getattr(lib, getter[0])(ctx, at)
                found[key] = value.decode() if isinstance(value, bytes) else value
        return found
    finally:
        lib.gguf_free(ctx)
