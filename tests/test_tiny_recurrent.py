"""Tiny recurrent and hybrid GGUFs load and decode whole, and stay refused for a split (issue 43).

Groundwork for admitting them: each family in `tiny_models.RECURRENT` is opened by
llama-cpp-python, decoded greedily twice from fresh contexts (a recurrent state that leaked or
was left uninitialized would part the two), and `packages.architectures` still names its
recurrent layers as the reason it may not be split.
"""

from __future__ import annotations

from pathlib import Path

import llama_cpp
import pytest
from chain import reference_greedy
from tiny_models import RECURRENT, write_tiny

from packages import architectures
from packages.architecture_kinds import HYBRID
from packages.architecture_kinds import RECURRENT as RECURRENT_KIND
from stage.llama_model import open_llama

PROMPT = [1, 72, 101, 108, 108, 111, 44, 32]
KIND = dict.fromkeys(RECURRENT, HYBRID) | {"mamba2": RECURRENT_KIND}  # all but mamba2 mix in attention


@pytest.mark.parametrize("arch", sorted(RECURRENT))
def test_loads_and_decodes_the_same_twice(arch: str, tmp_path: Path) -> None:
    gguf = write_tiny(tmp_path / f"{arch}.gguf", arch)
    first = reference_greedy(gguf, PROMPT, 6)  # each call a fresh model and context
    assert len(first) == 6
    vocab = open_llama(gguf, n_ctx=64, vocab_only=True).n_vocab()
    assert all(0 <= tok < vocab for tok in first)
    assert reference_greedy(gguf, PROMPT, 6) == first


@pytest.mark.parametrize("arch", sorted(RECURRENT))
def test_llama_cpp_takes_it_for_what_meshpipe_refuses(arch: str, tmp_path: Path) -> None:
    """The tiny model reaches llama.cpp's recurrent memory, not an attention-only stand-in."""
    llm = open_llama(write_tiny(tmp_path / f"{arch}.gguf", arch), n_ctx=64, n_threads=1)
    model = llm._model.model  # held through llm: the model is freed with it
    assert llama_cpp.llama_model_is_recurrent(model) == (KIND[arch] == RECURRENT_KIND)
    assert llama_cpp.llama_model_is_hybrid(model) == (KIND[arch] == HYBRID)


@pytest.mark.parametrize("arch", sorted(RECURRENT))
def test_is_refused_for_a_split_for_its_recurrent_layers(arch: str) -> None:
    assert architectures.kind_of(arch) == KIND[arch]
    assert "recurrent layers" in (architectures.split_refusal(arch) or "")
    assert architectures.allowed_cuts(arch, 8) == []
