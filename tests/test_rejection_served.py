"""Rejection sampling is exact in distribution end to end: `mesh serve` on 2 stages with a
draft, 20,000 seeded samples of the first 3 tokens at temperature 1 by rejection sampling,
against 20,000 from the same target without speculation (a chi-square test of homogeneity
at p = 0.001). Seeded, so the test is deterministic; the rule is asked for by the request's
extension, since a seeded request is accepted by exact match by default.

The models are tiny: a random target made sure of itself (its head scaled up), and the same
weights less sure as the draft, so drafts are kept often and rejected often. The draft
proposes one token a frame with frames in flight, so the third token is checked by a frame
whose first fed token is a draft (stage/rejection.py `Tail`).
"""

from __future__ import annotations

import collections
import concurrent.futures
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from mesh_server import mesh_serve
from models import write_tiny_llama
from stats import two_samples

pytestmark = pytest.mark.soak  # 40,000 requests: over three minutes

SAMPLES = 20_000
PROMPT = [1, 40, 80, 99]
# bytes 0x80-0xFF and the special tokens out: every token is one ASCII character of the text
BIAS = {str(t): -100 for t in [0, 1, 2, *range(3 + 128, 259)]}
COMMON = ("--local-stages", "2", "--lanes", "8", "--ctx-size", "64")


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("rejection-served")
    return (write_tiny_llama(tmp / "target.gguf", byte_vocab=True, logit_scale=5.0),
            write_tiny_llama(tmp / "draft.gguf", byte_vocab=True, logit_scale=3.0))


def _served(tmp: Path, target: Path, *args: str) -> Iterator[str]:
    (tmp / "cache").mkdir(exist_ok=True)
    with mesh_serve(tmp / "cache", "--model", str(target), *COMMON, *args) as (url, _):
        yield url


@pytest.fixture(scope="module")
def speculative(pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    target, draft = pair
    yield from _served(tmp_path_factory.mktemp("spec"), target, "--draft", str(draft), "--draft-window", "1",
                       "--frames-in-flight", "3")


@pytest.fixture(scope="module")
def plain(pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from _served(tmp_path_factory.mktemp("plain"), pair[0], "--no-draft")


def _samples(url: str, extra: dict, seeds: range) -> tuple[list[str], list[dict]]:
    """The first 3 tokens (as text, one character each) of a completion per seed, and each usage."""
    with httpx.Client(timeout=60) as client:
        model = client.get(f"{url}/v1/models").json()["data"][0]["id"]

        def one(seed: int) -> tuple[str, dict]:
            body = {"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 1.0, "seed": seed,
                    "ignore_eos": True, "logit_bias": BIAS, **extra}
            reply = client.post(f"{url}/v1/completions", json=body)
            assert reply.status_code == 200, reply.text
            out = reply.json()
            return out["choices"][0]["text"], out["usage"]

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            done = list(pool.map(one, seeds))
    assert all(len(text) == 4 for text, _ in done)
    return [text[:3] for text, _ in done], [usage for _, usage in done]


def test_rejection_sampling_through_the_mesh_samples_the_targets_distribution(speculative: str, plain: str) -> None:
    texts, usages = _samples(speculative, {"speculative_acceptance": "rejection"}, range(SAMPLES))
    got = collections.Counter(texts)
    want = collections.Counter(_samples(plain, {}, range(SAMPLES, 2 * SAMPLES))[0])
    spec = [u["speculative"] for u in usages]
    assert {s["acceptance"] for s in spec} == {"rejection"}
    accepted, proposed = sum(s["accepted"] for s in spec), sum(s["proposed"] for s in spec)
    assert 0.3 < accepted / proposed < 0.97, "drafts must be both kept and rejected often"
    assert len(set(got) | set(want)) > 20, "the first 3 tokens must spread over many outcomes"
    assert two_samples(got, want) > 0.001


def test_a_seeded_request_keeps_exact_match_and_equals_no_draft(speculative: str, plain: str) -> None:
    got, usages = _samples(speculative, {}, range(40))
    assert {u["speculative"]["acceptance"] for u in usages} == {"exact"}
    assert got == _samples(plain, {}, range(40))[0]
