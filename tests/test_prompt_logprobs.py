"""Prompt logprobs (issue 53 item 5): /v1/completions with `echo` and `logprobs` scores the
prompt's own tokens, `max_tokens: 0` generates nothing. Here without a model: the toy engine
over a real loopback link (each chunk of a long prompt answered by the final stage), and the
API's shape on the fake backend. The real model, split against llama.cpp, and lm-eval:
tests/test_prompt_logprobs_served.py."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import pytest
from fake_backend import BYTE0, EOS, FakeBackend, byte_tokens
from fastapi.testclient import TestClient
from test_stage_core import two_stages
from toy_engine import ToyEngine

import stage.core
from common.ids import LaneId, SessionId
from common.sampling import Sampled, SamplingParams
from mesh.api.app import build_app
from mesh.backend import Generation, GenerationEvent, GenerationRequest, PromptLogprobs
from mesh.observe.metrics import Metrics
from mesh.serving.generate import generate
from mesh.serving.pipeline import Pipeline, PipelineOptions, StageFailedError
from mesh.serving.request_state import Live, Outgoing, RequestState
from stage.frames import FrameSampling

COMPLETIONS = "/v1/completions"
PROMPT = [3, 4, 9, 10, 11, 20, 5, 6, 7]  # 9 rows: three chunks of 4, 4 and 1 with chunk=4
MISS = -math.log(math.exp(10.0) + ToyEngine.n_vocab - 1)  # the toy's logits: 10 for its next token, else 0
HIT = 10.0 + MISS


def _expected(prompt: list[int]) -> list[float]:
    """The toy engine predicts each token + 1 with logit 10, every other token 0."""
    return [HIT if b == a + 1 else MISS for a, b in itertools.pairwise(prompt)]


@contextlib.asynccontextmanager
async def _one_stage() -> AsyncIterator[tuple[Pipeline, None]]:
    pipeline = Pipeline(ToyEngine(first=True, final=True), None, options=PipelineOptions(chunk=4))
    pipeline.start()
    try:
        yield pipeline, None
    finally:
        await pipeline.stop()


async def _run(pipeline: Pipeline, req: GenerationRequest) -> tuple[list[Sampled | PromptLogprobs], Live]:
    live = Live(RequestState(req))
    lease = pipeline.lease(SessionId(1), req.prompt)
    events = [e async for e in generate(pipeline, lease, live, 64)]
    await pipeline.end(lease.session, live.state.tokens[: live.state.computed])
    return events, live


@pytest.mark.parametrize("stages", [1, 2])
@pytest.mark.parametrize("max_tokens", [0, 2])
def test_the_prompt_is_scored_chunk_by_chunk_then_the_tokens_follow(stages: int, max_tokens: int):
    async def scenario() -> None:
        setup = _one_stage() if stages == 1 else two_stages(chunk=4)
        async with setup as (pipeline, _):
            req = GenerationRequest(PROMPT, max_tokens, SamplingParams(logprobs=1), prompt_logprobs=True)
            events, live = await _run(pipeline, req)
            scored, *tokens = events
            assert isinstance(scored, PromptLogprobs)
            assert [s.token for s in scored.scores] == PROMPT[1:]
            assert [s.logprob for s in scored.scores] == pytest.approx(_expected(PROMPT), abs=1e-12)
            # the top one is the toy's next token, whatever the prompt says
            assert [s.top[0][0] for s in scored.scores] == [(t + 1) % ToyEngine.n_vocab for t in PROMPT[:-1]]
            assert [t.token for t in tokens if isinstance(t, Sampled)] == [8, 9][:max_tokens]
            assert live.state.finish == "length"
            assert live.state.account().completion_tokens == max_tokens

    asyncio.run(scenario())


def test_a_cached_prefix_is_fed_again_when_the_prompt_is_scored():
    async def scenario() -> None:
        async with two_stages(chunk=4) as (pipeline, _):
            plain = GenerationRequest(PROMPT, 1, SamplingParams())
            await _run(pipeline, plain)
            assert pipeline.lease(SessionId(5), PROMPT).cached > 0  # the lane holds the prompt now
            await pipeline.end(SessionId(5))
            req = GenerationRequest(PROMPT, 0, SamplingParams(logprobs=0), prompt_logprobs=True)
            events, live = await _run(pipeline, req)
            assert isinstance(events[0], PromptLogprobs)
            assert [s.logprob for s in events[0].scores] == pytest.approx(_expected(PROMPT), abs=1e-12)
            assert live.state.account().cached_tokens == 0

    asyncio.run(scenario())


def test_a_stage_refuses_targets_it_cannot_score():
    frame = FrameSampling(SamplingParams(), targets=(1, 2))
    assert "ask for them" in (frame.problem(32, 64, 3) or "")
    asks = FrameSampling(SamplingParams(logprobs=0), targets=(1, 2))
    assert asks.problem(32, 64, 3) is None
    assert "2 scored rows in a frame of 1" in (asks.problem(32, 64, 1) or "")
    assert "outside the vocabulary" in (FrameSampling(SamplingParams(logprobs=0), targets=(40,)).problem(32, 64, 2)
                                        or "")


def test_a_reply_whose_scored_rows_are_not_the_prompt_fails_the_request(monkeypatch: pytest.MonkeyPatch):
    def wrong(logits: Any, targets: Any, params: SamplingParams) -> list[Sampled]:
        return [Sampled(t + 1, -1.0, ()) for t in targets]

    async def scenario() -> None:
        async with two_stages(chunk=4) as (pipeline, _):
            lane = pipeline.open(SessionId(1))
            pending = await pipeline.score(SessionId(1), LaneId(lane), Outgoing(0, PROMPT, SamplingParams(logprobs=0)))
            assert pending.scored == len(PROMPT) - 1
            assert len(pending.earlier) == 2  # chunks of 4, 4 and 1: each answered
            with pytest.raises(StageFailedError, match="scored rows"):
                await pipeline.wait(pending)

    monkeypatch.setattr(stage.core, "score_rows", wrong)
    asyncio.run(scenario())


class _Scoring(FakeBackend):
    """The fake backend, scoring each prompt token -1.5 with itself as the one alternative."""

    def generate(self, req: GenerationRequest) -> Generation:
        inner = super().generate(req)

        async def events() -> AsyncGenerator[GenerationEvent, None]:
            if req.prompt_logprobs:
                yield PromptLogprobs(tuple(Sampled(t, -1.5, ((t, -1.5),)) for t in req.prompt[1:]))
            async for event in inner:
                yield event

        return Generation(events(), lambda: inner.account)


def _post(body: dict[str, Any], backend: FakeBackend) -> Any:
    with TestClient(build_app(backend, Metrics())) as client:
        r = client.post(COMPLETIONS, json={"model": "tiny", **body})
        if not body.get("stream"):
            return r.status_code, r.json()
        return r.status_code, [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def test_echo_with_logprobs_and_no_tokens_is_the_legacy_scoring_shape(byte_tokenizer):
    status, body = _post({"prompt": byte_tokens("abc"), "echo": True, "logprobs": 1, "max_tokens": 0},
                         _Scoring(byte_tokenizer, "XYZ"))
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["text"] == "abc"
    assert choice["finish_reason"] == "length"
    assert choice["logprobs"] == {"tokens": ["a", "b", "c"], "token_logprobs": [None, -1.5, -1.5],
                                  "top_logprobs": [None, {"b": -1.5}, {"c": -1.5}], "text_offset": [0, 1, 2]}
    assert body["usage"]["completion_tokens"] == 0


def test_echo_puts_the_prompt_before_the_completion(byte_tokenizer):
    backend = _Scoring(byte_tokenizer, "XYZ")
    _, body = _post({"prompt": byte_tokens("ab"), "echo": True, "logprobs": 0, "max_tokens": 2}, backend)
    lp = body["choices"][0]["logprobs"]
    assert body["choices"][0]["text"] == "abXY"
    assert lp["tokens"] == ["a", "b", "X", "Y"]
    assert lp["token_logprobs"] == [None, -1.5, -0.5, -0.5]
    assert lp["text_offset"] == [0, 1, 2, 3]
    assert backend.requests[-1].prompt_logprobs
    _, plain = _post({"prompt": "ab", "echo": True, "max_tokens": 2}, backend)
    assert plain["choices"][0]["text"] == "abXY"
    assert plain["choices"][0]["logprobs"] is None
    assert not backend.requests[-1].prompt_logprobs  # echo alone needs no scores


def test_a_stream_echoes_the_prompt_in_its_first_chunk(byte_tokenizer):
    status, chunks = _post({"prompt": byte_tokens("ab"), "echo": True, "logprobs": 0, "max_tokens": 2, "stream": True},
                           _Scoring(byte_tokenizer, "XYZ"))
    assert status == 200
    first = chunks[0]["choices"][0]
    assert first["text"] == "ab"
    assert first["logprobs"]["token_logprobs"] == [None, -1.5]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "abXY"
    offsets = [o for c in chunks if c["choices"][0]["logprobs"] for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == [0, 1, 2, 3]


def test_max_tokens_zero_is_for_completions_only(byte_tokenizer):
    backend = _Scoring(byte_tokenizer, "XYZ")
    status, body = _post({"prompt": "ab", "max_tokens": 0}, backend)
    assert (status, body["choices"][0]["text"], body["choices"][0]["finish_reason"]) == (200, "", "length")
    with TestClient(build_app(backend, Metrics())) as client:
        r = client.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 0,
                                                      "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "max_tokens"


def test_a_prompt_that_fills_the_context_can_be_scored(byte_tokenizer):
    full = [BYTE0 + ord("a")] * FakeBackend.ctx_per_session
    status, _ = _post({"prompt": full, "echo": True, "logprobs": 0, "max_tokens": 0}, _Scoring(byte_tokenizer))
    assert status == 200
    status, _ = _post({"prompt": full, "max_tokens": 1}, _Scoring(byte_tokenizer))
    assert status == 400


def test_the_tokenizer_endpoints_answer_as_vllms_do(byte_tokenizer):
    # lm-eval's `remote` tokenizer backend reads these instead of downloading a tokenizer
    with TestClient(build_app(FakeBackend(byte_tokenizer), Metrics())) as client:
        info = client.get("/tokenizer_info").json()
        assert info["eos_token"] == byte_tokenizer.token_text(EOS).decode()
        plain = client.post("/tokenize", json={"prompt": "ab", "add_special_tokens": False}).json()
        assert plain["tokens"] == byte_tokenizer.tokenize("ab", add_bos=False)
        assert plain["count"] == len(plain["tokens"])
        special = client.post("/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}).json()
        assert special["tokens"] == [EOS]  # a special token's text is its id, as Hugging Face's tokenizers read it
        with_bos = client.post("/tokenize", json={"prompt": "ab"}).json()
        assert with_bos["tokens"][0] == byte_tokenizer.bos
        text = client.post("/detokenize", json={"tokens": byte_tokens("ab")}).json()
        assert text == {"prompt": "ab"}
        r = client.post("/detokenize", json={"tokens": [10**6]})
        assert (r.status_code, r.json()["error"]["param"]) == (400, "tokens")
        r = client.post("/tokenize", json={"prompt": "ab", "model": "other"})
        assert r.status_code == 404
