"""Completions' `logprobs: N` as OpenAI gives them (issue 28): each `top_logprobs` entry holds the N
most likely tokens and the sampled one, which need not be among them: up to N + 1 entries."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fake_backend import BYTE0, FakeBackend
from fastapi.testclient import TestClient

from common.sampling import Sampled
from mesh.api.app import build_app
from mesh.backend import GenerationRequest
from mesh.observe.metrics import Metrics

COMPLETIONS = "/v1/completions"


class _Unlikely(FakeBackend):
    """Samples its script's tokens, which are never among the top N it reports: as sampling at
    temperature 1 may well do. Its top N are the bytes after "a": "b", "c", ..."""

    @staticmethod
    def _sampled(token: int, req: GenerationRequest) -> Sampled:
        top = tuple((BYTE0 + ord("b") + j, -0.25 - j) for j in range(req.sampling.logprobs))
        return Sampled(token, -3.0, top)


def _logprobs(backend: FakeBackend, n: int, stream: bool = False) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 3, "logprobs": n, "stream": stream}
    with TestClient(build_app(backend, Metrics())) as client:
        if not stream:
            r = client.post(COMPLETIONS, json=body)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["logprobs"]
        with client.stream("POST", COMPLETIONS, json=body) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    parts = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    return {key: [v for p in parts for v in p[key]] for key in ("tokens", "token_logprobs", "top_logprobs")}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("n", [0, 1, 2, 5])
def test_the_sampled_token_is_always_among_the_top(byte_tokenizer, n: int, stream: bool):
    lp = _logprobs(_Unlikely(byte_tokenizer, "XYZ"), n, stream)
    assert lp["tokens"] == ["X", "Y", "Z"]
    assert lp["token_logprobs"] == [-3.0] * 3
    for token, top in zip(lp["tokens"], lp["top_logprobs"], strict=True):
        assert len(top) == n + 1
        assert top[token] == -3.0
        assert list(top)[:n] == [chr(ord("b") + j) for j in range(n)]  # the top N first, most likely first


def test_a_sampled_token_in_the_top_is_there_once(byte_tokenizer):
    # FakeBackend's own top N begin with the sampled token, as greedy sampling's always do
    lp = _logprobs(FakeBackend(byte_tokenizer, "XYZ"), 2)
    for token, top in zip(lp["tokens"], lp["top_logprobs"], strict=True):
        assert len(top) == 2
        assert next(iter(top)) == token
