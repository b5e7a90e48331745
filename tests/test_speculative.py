"""Speculative decoding at stage 0, in-process over the real activation transport.

Stage 0 (with the draft) and a final stage run in one event loop, joined by a loopback
activation link, so every stage's KV position can be read directly.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
from chain import chat_prompt

from mesh.backend import GenerationRequest, GenerationStats
from mesh.draft import Draft, common_prefix
from mesh.pipeline import Pipeline
from mesh.speculative import generate
from mesh.tokenizer import Tokenizer
from mesh.window import Adaptive, CostAware, WindowPolicy, controller_for
from packages.manifest import load_manifest
from packages.materialize import materialize_stage
from packages.requantize import requantize
from stage.activations import ActivationStage
from stage.llama_engine import EngineConfig, LlamaRangeEngine
from stage.sampling import SamplingParams
from stage.transport import connect, serve

CUT = 15
GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def draft_gguf(smollm2_gguf, tmp_path_factory) -> Path:
    return requantize(smollm2_gguf, tmp_path_factory.mktemp("draft") / "smol-q4_0.gguf", "Q4_0")


@contextlib.asynccontextmanager
async def two_stages(package: Path, cache: Path, draft: Path | None
                     ) -> AsyncIterator[tuple[Pipeline, Draft | None, LlamaRangeEngine]]:
    m, sha = load_manifest(package)
    first = LlamaRangeEngine(materialize_stage(package, m, sha, 0, CUT, cache),
                             EngineConfig(first=True, final=False, lanes=4, ctx_per_lane=512))
    last = LlamaRangeEngine(materialize_stage(package, m, sha, CUT, m.layer_count, cache),
                            EngineConfig(first=False, final=True, lanes=4, ctx_per_lane=512))
    stage = ActivationStage(last, 1, 0, None)
    stage.start()
    server = await serve("127.0.0.1", 0, stage.handle_upstream, token="t")
    link = await connect("127.0.0.1", server.sockets[0].getsockname()[1], token="t")
    pipeline = Pipeline(first, link)
    pipeline.start()
    d = Draft(draft, lanes=4, ctx_per_lane=512, threads=2) if draft else None
    if d:
        d.start()
    try:
        yield pipeline, d, last
    finally:
        if d:
            await d.stop()
        await pipeline.stop()
        await stage.stop()
        server.close()
        for e in (first, last):
            e.close()


async def _run(pipeline, draft, prompt, n, sampling=GREEDY, window=None, session=1):
    stats = GenerationStats()
    req = GenerationRequest(prompt, n, sampling, ignore_eos=True)
    out = [t async for t in generate(pipeline, session, req, stats, 512, draft, window)]
    return out, stats


def test_speculative_greedy_equals_plain_and_every_stage_rolls_back(smollm2_package, smollm2_gguf,
                                                                  stage_cache, draft_gguf):
    prompt = chat_prompt(smollm2_gguf, "Tell me a story about a brave mouse.")

    async def scenario():
        async with two_stages(smollm2_package, stage_cache, draft_gguf) as (pipeline, draft, _):
            plain, _ = await _run(pipeline, None, prompt, 64)
            await pipeline.end(1)
            spec, stats = await _run(pipeline, draft, prompt, 64, window=controller_for(WindowPolicy("fixed", 6, 1, 6)))
            assert spec == plain
            s = stats.speculative
            assert s["proposed"] > s["accepted"] > 0, "the Q4_0 draft must be both right and wrong sometimes"

    asyncio.run(scenario())


def test_every_stage_kv_equals_accepted_position_after_rejection(smollm2_package, smollm2_gguf, stage_cache,
                                                                 draft_gguf):
    """A draft that is always wrong: each window rejects at once, and both stages trim."""
    prompt = chat_prompt(smollm2_gguf, "List three colours.")

    class WrongDraft(Draft):
        async def propose(self, lane, sequence, k):
            return [(t + 1) % 1000 for t in await super().propose(lane, sequence, k)]

    async def scenario():
        async with two_stages(smollm2_package, stage_cache, None) as (pipeline, _, final):
            draft = WrongDraft(draft_gguf, lanes=4, ctx_per_lane=512, threads=2)
            draft.start()
            try:
                stats = GenerationStats()
                req = GenerationRequest(prompt, 40, SamplingParams(), ignore_eos=True)
                tokens = generate(pipeline, 1, req, stats, 512, draft, controller_for(WindowPolicy("fixed", 4, 1, 4)))
                out = [await anext(tokens) for _ in range(6)]  # 1 from prefill, then 5 windows
                assert stats.speculative["accepted"] == 0 and stats.speculative["windows"] == 5
                lane = pipeline.lanes.lane_for(1)
                accepted = len(prompt) + len(out) - 1  # the KV must keep all but the newest token
                # the fifth window fed 1 + 4 rows through both stages, and none was accepted
                assert pipeline.engine.position(lane) == final.position(lane) == accepted + 4
                assert draft.held[lane][:accepted] == (prompt + out)[:accepted]
                # the next frame starts at the accepted position: every stage drops the rest
                await anext(tokens)
                assert pipeline.engine.position(lane) == final.position(lane) == accepted + 5
                assert draft.held[lane][: accepted + 1] == (prompt + out)[: accepted + 1]
                await tokens.aclose()
            finally:
                await draft.stop()

    asyncio.run(scenario())


def test_draft_equal_to_target_accepts_everything_and_window_reaches_max(smollm2_package, smollm2_gguf,
                                                                       stage_cache):
    prompt = chat_prompt(smollm2_gguf, "Explain gravity in two sentences.")

    async def scenario():
        async with two_stages(smollm2_package, stage_cache, smollm2_gguf) as (pipeline, draft, _):
            window = Adaptive(WindowPolicy("adaptive", 2, 1, 8))
            _, stats = await _run(pipeline, draft, prompt, 96, window=window)
            assert stats.speculative["accept_rate"] == 1.0
            assert window.window == 8

    asyncio.run(scenario())


def test_first_sampled_token_follows_the_target_distribution(smollm2_gguf, draft_gguf):
    """Chi-square over 2000 seeds on one node with the draft on: the sampled distribution
    is the target's. Draws are keyed by position, so every seed must also reproduce the
    plain run's tokens exactly, window after window."""
    prompt = Tokenizer(smollm2_gguf, "t").tokenize("Once upon a time, there was a", special=False)
    temp = 1.0

    async def scenario():
        engine = LlamaRangeEngine(smollm2_gguf, EngineConfig(first=True, final=True, lanes=2, ctx_per_lane=128))
        pipeline, draft = Pipeline(engine, None), Draft(draft_gguf, lanes=2, ctx_per_lane=128, threads=2)
        pipeline.start()
        draft.start()
        try:
            firsts = []
            for seed in range(2000):
                sp = SamplingParams(temperature=temp, seed=seed)
                out, _ = await _run(pipeline, draft, prompt, 1, sp, controller_for(WindowPolicy()), session=seed)
                await pipeline.end(seed)
                firsts.append(out[0])
            for seed in range(30):
                sp = SamplingParams(temperature=temp, seed=seed)
                window = controller_for(WindowPolicy())
                spec, _ = await _run(pipeline, draft, prompt, 8, sp, window, session=5000 + seed)
                await pipeline.end(5000 + seed)
                plain, _ = await _run(pipeline, None, prompt, 8, sp, session=9000 + seed)
                await pipeline.end(9000 + seed)
                assert spec == plain and spec[0] == firsts[seed]
            return firsts
        finally:
            await draft.stop()
            await pipeline.stop()
            engine.close()

    firsts = asyncio.run(scenario())
    _chi_square_fits(np.array(firsts), _target_probs(smollm2_gguf, prompt, temp))


