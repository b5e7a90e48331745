"""Rejection sampling through stage 0's request path, in-process (tests/inproc_requests.py):
frames in flight, a draft that is another model, and every committed token checked against
the target by teacher forcing. With top-k 2 any token outside the target's best two at its
position (a draft committed unchecked, a verdict read off the wrong row) is caught at once."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import numpy as np
import pytest
from inproc_requests import serving
from models import write_tiny_llama

from common.sampling import EXACT, REJECTION, Sampled, SamplingParams
from mesh.backend import GenerationRequest
from stage.engine import EngineConfig, Step
from stage.llama_engine import LlamaRangeEngine

# the rejection rule in the loop, not what a request's ledger allows (tests/test_ledger.py)
pytestmark = pytest.mark.usefixtures("unbounded_ledger")

PROMPTS = [[1, 5, 9, 13], [1, 40, 2, 7, 7], [1, 63, 3]]
TOKENS = 24


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("rejection-loop")
    # the same model, less sure of itself: it agrees often, not always
    return (write_tiny_llama(tmp / "target.gguf", logit_scale=4.0),
            write_tiny_llama(tmp / "draft.gguf", logit_scale=2.0))


async def _generate(served, req: GenerationRequest) -> tuple[list[Sampled], object]:
    gen = served.requests.generate(req)
    async with contextlib.aclosing(gen) as events:
        sampled = [e async for e in events if isinstance(e, Sampled)]
    return sampled, gen.account


def test_every_token_is_one_the_target_allows_with_frames_in_flight(pair, tmp_path: Path) -> None:
    target, draft = pair
    params = SamplingParams(temperature=1.0, top_k=2, seed=5, logprobs=1, acceptance=REJECTION)

    async def scenario() -> list[tuple[list[Sampled], object]]:
        async with serving(target, tmp_path, draft=True, prefix_cache=True, draft_gguf=draft, in_flight=3) as served:
            return [await _generate(served, GenerationRequest(p, TOKENS, params, ignore_eos=True)) for p in PROMPTS]

    results = asyncio.run(scenario())
    engine = LlamaRangeEngine(target, EngineConfig(first=True, final=True, lanes=1, ctx_per_lane=128))
    try:
        for prompt, (sampled, account) in zip(PROMPTS, results, strict=True):
            tokens = [s.token for s in sampled]
            assert len(tokens) == TOKENS
            logits = engine.step([Step(0, 0, tokens=np.asarray([*prompt, *tokens], dtype=np.int32),
                                       all_logits=True)])[0]
            for i, token in enumerate(tokens):
                row = logits[len(prompt) - 1 + i].astype(np.float64)
                best_two = np.argsort(-row, kind="stable")[:2]
                assert token in best_two, f"token {i} of {prompt}: {token} is not among the target's {best_two}"
                # logprobs are the target's at the token's own position, as plain decoding's
                logprob = row[token] - row.max() - np.log(np.exp(row - row.max()).sum())
                assert sampled[i].logprob == pytest.approx(logprob, abs=1e-4)
            assert account.rule == REJECTION  # type: ignore[attr-defined]
    finally:
        engine.close()
    spec = [account.speculative for _, account in results]  # type: ignore[attr-defined]
    proposed, accepted = sum(s.proposed for s in spec), sum(s.accepted for s in spec)
    assert 0 < accepted < proposed, "both verdicts must occur"


def test_a_seeded_exact_request_is_unchanged_by_the_rule_of_others(pair, tmp_path: Path) -> None:
    """EXACT keeps its promise beside REJECTION requests on the same lanes: the no-draft output."""
    target, draft = pair
    exact = SamplingParams(temperature=0.9, seed=3, acceptance=EXACT)
    rejection = SamplingParams(temperature=0.9, seed=3, acceptance=REJECTION)

    async def scenario(with_draft: bool) -> list[list[int]]:
        async with serving(target, tmp_path, draft=with_draft, prefix_cache=True, draft_gguf=draft,
                           in_flight=3) as served:
            out = []
            for p in PROMPTS:
                if with_draft:
                    await _generate(served, GenerationRequest(p, 8, rejection, ignore_eos=True))
                sampled = (await _generate(served, GenerationRequest(p, TOKENS, exact, ignore_eos=True)))[0]
                out.append([s.token for s in sampled])
            return out

    assert asyncio.run(scenario(True)) == asyncio.run(scenario(False))
