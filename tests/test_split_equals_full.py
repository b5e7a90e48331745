"""Split output is token-identical to the unsplit model run by llama-cpp-python."""

from __future__ import annotations

import pytest
from chain import build_chain, chat_prompt, close, greedy, reference_greedy

from packages.errors import PackageError
from packages.manifest import load_manifest
from packages.materialize import materialize_stage

pytestmark = pytest.mark.mesh

N_TOKENS = 64


@pytest.fixture(scope="module")
def smol_reference(smollm2_gguf):
    prompt = chat_prompt(smollm2_gguf, "Tell me a short story about a dragon.")
    return prompt, reference_greedy(smollm2_gguf, prompt, N_TOKENS)


@pytest.mark.parametrize("cuts", [[15], [3], [29], [7, 20], [1, 28], [10, 11]])
def test_smollm2_split_matches_unsplit(smollm2_package, stage_cache, smol_reference, cuts):
    _assert_split_matches(smollm2_package, stage_cache, smol_reference, cuts)


def _assert_split_matches(package, cache, reference, cuts):
    prompt, expected = reference
    engines = build_chain(package, cuts, cache)
    try:
        assert greedy(engines, prompt, N_TOKENS) == expected
    finally:
        close(engines)


@pytest.fixture(scope="module")
def gemma_reference(gemma3_gguf):
    prompt = chat_prompt(gemma3_gguf, "Name three colours of the rainbow.")
    return prompt, reference_greedy(gemma3_gguf, prompt, N_TOKENS)


# Gemma-3 takes sliding-window layers from the index; the package writes them per layer,
# so every cut keeps them (a cut at 9 diverged before it did).
@pytest.mark.parametrize("cuts", [[6], [9], [12], [6, 12], [3, 13]])
def test_gemma3_split_matches_unsplit(gemma3_package, stage_cache, gemma_reference, cuts):
    _assert_split_matches(gemma3_package, stage_cache, gemma_reference, cuts)


# layers 5, 11 and 17 are global: a stage may not start with one (llama.cpp asserts a model
# with sliding windows has one in every stage's memory)
@pytest.mark.parametrize(("start", "end"), [(0, 11), (11, 18), (3, 5)])
def test_gemma3_disallowed_cut_is_refused(gemma3_package, stage_cache, start, end):
    manifest, sha = load_manifest(gemma3_package)
    with pytest.raises(PackageError, match="not allowed"):
        materialize_stage(gemma3_package, manifest, sha, start, end, stage_cache)
