"""Capture a layer's residual output from inside llama.cpp and stop the graph there.

llama.cpp calls `cb_eval` for every graph node, first asking whether we want it. We say
yes only for `l_out-{last}` (or the family's name for it), copy it out when it is computed, and answer False, which
makes the scheduler skip the rest of the graph (final norm and lm_head). The KV cache
has been written by then, so the decode counts. DESIGN.md §3 step 3.
"""

from __future__ import annotations

import ctypes

import numpy as np

from stage.ggml_lib import ggml


class HiddenTap:
    """Collects the named tensor once per ubatch; `take()` returns the rows in batch order."""

    def __init__(self, tensor: str, width: int) -> None:
        self.name = tensor.encode()  # the stage's last layer output (packages.architectures.tap_name)
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
        self.user: ctypes.c_void_p | None = None  # the callback's user data: none, it is a closure

    def _copy(self, tensor: int) -> None:
        self.chunks.append(ggml.rows(tensor, self.width))

    def clear(self) -> None:
        """Drop what an earlier decode left: one that failed partway never reached `take`."""
        self.chunks = []

    def take(self) -> np.ndarray:
        rows = self.chunks[0] if len(self.chunks) == 1 else np.concatenate(self.chunks)
        self.chunks = []
        return rows
