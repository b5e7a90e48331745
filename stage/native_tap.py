"""The hidden-state tap's eval callback in C, built once per machine with the C compiler that
built llama-cpp-python, and the Python tap (stage/hidden_tap.py) where there is none.

llama.cpp asks the callback about every node of the graph, 631 a decode for 19 layers of
SmolLM2. In Python each question is a ctypes callback and a ctypes call back into ggml,
about 1 µs: 0.6-0.7 ms of a 7 ms stage-0 decode, every decode. In C it is a string compare.
The C tap copies the wanted node into a buffer the engine owns, as the Python one does;
the rows are bit for bit the same (tests/test_native_tap.py).
"""

from __future__ import annotations

import ctypes
import hashlib
import shutil
import subprocess
import sys
from typing import Any

import numpy as np

from config.paths import cache_dir
from packages.integrity import atomic_file
from stage.ggml_lib import ggml
from stage.hidden_tap import HiddenTap

_SOURCE = r"""
#include <stdbool.h>
#include <stddef.h>
#include <string.h>

struct tap {
    const char *(*get_name)(const void *);
    size_t (*nbytes)(const void *);
    void (*tensor_get)(const void *, void *, size_t, size_t);
    const char *name;
    char *dst;
    size_t cap, used;
    int overflow;
};

bool meshpipe_tap_eval(void *t, bool ask, void *user) {
    struct tap *tap = user;
    if (ask) {
        const char *name = tap->get_name(t);
        return name != NULL && strcmp(name, tap->name) == 0;
    }
    size_t n = tap->nbytes(t);
    if (tap->used + n > tap->cap) {
        tap->overflow = 1;
    } else {
        tap->tensor_get(t, tap->dst + tap->used, 0, n);
        tap->used += n;
    }
    return false; /* the rest of the graph (final norm, head) is not this stage's */
}
"""


class _Tap(ctypes.Structure):
    _fields_ = [("get_name", ctypes.c_void_p), ("nbytes", ctypes.c_void_p), ("tensor_get", ctypes.c_void_p),
                ("name", ctypes.c_char_p), ("dst", ctypes.c_void_p), ("cap", ctypes.c_size_t),
                ("used", ctypes.c_size_t), ("overflow", ctypes.c_int)]


class NativeTap:
    """HiddenTap's interface, its callback in C: collects the named tensor of every ubatch of
    a decode of at most `rows` rows; `take()` returns them in batch order."""

    def __init__(self, lib: ctypes.CDLL, tensor: str, width: int, rows: int) -> None:
        self.name = tensor.encode()
        self.width = width
        self.buffer = np.empty(rows * width, dtype=np.float32)
        base = ggml.lib
        self.state = _Tap(_address(base.ggml_get_name), _address(base.ggml_nbytes),
                          _address(base.ggml_backend_tensor_get), self.name, self.buffer.ctypes.data,
                          self.buffer.nbytes, 0, 0)
        self.callback = ctypes.cast(lib.meshpipe_tap_eval, ggml.callback_type)
        self.user = ctypes.cast(ctypes.pointer(self.state), ctypes.c_void_p)

    def clear(self) -> None:
        """Drop what an earlier decode left: one that failed partway never reached `take`."""
        self.state.used, self.state.overflow = 0, 0

    def take(self) -> np.ndarray:
        if self.state.overflow:
            raise RuntimeError("hidden-state tap: a decode gave more rows than the engine's batch")
        rows = self.state.used // (4 * self.width)
        self.state.used = 0
        return self.buffer[: rows * self.width].reshape(rows, self.width).copy()


def open_tap(tensor: str, width: int, rows: int) -> NativeTap | HiddenTap:
    """The C tap where a C compiler is (or was) here, else the Python one."""
    lib = _library()
    return NativeTap(lib, tensor, width, rows) if lib is not None else HiddenTap(tensor, width)


_loaded: list[ctypes.CDLL | None] = []


def _library() -> ctypes.CDLL | None:
    if not _loaded:
        _loaded.append(_build())
    return _loaded[0]


def _build() -> ctypes.CDLL | None:
    """Load the tap's shared library, compiling it into the cache on first use; None, and
    the Python tap, where that cannot be done."""
    try:
        return _compiled()
    except Exception as exc:  # noqa: BLE001 -- no C tap is a reason to use the Python one, never to fail a stage
        print(f"meshpipe: the C hidden-state tap could not be built ({exc}); using the Python one, "
              "about 0.7 ms slower a decode", file=sys.stderr)
        return None


def _compiled() -> ctypes.CDLL | None:
    digest = hashlib.sha256(_SOURCE.encode()).hexdigest()[:16]
    built = cache_dir() / "native" / f"tap-{digest}-{sys.platform}.so"
    if not built.is_file():
        compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
        if compiler is None:
            return None
        with atomic_file(built) as tmp:
            source = tmp.with_suffix(".c")
            source.write_text(_SOURCE)
            try:
                done = subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", str(tmp), str(source)],
                                      capture_output=True, timeout=60)
            finally:
                source.unlink(missing_ok=True)
            if done.returncode != 0:
                raise _CompileError(done.stderr.decode(errors="replace")[-500:])
    return ctypes.CDLL(str(built))


class _CompileError(RuntimeError):
    pass


def _address(fn: Any) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value or 0

