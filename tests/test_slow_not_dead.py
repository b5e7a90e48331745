"""Slow is not dead (issue 53): a frame past its reply deadline breaks the route only when no
stage made progress meanwhile (mesh/serving/reply_deadline.py `ReplyWatch`, mesh/routing/healing.py
`worked`). No model, no process: a toy stage 0 and a final stage on a real link."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import pytest
from fake_backend import FakeBackend
from starlette.testclient import TestClient
from toy_engine import ToyEngine

from common.ids import SessionId
from mesh.api.app import build_app
from mesh.backend import MeshUnavailableError
from mesh.observe.metrics import Metrics
from mesh.routing.healing import worked
from mesh.routing.route import RemoteStage, Route
from mesh.serving.pipeline import Pipeline, PipelineOptions
from mesh.serving.reply_deadline import ReplyDeadline
from mesh.serving.request_state import Outgoing
from proto import meshpipe_pb2 as pb
from stage.frames import reply_frame
from stage.sampling import SamplingParams
from stage.transport import Link, LinkClosedError, connect, serve

DEADLINE_S = 0.3


def replies_after(seconds: float) -> Callable[[Link], Awaitable[None]]:
    """A final stage that answers every frame that asks, `seconds` after it came."""

    async def handler(link: Link) -> None:
        with contextlib.suppress(LinkClosedError):
            while True:
                header, _ = await link.recv()
                if header.want_reply:
                    await asyncio.sleep(seconds)
                    await link.send(reply_frame(header, [], pb.Hop()))

    return handler


async def _one_frame(reply_s: float, progress_every_s: float | None) -> tuple[list[str], Pipeline]:
    """Send one frame to a final stage that answers after `reply_s`, while (if given) the healer
    reports a stage's progress every `progress_every_s`; what broke, and the pipeline."""
    server = await serve("127.0.0.1", 0, replies_after(reply_s), token="t")
    link = await connect("127.0.0.1", server.sockets[0].getsockname()[1], token="t")
    broke: list[str] = []
    pipeline = Pipeline(ToyEngine(first=True, final=False), link, on_break=broke.append,
                        options=PipelineOptions(wire_dtype=pb.F16))
    pipeline.watch.deadline = ReplyDeadline(floor_s=DEADLINE_S, first_s=DEADLINE_S)
    pipeline.start()

    async def pings() -> None:
        while progress_every_s is not None:
            await asyncio.sleep(progress_every_s)
            pipeline.watch.progressed()

    healer = asyncio.ensure_future(pings())
    try:
        session = SessionId(1)
        pending = await pipeline.send(session, pipeline.open(session), Outgoing(0, [3, 4], SamplingParams()))
        with contextlib.suppress(MeshUnavailableError):
            await pipeline.wait(pending)
        return broke, pipeline
    finally:
        healer.cancel()
        await pipeline.stop()
        server.close()


def test_a_frame_past_its_deadline_waits_while_the_stages_make_progress():
    broke, pipeline = asyncio.run(_one_frame(reply_s=4 * DEADLINE_S, progress_every_s=DEADLINE_S / 3))
    assert broke == []
    assert pipeline.hops.late_replies == 1  # counted once, however many deadlines it outlived


def test_a_frame_past_its_deadline_with_no_progress_breaks_the_route():
    broke, _ = asyncio.run(_one_frame(reply_s=4 * DEADLINE_S, progress_every_s=None))
    assert len(broke) == 1
    assert "no progress on any stage" in broke[0]


def test_progress_stopping_mid_wait_breaks_it_one_deadline_later():
    async def scenario() -> tuple[list[str], float]:
        server = await serve("127.0.0.1", 0, replies_after(60.0), token="t")
        link = await connect("127.0.0.1", server.sockets[0].getsockname()[1], token="t")
        broke: list[str] = []
        pipeline = Pipeline(ToyEngine(first=True, final=False), link, on_break=broke.append,
                            options=PipelineOptions(wire_dtype=pb.F16))
        pipeline.watch.deadline = ReplyDeadline(floor_s=DEADLINE_S, first_s=DEADLINE_S)
        pipeline.start()
        loop = asyncio.get_running_loop()
        for at in (0.2, 0.4, 0.6):  # the stage works for 0.6 s, then nothing moves
            loop.call_later(at, pipeline.watch.progressed)
        started = loop.time()
        try:
            pending = await pipeline.send(SessionId(1), pipeline.open(SessionId(1)), Outgoing(0, [3], SamplingParams()))
            with pytest.raises(MeshUnavailableError):
                await pipeline.wait(pending)
            return broke, loop.time() - started
        finally:
            await pipeline.stop()
            server.close()

    broke, took = asyncio.run(scenario())
    assert len(broke) == 1
    assert 0.6 + DEADLINE_S <= took < 0.6 + 3 * DEADLINE_S


def test_a_frame_deadline_counts_the_rows_queued_ahead_of_it():
    async def scenario() -> list[int]:
        server = await serve("127.0.0.1", 0, replies_after(60.0), token="t")
        link = await connect("127.0.0.1", server.sockets[0].getsockname()[1], token="t")
        pipeline = Pipeline(ToyEngine(first=True, final=False), link, on_break=lambda _: None,
                            options=PipelineOptions(wire_dtype=pb.F16))
        pipeline.start()
        try:
            long = Outgoing(0, [3] * 40, SamplingParams())
            first = await pipeline.send(SessionId(1), pipeline.open(SessionId(1)), long)
            second = await pipeline.send(SessionId(2), pipeline.open(SessionId(2)), Outgoing(0, [3], SamplingParams()))
            return [first.ahead, second.ahead]
        finally:
            await pipeline.stop()
            server.close()

    assert asyncio.run(scenario()) == [0, 40]


def test_the_healer_reads_progress_from_each_stage_s_engine_time():
    route = Route.__new__(Route)
    a, b = RemoteStage(endpoint="a:1"), RemoteStage(endpoint="b:1")
    route.stages = [a, b]
    seen: dict[str, float] = {}
    a.status, b.status = pb.StatusReply(busy_seconds=1.0), pb.StatusReply(busy_seconds=2.0)
    assert not worked(route, seen)  # the first look only learns where each stage is
    assert not worked(route, seen)  # idle: nothing grew
    b.status = pb.StatusReply(busy_seconds=2.5)
    assert worked(route, seen)
    b.status = None  # a stage that has not answered yet tells nothing
    assert not worked(route, seen)
    route.stages = [a]  # b left the route (a rebuild): it is forgotten
    assert not worked(route, seen)
    assert set(seen) == {"a:1"}


def test_a_503_says_when_to_retry(byte_tokenizer):
    backend = FakeBackend(byte_tokenizer, fail=lambda: MeshUnavailableError("stage 1 is gone"))
    with TestClient(build_app(backend, Metrics())) as client:
        r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 503
    assert r.headers["retry-after"] == str(MeshUnavailableError.retry_after_s)
