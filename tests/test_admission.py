"""Backpressure: the lanes, the bounded queue before them, the refusal past it (429 with
Retry-After) and the time limit (504), as mesh/serving/admission.py and the API give them."""

from __future__ import annotations

import asyncio
import json

import pytest
from fake_backend import FakeBackend
from fastapi.testclient import TestClient

from mesh.api.app import build_app
from mesh.backend import MeshBusyError, RequestTimeoutError
from mesh.observe.metrics import Metrics
from mesh.serving.admission import Admission

HI = [{"role": "user", "content": "hi"}]


async def _hold(admission: Admission, held: asyncio.Event, release: asyncio.Event) -> None:
    async with admission.lane():
        held.set()
        await release.wait()


def test_past_the_lanes_and_the_queue_a_request_is_refused_at_once():
    async def run() -> None:
        admission, release = Admission(lanes=1, queue=2), asyncio.Event()
        events = [asyncio.Event() for _ in range(3)]
        holders = [asyncio.create_task(_hold(admission, e, release)) for e in events]
        await asyncio.sleep(0.01)
        assert [e.is_set() for e in events] == [True, False, False]  # one generates, two wait
        assert admission.waiting == 2
        with pytest.raises(MeshBusyError) as busy:
            async with admission.lane():
                pass
        assert busy.value.retry_after_s >= 1
        assert "--max-queue" in str(busy.value)
        release.set()
        await asyncio.gather(*holders)
        assert all(e.is_set() for e in events)  # the queued ones were served
        assert (admission.waiting, admission.inside) == (0, 0)
        async with admission.lane():  # and there is room again
            pass

    asyncio.run(run())


def test_no_queue_refuses_as_soon_as_the_lanes_are_full():
    async def run() -> None:
        admission, release, held = Admission(lanes=2, queue=0), asyncio.Event(), asyncio.Event()
        holders = [asyncio.create_task(_hold(admission, held, release)) for _ in range(2)]
        await asyncio.sleep(0.01)
        with pytest.raises(MeshBusyError):
            async with admission.lane():
                pass
        release.set()
        await asyncio.gather(*holders)

    asyncio.run(run())


def test_without_a_limit_any_number_wait():
    async def run() -> None:
        admission, release = Admission(lanes=1, queue=None), asyncio.Event()
        events = [asyncio.Event() for _ in range(20)]
        holders = [asyncio.create_task(_hold(admission, e, release)) for e in events]
        await asyncio.sleep(0.01)
        assert admission.waiting == 19
        release.set()
        await asyncio.gather(*holders)

    asyncio.run(run())


def test_a_wait_past_the_deadline_times_out_and_leaves_the_queue():
    async def run() -> None:
        admission, release, held = Admission(lanes=1, queue=4), asyncio.Event(), asyncio.Event()
        holder = asyncio.create_task(_hold(admission, held, release))
        await held.wait()
        loop = asyncio.get_running_loop()
        with pytest.raises(RequestTimeoutError, match="request-timeout"):
            async with admission.lane(loop.time() + 0.05):
                pass
        assert (admission.waiting, admission.inside) == (0, 1)
        release.set()
        await holder
        async with admission.lane(loop.time() + 0.05):
            pass

    asyncio.run(run())


def test_queue_depth_and_wait_are_in_the_metrics():
    async def run() -> Admission:
        admission, release = Admission(lanes=1, queue=4), asyncio.Event()
        events = [asyncio.Event() for _ in range(3)]
        holders = [asyncio.create_task(_hold(admission, e, release)) for e in events]
        await asyncio.sleep(0.01)
        metrics.watch_admission(admission)
        assert "meshpipe_queue_depth 2.0" in metrics.render().decode()
        await asyncio.sleep(0.2)
        release.set()
        await asyncio.gather(*holders)
        return admission

    metrics = Metrics()
    asyncio.run(run())
    text = metrics.render().decode()
    assert "meshpipe_queue_depth 0.0" in text
    assert "meshpipe_queue_wait_seconds_count 3.0" in text
    assert 'meshpipe_queue_wait_seconds_bucket{le="0.1"} 1.0' in text  # the first did not wait
    assert 'meshpipe_queue_wait_seconds_bucket{le="+Inf"} 3.0' in text
    total = next(float(line.split()[1]) for line in text.splitlines()
                 if line.startswith("meshpipe_queue_wait_seconds_sum"))
    assert total >= 0.4  # two waited at least 0.2 s each


def test_a_busy_server_answers_429_with_retry_after(byte_tokenizer):
    backend = FakeBackend(byte_tokenizer, fail=lambda: MeshBusyError("every lane is busy", 3))
    with TestClient(build_app(backend, Metrics())) as c:
        for stream in (False, True):  # refused before a stream starts: a status a client sees
            r = c.post("/v1/chat/completions", json={"model": "tiny", "messages": HI, "stream": stream})
            assert r.status_code == 429, r.text
            assert r.headers["retry-after"] == "3"
            assert r.json()["error"]["code"] == "rate_limit_exceeded"
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_a_request_past_its_time_fails_clearly(byte_tokenizer):
    backend = FakeBackend(byte_tokenizer, fail=lambda: RequestTimeoutError("ran past its time"), fail_after=3)
    metrics = Metrics()
    with TestClient(build_app(backend, metrics)) as c:
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": "hi"})
        assert r.status_code == 504
        assert r.json()["error"]["code"] == "request_timeout"
        with c.stream("POST", "/v1/completions", json={"model": "tiny", "prompt": "hi", "stream": True}) as s:
            lines = [line for line in s.iter_lines() if line]
    assert json.loads(lines[-2][6:])["error"]["code"] == "request_timeout"  # the error event, then [DONE]
    assert lines[-1] == "data: [DONE]"
    assert 'meshpipe_stream_errors_total{endpoint="completions",status="504"} 1.0' in metrics.render().decode()
    assert backend.closed == 2
