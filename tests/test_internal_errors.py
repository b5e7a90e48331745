"""An internal error is never the client's problem, and never the next request's (issue 39).

`Requests` in-process over a real pipeline on the tiny random model (stage 0 final, no
link) with a real draft: a proposer that raises once fails its request with an error that
names the request id, counts it by cause, and empties the lane in the prefix cache and the
draft before the lane serves again. A run of them makes /health say so; a good request
clears it. The HTTP layer answers such a failure 500 with the id and counts it in /metrics.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import httpx
import pytest
from fake_backend import FakeBackend
from fastapi.testclient import TestClient
from inproc_requests import Served, serving

from mesh.api.app import build_app
from mesh.backend import GenerationRequest
from mesh.observe.metrics import Metrics
from mesh.reports.failures import FAILING_STREAK, InternalError
from mesh.serving.requests import Requests
from mesh.speculative.proposer import Budget, Proposal, Proposer

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


class Faulty:
    """A proposer, but its next `fail` proposals raise: a bug in a proposer, as issue 39's was."""

    def __init__(self, inner: Proposer) -> None:
        self.inner, self.fail = inner, 0
        self.names = inner.names
        self.forgotten: list[int] = []

    async def proposal(self, lane: int, sequence: list[int], budget: Budget, guide: object = None,
                       sampling: object = None) -> Proposal:
        if self.fail:
            self.fail -= 1
            raise RuntimeError("a proposer's bug")
        return await self.inner.proposal(lane, sequence, budget)

    def forget(self, lane: int) -> None:
        self.forgotten.append(lane)
        self.inner.forget(lane)


def _faulty(served: Served) -> Faulty:
    assert isinstance(served.requests.speculation.proposer, Faulty)
    return served.requests.speculation.proposer


async def _run(requests: Requests, rid: str, tokens: int = 6) -> list[int]:
    req = GenerationRequest(PROMPT, tokens, request_id=rid, ignore_eos=True)
    return [s.token async for s in requests.generate(req) if hasattr(s, "token")]


@pytest.fixture
def served(tiny_gguf: Path, tmp_path: Path) -> Callable[[], AbstractAsyncContextManager[Served]]:
    return lambda: serving(tiny_gguf, tmp_path, draft=True, prefix_cache=True, wrap=Faulty)


def test_a_request_that_raised_fails_by_id_and_leaves_its_lane_empty_everywhere(served):
    async def scenario() -> None:
        async with served() as served_:
            requests, pipeline, faulty = served_.requests, served_.pipeline, _faulty(served_)
            good = await _run(requests, "cmpl-good")
            lane = next(iter(pipeline.cache.held))
            assert pipeline.cache.match(lane, [*PROMPT, 0]) == len(PROMPT)  # a good request's lane keeps its tokens
            faulty.fail = 1
            with pytest.raises(InternalError, match=r"request cmpl-bad\b.*RuntimeError: a proposer's bug") as caught:
                await _run(requests, "cmpl-bad")
            assert caught.value.cause == "RuntimeError"
            bad_lane = faulty.forgotten[-1]
            assert pipeline.cache.held[bad_lane] == ()  # the prefix cache offers nothing of it
            assert served_.draft is not None
            assert served_.draft.held[bad_lane] == []
            assert served_.draft.base[bad_lane] == 0
            assert requests.failures.by_cause == {"RuntimeError": 1}
            assert await _run(requests, "cmpl-again") == good  # the lane serves again, as before

    asyncio.run(scenario())


def test_a_run_of_internal_errors_is_failing_until_a_request_succeeds(served):
    async def scenario() -> None:
        async with served() as served_:
            requests, faulty = served_.requests, _faulty(served_)
            for n in range(FAILING_STREAK):
                assert requests.failures.failing() is None
                faulty.fail = 1
                with pytest.raises(InternalError):
                    await _run(requests, f"cmpl-{n}")
            why = requests.failures.failing()
            assert why is not None
            assert f"the last {FAILING_STREAK} generations failed" in why
            assert f"cmpl-{FAILING_STREAK - 1}" in why
            assert requests.failures.last_line == f"request cmpl-{FAILING_STREAK - 1}: RuntimeError: a proposer's bug"
            await _run(requests, "cmpl-ok")
            assert requests.failures.failing() is None
            assert requests.failures.count == FAILING_STREAK  # the count since start stays

    asyncio.run(scenario())


def test_the_api_answers_an_internal_error_500_with_the_request_id_and_counts_its_cause(byte_tokenizer):
    backend = FakeBackend(byte_tokenizer, fail=lambda: KeyError("lost"), fail_after=2)
    metrics = Metrics()
    with TestClient(build_app(backend, metrics)) as client:
        for stream in (False, True):
            r = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "stream": stream})
            body = r.text
            assert "internal error (request cmpl-" in body
            assert "KeyError" in body
            assert r.status_code == (200 if stream else 500)  # a stream's error is an event after its 200
        assert 'meshpipe_internal_errors_total{cause="KeyError"} 2.0' in client.get("/metrics").text
    assert [req.request_id.startswith("cmpl-") for req in backend.requests] == [True, True]


def test_health_and_metrics_count_the_same_internal_errors(served, byte_tokenizer):
    """One record for both (issue 53): the mesh's internal error, counted where it happened,
    is not counted again by the API, and one the API meets outside the mesh reaches /health."""

    async def scenario() -> None:
        async with served() as served_:
            requests, metrics = served_.requests, Metrics()
            metrics.watch_failures(requests.failures)  # as `mesh serve` does
            mesh = FakeBackend(byte_tokenizer)
            mesh.generate = requests.generate  # type: ignore[method-assign]
            buggy = FakeBackend(byte_tokenizer, fail=lambda: KeyError("lost"))
            _faulty(served_).fail = 1
            for backend in (mesh, buggy):
                transport = httpx.ASGITransport(app=build_app(backend, metrics))
                async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
                    r = await client.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT})
                    assert r.status_code == 500, r.text
            rendered = metrics.render().decode()
            assert 'meshpipe_internal_errors_total{cause="RuntimeError"} 1.0' in rendered
            assert 'meshpipe_internal_errors_total{cause="KeyError"} 1.0' in rendered
            assert requests.failures.count == 2  # what /health reports as internal_errors
            assert requests.failures.last is not None
            assert requests.failures.last.cause == "KeyError"

    asyncio.run(scenario())
