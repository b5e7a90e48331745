"""Stopping a route, or the server, ends exactly what it started: no task outlives it and no
frame is left waiting (common/task_scope.py, mesh/serving/pipeline.py, mesh/routing/healing.py).
No model, no process."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import cast

import anyio
import pytest
from toy_engine import ToyEngine, until

from common.ids import LaneId, SessionId
from common.task_scope import TaskScope
from mesh.backend import MeshUnavailableError
from mesh.reports.recovery import Recoveries
from mesh.routing import healing
from mesh.routing.healing import Healer
from mesh.routing.route import Route
from mesh.serving.pipeline import Pending, Pipeline, PipelineOptions
from mesh.serving.request_state import Outgoing
from proto import meshpipe_pb2 as pb
from stage.sampling import SamplingParams
from stage.transport import Link, LinkClosedError, connect, serve


def _new_tasks(before: set[asyncio.Task[object]]) -> set[asyncio.Task[object]]:
    return {t for t in asyncio.all_tasks() - before if not t.done()}


async def never_replies(link: Link) -> None:
    """A final stage that takes every frame and answers none: frames stay in flight."""
    with contextlib.suppress(LinkClosedError):
        while True:
            await link.recv()


def test_stopping_a_route_fails_every_frame_in_flight_and_leaves_no_task_of_it():
    async def scenario() -> None:
        server = await serve("127.0.0.1", 0, never_replies, token="t")
        link = await connect("127.0.0.1", server.sockets[0].getsockname()[1], token="t")
        broke: list[str] = []
        pipeline = Pipeline(ToyEngine(first=True, final=False), link, on_break=broke.append,
                            options=PipelineOptions(wire_dtype=pb.F16))
        await asyncio.sleep(0.1)  # the server has taken the link: its tasks are not the pipeline's
        before = asyncio.all_tasks()
        pipeline.start()
        try:
            sent: list[Pending] = []
            for session in (SessionId(1), SessionId(2)):
                lane = pipeline.open(session)
                sent.append(await pipeline.send(session, lane, Outgoing(0, [3, 4], SamplingParams())))
                sent.append(await pipeline.send(session, lane, Outgoing(2, [5], SamplingParams())))
            await asyncio.sleep(0.05)
            assert len(pipeline.waiters) == 4
            assert _new_tasks(before), "the reply reader runs"
            await pipeline.stop()
            assert _new_tasks(before) == set()  # the reader, its host and stage 0's batcher have ended
            for pending in sent:
                assert pending.reply is not None
                assert pending.reply.done()
                assert isinstance(pending.reply.exception(), MeshUnavailableError)
            assert pipeline.waiters == {}
            assert broke == []  # stopping is not breaking: nobody is asked to heal it
            with pytest.raises(MeshUnavailableError, match="stopped"):
                await pipeline.send(SessionId(1), LaneId(0), Outgoing(3, [6], SamplingParams()))
        finally:
            server.close()

    asyncio.run(scenario())


def test_a_task_scope_runs_early_spawns_outlives_a_failing_task_and_waits_for_shielded_cleanup(
        caplog: pytest.LogCaptureFixture):
    scope = TaskScope("test")  # made outside any event loop, as `mesh serve` makes the coordinator

    async def scenario() -> None:
        done, cleaned = anyio.Event(), []

        async def fails() -> None:
            raise RuntimeError("boom")

        async def runs() -> None:
            done.set()
            try:
                await anyio.sleep_forever()
            finally:
                with anyio.CancelScope(shield=True):
                    await asyncio.sleep(0.05)  # cancelled again at once, unshielded
                    cleaned.append(True)

        before = asyncio.all_tasks()
        assert scope.spawn(fails, "fails")  # before the group is open: it runs once it is
        scope.start()
        assert scope.spawn(runs, "runs")
        with anyio.fail_after(2):
            await done.wait()
        await asyncio.sleep(0.01)
        assert len(_new_tasks(before)) == 2  # the host and `runs`: `fails` ended alone
        await scope.stop()
        assert cleaned == [True]
        assert _new_tasks(before) == set()
        assert not scope.spawn(runs, "late")  # nothing starts after stop
        assert _new_tasks(before) == set()

    with caplog.at_level(logging.ERROR, logger="meshpipe.tasks"):
        asyncio.run(scenario())
    assert "test: fails failed" in caplog.text


@dataclass
class FakePipeline:
    broken: str | None = None

    def fail(self, reason: str) -> None:
        self.broken = self.broken or reason


@dataclass
class FakeServed:
    """The coordinator as the healer sees it. Each build serves a fresh pipeline, or hangs."""

    pipeline: Pipeline | None = None
    route: Route | None = None
    artifact_source: str = ""
    hang: bool = False
    events: list[str] = field(default_factory=list)

    async def build_route(self, healing: bool = False) -> None:
        await asyncio.sleep(0.01)  # a build's first call to a stage
        self.events.append("build")
        if self.hang:
            await anyio.sleep_forever()
        self.pipeline = cast(Pipeline, FakePipeline())

    async def drop_route(self, quick: bool = False) -> None:
        await asyncio.sleep(0.1)  # a route's Stop and exit waits
        self.pipeline = None
        self.events.append(f"dropped quick={quick}")


def test_a_break_is_rebuilt_at_once_and_a_paused_request_resumes_on_the_new_route():
    async def scenario() -> None:
        served = FakeServed(pipeline=cast(Pipeline, FakePipeline(broken="link lost")))
        healer = Healer(served, 5.0, (), Recoveries(), print)
        healer.start()
        try:
            healer.route_broken("link lost")
            healer.route_broken("link lost again")  # one rebuild at a time
            with anyio.fail_after(2):
                pipeline = await healer.next_pipeline("link lost")
            assert pipeline is served.pipeline
            assert not pipeline.broken
            assert served.events == ["dropped quick=True", "build"]
            assert healer.recoveries.count == 1
            assert healer.last_error == ""
        finally:
            await healer.stop()

    asyncio.run(scenario())


def test_stopping_the_server_cancels_the_watcher_and_a_hanging_rebuild_and_leaves_nothing(
        monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(healing, "PING_S", 0.01)

    async def scenario() -> None:
        served = FakeServed(hang=True)  # no route: the watcher starts a rebuild, whose build hangs
        healer = Healer(served, 60.0, (), Recoveries(), print)
        before = asyncio.all_tasks()
        healer.start()
        healer.watch()
        await until(lambda: served.events == ["dropped quick=True", "build"])
        waiting = asyncio.get_running_loop().create_task(healer.live_pipeline())
        await asyncio.sleep(0.05)
        healer.route_broken("stage gone")  # the hanging rebuild is the one
        await healer.stop()
        assert _new_tasks(before) - {waiting} == set()  # the watcher, the rebuild and the host have ended
        with anyio.fail_after(1), pytest.raises(MeshUnavailableError, match="stopping"):
            await waiting  # a request waiting for a route gives up at once, not after 60 s
        healer.route_broken("after stop")
        assert _new_tasks(before) == set()  # nothing rebuilds once the server stops
        assert served.events == ["dropped quick=True", "build"]

    asyncio.run(scenario())


def test_a_rebuild_drops_the_broken_route_whole_even_when_the_server_stops_meanwhile():
    async def scenario() -> None:
        served = FakeServed(pipeline=cast(Pipeline, FakePipeline(broken="frozen")))
        healer = Healer(served, 60.0, (), Recoveries(), print)
        healer.start()
        healer.route_broken("frozen")
        await asyncio.sleep(0.02)  # the rebuild is dropping the route
        await healer.stop()
        assert served.events == ["dropped quick=True"]  # dropped whole, and no build after

    asyncio.run(scenario())
