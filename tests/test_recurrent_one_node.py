"""Recurrent families whose graph cannot be cut serve on one node (architectures.ONE_NODE_STATEFUL).

RWKV-6 and RWKV-7 LayerNorm whatever they are fed (the RWKV ln0), and RWKV-7's layers mix in the
first layer's value (v_first): no stage after the first computes what the whole model does. Their
state is llama.cpp's recurrent memory like Mamba's, so it rolls back by checkpoint: on one node,
speculation with a draft of the same weights at another quantization gives the tokens of plain
decoding, greedy and seeded, with frames in flight. Packaged with every cut allowed, a split parts
from the model, which is why they are not split.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from chain import build_chain, close, greedy, reference_greedy
from inproc_requests import served_tokens
from tiny_models import ONE_NODE_RECURRENT, write_tiny

from common.sampling import SamplingParams
from mesh.backend import GenerationRequest
from packages import architectures
from packages.architectures import RULES, CutRule
from packages.manifest import load_manifest
from packages.requantize import requantize
from packages.writer import write_package

FAMILIES = sorted(architectures.ONE_NODE_STATEFUL)
PROMPT = [1, *range(40, 60), 7, 7, 9]
N = 12
REQUESTS = [GenerationRequest(PROMPT, N, SamplingParams(), ignore_eos=True),
            GenerationRequest(PROMPT[:9], N, SamplingParams(temperature=0.9, seed=5), ignore_eos=True)]


def test_every_one_node_recurrent_family_has_a_tiny_model() -> None:
    assert sorted(ONE_NODE_RECURRENT) == FAMILIES == ["arwkv7", "rwkv6", "rwkv7"]


@pytest.mark.parametrize("arch", FAMILIES)
def test_is_packaged_for_one_node_with_its_reason(arch: str, tmp_path: Path) -> None:
    gguf = write_tiny(tmp_path / f"{arch}.gguf", arch)
    manifest, _ = load_manifest(_package(gguf, tmp_path / "pkg"))
    assert manifest.allowed_cuts == ()
    assert architectures.split_refusal(arch) == architectures.ONE_NODE_STATEFUL[arch]
    assert dict(architectures.table())[arch] == f"one node: {architectures.ONE_NODE_STATEFUL[arch]}"
    assert architectures.keeps_state(arch)


@pytest.mark.parametrize("arch", FAMILIES)
def test_speculation_on_one_node_is_lossless(arch: str, tmp_path: Path) -> None:
    gguf = write_tiny(tmp_path / f"{arch}.gguf", arch)
    target = requantize(gguf, tmp_path / "q4_0.gguf", "Q4_0")
    draft = requantize(gguf, tmp_path / "q8_0.gguf", "Q8_0")
    # the draft parts from the target within the answer, so some of its windows are rejected
    assert reference_greedy(draft, PROMPT, N) != reference_greedy(target, PROMPT, N)
    plain = asyncio.run(served_tokens(target, None, tmp_path, REQUESTS))
    assert plain[0] == reference_greedy(target, PROMPT, N)
    assert asyncio.run(served_tokens(target, draft, tmp_path, REQUESTS)) == plain


@pytest.mark.parametrize("arch", FAMILIES)
def test_a_cut_parts_from_the_model(arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Packaged with every cut allowed, each split at 1, 4 or 7 gives other tokens."""
    gguf = write_tiny(tmp_path / f"{arch}.gguf", arch)
    expected = reference_greedy(gguf, PROMPT, N)
    monkeypatch.setitem(RULES, arch, CutRule())
    package = _package(gguf, tmp_path / "pkg")
    for cut in (1, 4, 7):
        engines = build_chain(package, [cut], tmp_path / "cache", lanes=1, ctx=128)
        try:
            assert greedy(engines, PROMPT, N) != expected, f"{arch} cut at {cut}"
        finally:
            close(engines)


def _package(gguf: Path, out: Path) -> Path:
    write_package(gguf, out, progress=lambda _: None)
    return out


