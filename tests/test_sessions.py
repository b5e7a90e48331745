"""Per-session KV: batched sessions match solo runs; trimming equals never having decoded."""

from __future__ import annotations

import numpy as np
import pytest
from chain import build_chain, chat_prompt, close, forward, greedy

from common.errors import EngineError
from stage.engine import Step

pytestmark = pytest.mark.mesh

PROMPTS = ["Write a haiku about rain.", "List three prime numbers.", "What is the capital of France?"]


@pytest.fixture(scope="module")
def engines(smollm2_package, stage_cache):
    chain = build_chain(smollm2_package, [12], stage_cache, lanes=4)
    yield chain
    close(chain)


def _reset(engines, lanes):
    for e in engines:
        for lane in lanes:
            e.trim(lane, 0)


def test_batched_sessions_match_solo_runs(engines, smollm2_gguf):
    prompts = [chat_prompt(smollm2_gguf, p) for p in PROMPTS]
    solo = []
    for p in prompts:
        _reset(engines, [0])
        solo.append(greedy(engines, p, 24, lane=0))
    _reset(engines, [1, 2, 3])
    seqs = [list(p) for p in prompts]
    starts = [0, 0, 0]
    for _ in range(24):
        batch = [(lane, starts[i], seqs[i][starts[i]:]) for i, lane in enumerate([1, 2, 3])]
        logits = forward(engines, batch)
        for i in range(3):
            starts[i] = len(seqs[i])
            seqs[i].append(int(np.argmax(logits[i][-1])))
    assert [s[len(p):] for s, p in zip(seqs, prompts, strict=True)] == solo


def test_trim_then_redecode_equals_never_decoded(engines, smollm2_gguf):
    prompt = chat_prompt(smollm2_gguf, PROMPTS[0])
    _reset(engines, [0])
    first = greedy(engines, prompt, 20, lane=0)
    # Roll back to 5 generated tokens, as a rejected speculative window would, then go on.
    keep = len(prompt) + 5
    for e in engines:
        e.trim(0, keep)
        assert e.position(0) == keep
    tokens = prompt + first[:5]
    start = keep - 1  # re-feed the last accepted token at its own position
    for e in engines:
        e.trim(0, start)
    again = []
    for _ in range(15):
        logits = forward(engines, [(0, start, tokens[start:])])[0]
        start = len(tokens)
        tokens.append(int(np.argmax(logits[-1])))
        again.append(tokens[-1])
    assert first[5:] == again


def test_authoritative_start_trims_stale_suffix(engines, smollm2_gguf):
    prompt = chat_prompt(smollm2_gguf, PROMPTS[1])
    _reset(engines, [0])
    expected = greedy(engines, prompt, 8, lane=0)
    # A frame that starts inside existing KV drops the suffix first: no repair message.
    out = forward(engines, [(0, len(prompt) - 1, prompt[-1:])])[0]
    assert int(np.argmax(out[-1])) == expected[0]
    assert engines[0].position(0) == len(prompt)


def test_engine_rejects_bad_requests(engines):
    first, last = engines
    with pytest.raises(EngineError, match="lane"):
        first.step([Step(lane=99, start=0, tokens=np.array([1], dtype=np.int32))])
    with pytest.raises(EngineError, match="starts at"):
        first.step([Step(lane=3, start=first.position(3) + 5, tokens=np.array([1], dtype=np.int32))])
    with pytest.raises(EngineError, match="width"):
        last.step([Step(lane=3, start=0, hidden=np.zeros((1, 7), dtype=np.float32))])
    with pytest.raises(EngineError, match="vocabulary"):
        first.step([Step(lane=3, start=0, tokens=np.array([10**7], dtype=np.int32))])


def test_batch_in_any_lane_order_matches_solo(engines, smollm2_gguf):
    prompts = [chat_prompt(smollm2_gguf, p) for p in PROMPTS]
    lanes = [3, 0, 2]  # deliberately not sorted
    solo = []
    for lane, p in zip(lanes, prompts, strict=True):
        _reset(engines, [lane])
        solo.append(forward(engines, [(lane, 0, p)])[0][-1])
        _reset(engines, [lane])
    for lane, p in zip(lanes, prompts, strict=True):
        forward(engines, [(lane, 0, p[:-1])])
    batched = forward(engines, [(lane, len(p) - 1, p[-1:]) for lane, p in zip(lanes, prompts, strict=True)])
    for want, got in zip(solo, batched, strict=True):
        assert np.array_equal(want, got[-1])
