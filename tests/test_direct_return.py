"""Direct return and per-hop link emulation on three toy stages over loopback.

The final stage answers stage 0 on the reply link stage 0 opens to it, so a middle stage
relays nothing and a round trip crosses N links, not 2(N-1). Losing that link, or the
final stage, fails the request in flight at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
from mesh_server import mesh_serve
from models import write_tiny_llama
from toy_engine import ToyEngine, until

from common.ids import FrameId, SessionId
from common.sampling import SamplingParams
from mesh.backend import MeshUnavailableError
from mesh.serving.pipeline import Pending, Pipeline, PipelineOptions, round_trip
from mesh.serving.request_state import Outgoing
from packages.writer import write_package
from proto import meshpipe_pb2 as pb
from stage.activations import ActivationStage
from stage.control import StageControl, StageOptions
from stage.engine import Step
from stage.leases import Lease
from stage.transport import NO_EMULATION, REPLIES_ROLE, Link, WireEmulation, connect, serve

GREEDY = SamplingParams()


class GatedEngine(ToyEngine):
    """A final stage that computes only once the test opens the gate."""

    def __init__(self) -> None:
        super().__init__(first=False, final=True)
        self.gate = threading.Event()
        self.entered = threading.Event()

    def step(self, steps: list[Step]) -> list[np.ndarray]:
        self.entered.set()
        self.gate.wait(10)
        return super().step(steps)


@dataclass
class Chain:
    pipeline: Pipeline
    middle: ActivationStage
    final: ActivationStage


def _disconnected(stage: ActivationStage) -> bool:
    return stage.upstream is None


@contextlib.asynccontextmanager
async def three_stages(direct: bool = True, wire: WireEmulation = NO_EMULATION,
                       final_engine: ToyEngine | None = None) -> AsyncIterator[Chain]:
    final = ActivationStage(final_engine or ToyEngine(first=False, final=True), 2, pb.F16, None, wire)
    final.start()
    final_server = await serve("127.0.0.1", 0, final.handle_upstream, token="t")
    final_port = final_server.sockets[0].getsockname()[1]
    to_final = await connect("127.0.0.1", final_port, token="t", role="stage", emulation=wire, name="1->2")
    middle = ActivationStage(ToyEngine(first=False, final=False), 1, pb.F16, to_final, wire)
    middle.start()
    middle_server = await serve("127.0.0.1", 0, middle.handle_upstream, token="t")
    link = await connect("127.0.0.1", middle_server.sockets[0].getsockname()[1], token="t",
                         emulation=wire, name="0->1")
    replies = await connect("127.0.0.1", final_port, token="t", role=REPLIES_ROLE) if direct else None
    pipeline = Pipeline(ToyEngine(first=True, final=False), link, replies=replies,
                        options=PipelineOptions(wire_dtype=pb.F16))
    pipeline.start()
    if direct:
        await until(lambda: final.replies is not None)
    try:
        yield Chain(pipeline, middle, final)
    finally:
        await pipeline.stop()
        for stage in (middle, final):  # each frees its lanes when its upstream goes: let it
            await until(functools.partial(_disconnected, stage))
            await stage.stop()
        middle_server.close()
        final_server.close()


async def _decode(pipeline: Pipeline, session: int, n: int) -> list[int]:
    lane = pipeline.open(SessionId(session))
    out = [t.token for t in await round_trip(pipeline, SessionId(session), lane, Outgoing(0, [1, 2, 3], GREEDY))]
    for i in range(n - 1):
        frame = Outgoing(3 + i, [out[-1]], GREEDY)
        out += [t.token for t in await round_trip(pipeline, SessionId(session), lane, frame)]
    return out


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "relay"])
def test_replies_come_straight_from_the_final_stage(direct: bool):
    async def scenario() -> None:
        async with three_stages(direct=direct) as chain:
            assert await _decode(chain.pipeline, 4, 5) == [4, 5, 6, 7, 8]
            # five replies: none through the middle stage when the final stage answers directly
            assert chain.middle.relayed == (0 if direct else 5)
            assert chain.middle.upstream is not None  # the reply link did not displace the data link

    asyncio.run(scenario())


def test_errors_still_reach_stage_zero_from_the_final_stage_and_the_route_serves_on():
    async def scenario() -> None:
        async with three_stages() as chain:
            lane = chain.pipeline.open(SessionId(1))
            bad = SamplingParams(temperature=float("nan"))
            with pytest.raises(Exception, match=r"stage 2: .*finite"):
                await round_trip(chain.pipeline, SessionId(1), lane, Outgoing(0, [1, 2], bad))
            again = await round_trip(chain.pipeline, SessionId(1), lane, Outgoing(0, [1, 2], GREEDY))
            assert [t.token for t in again] == [3]
            assert chain.pipeline.broken is None

    asyncio.run(scenario())


def test_a_reply_link_at_a_middle_stage_is_refused():
    async def scenario() -> None:
        async with three_stages(direct=False) as chain:
            assert chain.middle.downstream is not None
            server = await serve("127.0.0.1", 0, chain.middle.handle_upstream, token="t")
            port = server.sockets[0].getsockname()[1]
            stray = await connect("127.0.0.1", port, token="t", role=REPLIES_ROLE)
            with pytest.raises(ConnectionError):
                await asyncio.wait_for(stray.recv(), 2)
            assert await _decode(chain.pipeline, 2, 2) == [4, 5]  # the data link is untouched
            server.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("cut", ["reply link", "final stage"])
def test_losing_the_reply_path_mid_request_fails_it_at_once(cut: str):
    async def scenario() -> None:
        engine = GatedEngine()
        async with three_stages(final_engine=engine) as chain:
            lane = chain.pipeline.open(SessionId(1))
            frame = Outgoing(0, [1, 2, 3], GREEDY)
            request = asyncio.ensure_future(round_trip(chain.pipeline, SessionId(1), lane, frame))
            await asyncio.to_thread(engine.entered.wait, 5)  # the frame is at the final stage
            started = time.monotonic()
            if cut == "reply link":
                assert chain.final.replies is not None
                chain.final.replies.close()
            else:
                for link in (chain.final.upstream, chain.final.replies):
                    assert link is not None
                    link.close()  # what the kernel does to a killed process's sockets
            with pytest.raises(MeshUnavailableError, match="lost"):
                await asyncio.wait_for(request, 5)
            assert time.monotonic() - started < 2
            assert chain.pipeline.broken is not None
            engine.gate.set()  # the late result goes nowhere: no reply, no stale token
            with pytest.raises(MeshUnavailableError):
                await round_trip(chain.pipeline, SessionId(1), lane, Outgoing(3, [4], GREEDY))

    asyncio.run(scenario())


@pytest.mark.parametrize(("direct", "links"), [(True, 3), (False, 4)], ids=["direct", "relay"])
def test_every_hop_is_delayed_both_ways(direct: bool, links: int):
    delay_ms = 40.0

    async def scenario() -> float:
        async with three_stages(direct=direct, wire=WireEmulation(delay_ms)) as chain:
            lane = chain.pipeline.open(SessionId(1))
            await round_trip(chain.pipeline, SessionId(1), lane, Outgoing(0, [1, 2], GREEDY))
            start = time.perf_counter()
            await round_trip(chain.pipeline, SessionId(1), lane, Outgoing(2, [3], GREEDY))
            return time.perf_counter() - start

    elapsed = asyncio.run(scenario())
    assert elapsed >= links * delay_ms / 1000
    assert elapsed < (links + 1) * delay_ms / 1000 + 0.2  # not a hop more (loose: a busy CI box)


def test_jittered_frames_keep_their_order_and_jitter_repeats_by_link_name():
    wire = WireEmulation(delay_ms=3, jitter_ms=3)
    a, b = wire.delays("x"), wire.delays("x")
    draws = [a() for _ in range(50)]
    assert draws == [b() for _ in range(50)]
    assert min(draws) >= 0
    assert max(draws) <= 0.006
    assert len(set(draws)) > 40  # jittered, not constant

    async def scenario() -> list[int]:
        got: list[int] = []
        done = asyncio.Event()

        async def receive(link: Link) -> None:
            while len(got) < 200:
                header, _ = await link.recv()
                got.append(header.frame_id)
            done.set()

        server = await serve("127.0.0.1", 0, receive, token="t")
        link = await connect("127.0.0.1", server.sockets[0].getsockname()[1], token="t", emulation=wire)
        for i in range(200):
            await link.send(pb.FrameHeader(session_id=1, frame_id=i, kind=pb.DECODE))
            if i % 20 == 0:
                await asyncio.sleep(0.002)
        await asyncio.wait_for(done.wait(), 10)
        link.close()
        server.close()
        return got

    assert asyncio.run(scenario()) == list(range(200))


def test_negative_or_nan_emulation_is_refused():
    for bad in ({"delay_ms": -1.0}, {"jitter_ms": float("nan")}):
        with pytest.raises(ValueError, match=">= 0"):
            WireEmulation(**bad)


def test_load_refuses_a_wire_emulation_out_of_range(tmp_path):
    control = StageControl(StageOptions(host="127.0.0.1", advertise="127.0.0.1", cache_dir=tmp_path,
                                        token=None, threads=1))
    lease = Lease("c", 1, 2**62)
    # only the range and the layer count are read by the check
    lease.prepared = SimpleNamespace(start=0, end=2, manifest=SimpleNamespace(layer_count=2))  # type: ignore[assignment]
    ok = pb.LoadRequest(layer_start=0, layer_end=2, final=True, lanes=1, ctx_size=64, wire_delay_ms=20,
                        wire_jitter_ms=5)
    assert control._check_load(ok, lease) is None
    for field, bad in (("wire_delay_ms", -1.0), ("wire_jitter_ms", float("nan")), ("wire_delay_ms", 1e9)):
        request = pb.LoadRequest()
        request.CopyFrom(ok)
        setattr(request, field, bad)
        assert "wire delay and jitter" in (control._check_load(request, lease) or "")


@pytest.mark.mesh
@pytest.mark.parametrize(("relay", "links"), [(False, 3), (True, 4)], ids=["direct", "relay"])
def test_served_stages_learn_the_wire_delay_at_load(tmp_path, relay: bool, links: int):
    """Three local stages of a tiny model: each token's round trip crosses every delayed link."""
    gguf = write_tiny_llama(tmp_path / "tiny.gguf", byte_vocab=True)
    write_package(gguf, tmp_path / "pkg", model_id="tiny", progress=lambda _: None)
    delay_ms = 40
    args = ["--model", str(tmp_path / "pkg"), "--no-draft", "--local-stages", "3",
            "--wire-delay-ms", str(delay_ms), *(["--relay-replies"] if relay else [])]
    with mesh_serve(tmp_path, *args) as (url, _):

        def timed(n: int) -> float:
            body = {"model": "tiny", "prompt": "hello", "max_tokens": n, "ignore_eos": True}
            start = time.perf_counter()
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert r.json()["usage"]["completion_tokens"] == n
            return time.perf_counter() - start

        timed(1)  # warm up
        per_token = (timed(9) - timed(1)) / 8  # eight decode round trips
    assert per_token >= links * delay_ms / 1000
    assert per_token < (links + 1) * delay_ms / 1000


def test_a_wait_cancelled_as_its_reply_comes_is_cancelled():
    """A client that leaves cancels its request's wait for a reply. Python 3.11's
    asyncio.wait_for returned a reply that came in the same loop turn and swallowed the
    cancellation, so the request ran on to its last token for nobody (issue 41's flake)."""
    async def scenario() -> None:
        pipeline = Pipeline(ToyEngine(first=True, final=False), None)
        reply: asyncio.Future[pb.FrameHeader] = asyncio.get_running_loop().create_future()
        pending = Pending(SessionId(1), FrameId(1), 0, time.perf_counter(), reply)
        waiting = asyncio.ensure_future(pipeline.wait(pending))
        await asyncio.sleep(0)  # it awaits the reply now
        reply.set_result(pb.FrameHeader(kind=pb.REPLY))
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
    asyncio.run(scenario())