def _target_probs(gguf: Path, prompt: list[int], temp: float) -> np.ndarray:
    engine = LlamaRangeEngine(gguf, EngineConfig(first=True, final=True, lanes=1, ctx_per_lane=256))
    from stage.engine import Step

    logits = engine.step([Step(0, 0, tokens=np.asarray(prompt, dtype=np.int32))])[0][-1].astype(np.float64)
    engine.close()
    z = np.exp((logits - logits.max()) / temp)
    return z / z.sum()


def _chi_square_fits(samples: np.ndarray, probs: np.ndarray) -> None:
    n = len(samples)
    big = np.flatnonzero(probs * n >= 5)  # bins with enough expected mass; the rest pooled
    observed = [np.sum(samples == t) for t in big] + [np.sum(~np.isin(samples, big))]
    expected = [probs[t] * n for t in big] + [n * (1 - probs[big].sum())]
    if expected[-1] < 5:
        observed[-2] += observed.pop()
        expected[-2] += expected.pop()
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected, strict=True))
    dof = len(observed) - 1
    # Wilson-Hilferty: the 0.999 quantile of chi-square(dof); a failure here is a real skew.
    crit = dof * (1 - 2 / (9 * dof) + 3.09 * (2 / (9 * dof)) ** 0.5) ** 3
    assert stat < crit, f"chi-square {stat:.1f} >= {crit:.1f} with {dof} dof"


def test_accepted_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4, 9]) == 2
    assert common_prefix([], [7]) == 0
    assert common_prefix([5], [5, 6]) == 1


def test_adaptive_window_moves_within_bounds():
    w = Adaptive(WindowPolicy("adaptive", 2, 1, 3))
    for accepted, expect in [(2, 3), (3, 3), (0, 2), (0, 1), (0, 1)]:
        w.record(w.next_window(), accepted, 0.0, 0.0)
        assert w.window == expect


def test_cost_aware_turns_off_when_the_draft_costs_as_much_as_the_target():
    w = CostAware(WindowPolicy("cost-aware", 4, 1, 8), probe_every=5)
    windows = []
    for _ in range(200):
        k = w.next_window()
        windows.append(k)
        # draft step as slow as a whole verify pass, half the proposals accepted
        w.record(k, k // 2, draft_s=0.01 * k, verify_s=0.01 + 0.001 * k)
    late = windows[20:]
    assert late.count(0) >= 0.95 * len(late) and 1 in late  # off, with a periodic re-probe
    assert w.probe_every > 5  # each failed probe waits longer for the next


def test_cost_aware_speculates_when_verify_is_slow():
    w = CostAware(WindowPolicy("cost-aware", 4, 1, 8))
    for _ in range(20):
        k = w.next_window()
        w.record(k, int(k * 0.8), draft_s=0.001 * k, verify_s=0.05 + 0.001 * k)  # a 20 ms-each-way hop
    assert w.next_window() >= 4
