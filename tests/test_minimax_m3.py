"""minimax-m3 serves on one node: its window's rows are not its single rows (issue 54).

MiniMax sparse attention (minimax-m3.cpp) takes a batch of rows through a block mask and one row
through a gather of the chosen blocks. The two differ, so a verified window is not what plain
decoding gives, and speculation would not be lossless whatever the cut (ONE_NODE's reason).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from chain import reference_greedy
from tiny_models import write_tiny

from packages import architectures
from packages.requantize import requantize
from stage.llama_model import open_llama

PROMPT = [1, *range(40, 60), 7, 7, 9]
ROWS = [50, 60, 70, 80]


def _logits(gguf: Path, window: bool) -> np.ndarray:
    llm = open_llama(gguf, n_ctx=256, n_threads=2, logits_all=True)
    llm.reset()
    llm.eval(PROMPT)
    for rows in [ROWS] if window else [[t] for t in ROWS]:
        llm.eval(rows)
    return np.array(llm.scores[len(PROMPT):len(PROMPT) + len(ROWS)])


def test_a_window_is_not_its_single_rows(tmp_path: Path) -> None:
    gguf = requantize(write_tiny(tmp_path / "m.gguf", "minimax-m3"), tmp_path / "q4_0.gguf", "Q4_0")
    assert not np.array_equal(_logits(gguf, True), _logits(gguf, False))
    assert "minimax-m3" not in architectures.RULES
    assert "gather path" in (architectures.split_refusal("minimax-m3") or "")
    assert len(reference_greedy(gguf, PROMPT, 4)) == 4  # it decodes, on one node
