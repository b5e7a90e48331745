"""The stage core under stage 0 (Pipeline) and a `mesh stage` (ActivationStage), on a toy
engine: lanes, the codec over a loopback link, final-stage sampling and its errors, hops."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from toy_engine import ToyEngine, until

from mesh.pipeline import Pipeline, StageFailedError
from proto import meshpipe_pb2 as pb
from stage.activations import ActivationStage
from stage.frames import FrameSampling, sampling_of
from stage.sampling import Sampled, SamplingParams
from stage.transport import connect, serve

GREEDY = SamplingParams()
# finite, but 1e300 / 1e-30 overflows: the final stage cannot sample it (and numpy says so)
OVERFLOW = SamplingParams(temperature=1e-30, logit_bias=((3, 1e300),))
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                                        "ignore:invalid value encountered:RuntimeWarning")


@contextlib.asynccontextmanager
async def two_stages(chunk: int = 128) -> AsyncIterator[tuple[Pipeline, ActivationStage]]:
    final = ActivationStage(ToyEngine(first=False, final=True), 1, pb.F16, None)
    final.start()
    server = await serve("127.0.0.1", 0, final.handle_upstream, token="t")
    link = await connect("127.0.0.1", server.sockets[0].getsockname()[1], token="t")
    pipeline = Pipeline(ToyEngine(first=True, final=False), link, wire_dtype=pb.F16, chunk=chunk)
    pipeline.start()
    try:
        yield pipeline, final
    finally:
        await pipeline.stop()
        # the final stage frees every lane when its upstream goes: let it, before stopping it
        await until(lambda: final.upstream is None and not final.core.lanes.by_session)
        await final.stop()
        server.close()


def _tokens(sampled: list[Sampled]) -> list[int]:
    return [s.token for s in sampled]


def test_stage_zero_alone_samples_in_process_and_frees_its_lane_at_end():
    async def scenario() -> None:
        engine = ToyEngine(first=True, final=True)
        pipeline = Pipeline(engine, None)
        pipeline.start()
        try:
            lane = pipeline.open(7)
            assert pipeline.open(7) == lane  # one lane per session however often asked
            assert _tokens(await pipeline.run(7, lane, 0, [1, 2, 3], GREEDY, kind=pb.PREFILL)) == [4]
            verify = await pipeline.run(7, lane, 3, [4, 5, 9], GREEDY, all_logits=True, kind=pb.VERIFY)
            assert _tokens(verify) == [5, 6, 10]
            assert engine.position(lane) == 6
            assert pipeline.hops.frames == {"prefill": 1, "verify": 1}
            assert pipeline.hops.batch_rows[("verify", "0")] == 3
            with pytest.raises(StageFailedError, match="stage 0: cannot sample"):
                await pipeline.run(7, lane, 6, [10], OVERFLOW)
            await pipeline.end(7)
            assert len(pipeline.core.lanes) == 0
            assert engine.position(lane) == 0
        finally:
            await pipeline.stop()

    asyncio.run(scenario())


def test_two_stages_chunk_encode_sample_and_map_sessions_to_their_own_lanes():
    async def scenario() -> None:
        async with two_stages(chunk=2) as (pipeline, final):
            first = pipeline.core.engine
            pipeline.open(5)  # stage 0's lanes: 5 -> 0, 9 -> 1
            lane = pipeline.open(9)
            # five tokens in chunks of two: three frames, one reply
            assert _tokens(await pipeline.run(9, lane, 0, [1, 2, 3, 4, 5], GREEDY, kind=pb.PREFILL)) == [6]
            assert final.core.lanes.by_session == {9: 0}  # the final stage maps sessions on its own
            verify = await pipeline.run(9, lane, 5, [6, 20], GREEDY, all_logits=True, kind=pb.VERIFY)
            assert _tokens(verify) == [7, 21]
            assert first.position(lane) == final.core.engine.position(0) == 7
            hops = pipeline.hops
            assert hops.frames == {"prefill": 1, "verify": 1}
            assert {stage for _, stage in hops.batch_rows} == {"0", "1"}
            assert ("verify", "links", "wire") in hops.seconds
            await pipeline.end(9)
            await until(lambda: not final.core.lanes.by_session)
            assert final.core.engine.position(0) == 0
            assert first.position(lane) == 0

    asyncio.run(scenario())


def test_the_final_stage_refuses_or_fails_one_request_and_serves_on():
    async def scenario() -> None:
        async with two_stages() as (pipeline, _):
            lane = pipeline.open(1)
            await pipeline.run(1, lane, 0, [1, 2], GREEDY, kind=pb.PREFILL)
            with pytest.raises(StageFailedError, match="stage 1: cannot sample"):
                await pipeline.run(1, lane, 2, [3], OVERFLOW)
            with pytest.raises(StageFailedError, match=r"stage 1: .*finite"):
                await pipeline.run(1, lane, 2, [3], SamplingParams(temperature=float("nan")))
            assert _tokens(await pipeline.run(1, lane, 2, [3], GREEDY)) == [4]
            assert pipeline.broken is None

    asyncio.run(scenario())


def test_frame_sampling_splits_the_penalty_history_and_survives_the_wire():
    params = SamplingParams(temperature=0.7, top_k=5, seed=1 << 63, presence_penalty=0.5,
                            logit_bias=((3, -1.5),), logprobs=2)
    # the completion so far ends with 4, fed first; 8 and 9 are drafts sampled at later rows
    frame = FrameSampling.for_rows(params, [2, 4], [4, 8, 9], rows=3)
    assert frame == FrameSampling(params, (2, 4), (8, 9))
    assert sampling_of(pb.FrameHeader(sampling=frame.to_wire())) == frame
    # no penalty, no history on the wire
    plain = FrameSampling.for_rows(SamplingParams(), [2, 4], [4, 8, 9], rows=3)
    assert sampling_of(pb.FrameHeader(sampling=plain.to_wire())) == FrameSampling(SamplingParams())
