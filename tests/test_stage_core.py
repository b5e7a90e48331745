"""The stage core under stage 0 (Pipeline) and a `mesh stage` (ActivationStage), on a toy
engine: lanes, the codec over a loopback link, final-stage sampling and its errors, hops."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import llguidance
import numpy as np
import pytest
from toy_engine import ToyEngine, until

from common.ids import FrameId, LaneId, SessionId
from common.sampling import Sampled, SamplingParams
from mesh.backend import GenerationRequest, MeshUnavailableError
from mesh.constraints.compile import Constraint
from mesh.serving.generate import generate
from mesh.serving.pipeline import Pending, Pipeline, PipelineOptions, StageFailedError, round_trip
from mesh.serving.proposals import Proposing
from mesh.serving.request_state import Live, Outgoing, RequestState
from mesh.speculative.proposer import Budget, Proposal
from mesh.speculative.window import Fixed
from packages.speculative import WindowPolicy
from proto import meshpipe_pb2 as pb
from stage.activations import ActivationStage
from stage.core import StageCore
from stage.engine import Step
from stage.frames import Asks, FrameSampling, compute_frame, sampling_of
from stage.transport import connect, serve

GREEDY = SamplingParams()
# finite, but 1e300 / 1e-30 overflows: the final stage cannot sample it (and numpy says so)
OVERFLOW = SamplingParams(temperature=1e-30, logit_bias=((3, 1e300),))
# the loop's mechanics, not what a request's ledger allows (tests/test_ledger.py)
pytestmark = [pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                                         "ignore:invalid value encountered:RuntimeWarning"),
              pytest.mark.usefixtures("unbounded_ledger")]


@contextlib.asynccontextmanager
async def two_stages(chunk: int = 128, final_engine: ToyEngine | None = None, first_engine: ToyEngine | None = None,
                     micro_batches: int = 1) -> AsyncIterator[tuple[Pipeline, ActivationStage]]:
    final = ActivationStage(final_engine or ToyEngine(first=False, final=True), 1, pb.F16, None)
    final.start()
    server = await serve("127.0.0.1", 0, final.handle_upstream, token="t")
    link = await connect("127.0.0.1", server.sockets[0].getsockname()[1], token="t")
    pipeline = Pipeline(first_engine or ToyEngine(first=True, final=False), link,
                        options=PipelineOptions(wire_dtype=pb.F16, chunk=chunk, micro_batches=micro_batches))
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
            lane = pipeline.open(SessionId(7))
            assert pipeline.open(SessionId(7)) == lane  # one lane per session however often asked
            assert _tokens(await round_trip(pipeline, SessionId(7), lane, Outgoing(0, [1, 2, 3], GREEDY))) == [4]
            verify = await round_trip(pipeline, SessionId(7), lane, Outgoing(3, [4, 5, 9], GREEDY, drafts=2))
            assert _tokens(verify) == [5, 6, 10]
            assert engine.position(lane) == 6
            assert pipeline.hops.frames == {"prefill": 1, "verify": 1}
            assert pipeline.hops.batch_rows[("verify", "0")] == 3
            with pytest.raises(StageFailedError, match="stage 0: cannot sample"):
                await round_trip(pipeline, SessionId(7), lane, Outgoing(6, [10], OVERFLOW))
            await pipeline.end(SessionId(7))
            assert len(pipeline.core.lanes) == 0
            assert engine.position(lane) == 0
        finally:
            await pipeline.stop()

    asyncio.run(scenario())


def test_two_stages_chunk_encode_sample_and_use_stage_0s_lane_everywhere():
    async def scenario() -> None:
        async with two_stages(chunk=2) as (pipeline, final):
            first = pipeline.core.engine
            pipeline.open(SessionId(5))  # stage 0's lanes: 5 -> 0, 9 -> 1
            lane = pipeline.open(SessionId(9))
            # five tokens in chunks of two: three frames, one reply
            prefill = await round_trip(pipeline, SessionId(9), lane, Outgoing(0, [1, 2, 3, 4, 5], GREEDY))
            assert _tokens(prefill) == [6]
            # every frame names stage 0's lane: a free lane may hold a cached prefix, so all agree
            assert final.core.lanes.by_session == {9: lane} == {9: 1}
            verify = await round_trip(pipeline, SessionId(9), lane, Outgoing(5, [6, 20], GREEDY, drafts=1))
            assert _tokens(verify) == [7, 21]
            assert first.position(lane) == final.core.engine.position(lane) == 7
            hops = pipeline.hops
            assert hops.frames == {"prefill": 1, "verify": 1}
            assert {stage for _, stage in hops.batch_rows} == {"0", "1"}
            assert ("verify", "links", "wire") in hops.seconds
            await pipeline.end(SessionId(9))
            await until(lambda: not final.core.lanes.by_session and final.core.engine.position(lane) == 0)
            assert first.position(lane) == 0

    asyncio.run(scenario())


class _CountingEngine(ToyEngine):
    """Records how many steps each decode took."""

    def __init__(self) -> None:
        super().__init__(first=True, final=False)
        self.decodes: list[int] = []

    def step(self, steps: list[Step]) -> list[np.ndarray]:
        self.decodes.append(len(steps))
        return super().step(steps)


@pytest.mark.parametrize("groups", [1, 2])
def test_micro_batches_split_stage_zeros_decodes_and_keep_every_token(groups: int):
    async def decode(pipeline: Pipeline, session: int, first: int) -> list[int]:
        lane = pipeline.open(SessionId(session))
        out = [first]
        for pos in range(4):
            out += _tokens(await round_trip(pipeline, SessionId(session), lane, Outgoing(pos, [out[-1]], GREEDY)))
        return out

    async def scenario() -> None:
        engine = _CountingEngine()
        async with two_stages(first_engine=engine, micro_batches=groups) as (pipeline, final):
            outs = await asyncio.gather(decode(pipeline, 1, 3), decode(pipeline, 2, 10))
            assert outs == [[3, 4, 5, 6, 7], [10, 11, 12, 13, 14]]
            # two sessions in two groups: one step per decode; in one group they run together
            assert max(engine.decodes) == 3 - groups
            assert final.core.batcher.busy_s > 0
            assert pipeline.core.batcher.busy_s > 0

    asyncio.run(scenario())


def test_the_final_stage_refuses_or_fails_one_request_and_serves_on():
    async def scenario() -> None:
        async with two_stages() as (pipeline, _):
            lane = pipeline.open(SessionId(1))
            await round_trip(pipeline, SessionId(1), lane, Outgoing(0, [1, 2], GREEDY))
            with pytest.raises(StageFailedError, match="stage 1: cannot sample"):
                await round_trip(pipeline, SessionId(1), lane, Outgoing(2, [3], OVERFLOW))
            nan = SamplingParams(temperature=float("nan"))
            with pytest.raises(StageFailedError, match=r"stage 1: .*finite"):
                await round_trip(pipeline, SessionId(1), lane, Outgoing(2, [3], nan))
            assert _tokens(await round_trip(pipeline, SessionId(1), lane, Outgoing(2, [3], GREEDY))) == [4]
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


def test_a_frame_names_its_lane_itself_lane_0_included_and_one_naming_none_takes_a_free_lane():
    async def submit(core: StageCore, header: pb.FrameHeader) -> None:
        header.tokens.append(1)
        await core.submit_frame(pb.FrameHeader.FromString(header.SerializeToString()), b"").output  # over the wire

    def named(session: int, lane: int) -> pb.FrameHeader:
        return compute_frame(SessionId(session), FrameId(1), LaneId(lane), 0, 0, Asks(pb.DECODE, FrameSampling(GREEDY)))

    async def scenario() -> None:
        core = StageCore(ToyEngine(first=True, final=True), 1)
        core.start()
        try:
            await submit(core, named(1, 1))
            assert core.lanes.by_session == {1: 1}
            trim = core.release(SessionId(1))  # lane 1 is the free lane taken first now
            assert trim is not None
            await trim
            await submit(core, named(2, 0))
            await submit(core, pb.FrameHeader(session_id=3, kind=pb.DECODE))
            assert core.lanes.by_session == {2: 0, 3: 1}
        finally:
            await core.stop()

    asyncio.run(scenario())


class GatedEngine(ToyEngine):
    """A whole model in one remote stage whose decodes wait for `gate`: frames queue behind it."""

    def __init__(self) -> None:
        super().__init__(first=True, final=True)
        self.gate, self.entered = threading.Event(), threading.Event()
        self.starts: list[int] = []  # the start of every step it computed

    def step(self, steps: list[Step]) -> list[np.ndarray]:
        self.entered.set()
        assert self.gate.wait(5)
        self.starts += [s.start for s in steps]
        return super().step(steps)


def _frame(frame: int, epoch: int, start: int, tokens: list[int]) -> pb.FrameHeader:
    return pb.FrameHeader(session_id=1, frame_id=frame, kind=pb.VERIFY, start_pos=start, tokens=tokens,
                          want_reply=True, all_logits=True, epoch=epoch, sampling=FrameSampling(GREEDY).to_wire())


def test_a_stage_skips_queued_frames_of_a_void_epoch_and_never_answers_them():
    """Frames 2 and 3 queue behind frame 1; frame 4 opens epoch 1, so 2 and 3 are dropped
    unrun, and frame 1, already running, is computed but neither answered nor counted."""

    async def scenario() -> None:
        engine = GatedEngine()
        stage = ActivationStage(engine, 1, pb.F32, None)
        stage.start()
        server = await serve("127.0.0.1", 0, stage.handle_upstream, token="t")
        link = await connect("127.0.0.1", server.sockets[0].getsockname()[1], token="t")
        try:
            await link.send(_frame(1, 0, 0, [1, 2]))
            await asyncio.to_thread(engine.entered.wait, 5)  # frame 1 is running, held at the gate
            await link.send(_frame(2, 0, 2, [3, 4]))
            await link.send(_frame(3, 0, 4, [5, 6]))
            await link.send(_frame(4, 1, 2, [9]))  # the target parted at position 2: epoch 1 starts there
            await until(lambda: stage.core.skipped == 2)
            engine.gate.set()
            reply, _ = await asyncio.wait_for(link.recv(), 2)
            assert (reply.kind, reply.frame_id, reply.epoch, list(reply.tokens)) == (pb.REPLY, 4, 1, [10])
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(link.recv(), 0.3)  # nothing else comes
            assert engine.starts == [0, 2]  # frames 2 and 3 were never computed
            assert stage.withheld == 1  # frame 1 ran, and its reply was held back
        finally:
            engine.gate.set()
            link.close()
            await stage.stop()
            server.close()

    asyncio.run(scenario())


class ToyDraft:
    """Proposes what ToyEngine's model will sample (each token + 1), wrong at `misses`: a `Proposer`."""

    names: tuple[str, ...] = ("draft",)

    def __init__(self, misses: frozenset[int] = frozenset()) -> None:
        self.misses = misses

    async def propose(self, lane: int, sequence: list[int], k: int) -> list[int]:
        out = []
        for i in range(k):
            nxt = (sequence[-1] + 1 + i) % ToyEngine.n_vocab
            out.append(nxt + 1 if len(sequence) + i in self.misses else nxt)
        return out

    async def proposal(self, lane: int, sequence: list[int], budget: Budget, guide: object = None,
                       sampling: object = None) -> Proposal:
        return Proposal(await self.propose(lane, sequence, budget("draft")), "draft", 0.0)

    def forget(self, lane: int) -> None:
        pass


class SlowToyEngine(ToyEngine):
    def step(self, steps: list[Step]) -> list[np.ndarray]:
        time.sleep(0.02)  # frames stay in flight long enough to pile up, even on a busy machine
        return super().step(steps)


TWO = WindowPolicy(policy="fixed", initial=2, min=1, max=2)


def test_frames_in_flight_over_a_link_equal_plain_decoding_and_skip_void_frames():
    async def scenario() -> None:
        async with two_stages(final_engine=SlowToyEngine(first=False, final=True)) as (pipeline, final):
            req = GenerationRequest([1], 24, ignore_eos=True)
            plain = [e.token async for e in generate(pipeline, pipeline.lease(SessionId(1)), Live(RequestState(req)),
                                                     64)
                     if isinstance(e, Sampled)]
            await pipeline.end(SessionId(1))
            most, send = 0, pipeline.send

            async def counted(*args: Any, **kwargs: Any) -> Pending:
                nonlocal most
                pending = await send(*args, **kwargs)
                most = max(most, len(pipeline.waiters))
                return pending

            pipeline.send = counted  # type: ignore[method-assign]
            draft = ToyDraft(misses=frozenset({5, 6, 12, 19}))
            proposing = Proposing(draft, Fixed(TWO), in_flight=4)
            spec = [e.token async for e in generate(pipeline, pipeline.lease(SessionId(2)), Live(RequestState(req)), 64,
                                                    proposing) if isinstance(e, Sampled)]
            assert spec == plain == [(2 + i) % ToyEngine.n_vocab for i in range(24)]
            assert 2 < most <= 4  # several frames out, never past the cap (a loaded machine may not fill it)
            assert final.core.skipped + final.withheld > 0  # frames past a miss were dropped there
            assert pipeline.waiters == {}

    asyncio.run(scenario())


class _Letters:
    """ToyEngine's vocabulary to llguidance: token t is the byte '@' + t (1 is 'A'), 0 the end."""

    eos_token_id, bos_token_id, special_token_ids = 0, None, (0,)
    tokens = (b"<end>", *(bytes([64 + t]) for t in range(1, ToyEngine.n_vocab)))

    def __call__(self, text: bytes) -> list[int]:
        return [b - 64 for b in text]


def _capitals() -> Constraint:
    """A grammar of 100 capital letters: the toy model's Z + 1 is refused, so a masked row
    wraps to A, and drafts (ToyDraft's + 1) are cut there."""
    tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Letters()))
    matcher = llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_regex("[A-Z]{100}"))
    return Constraint(matcher, ToyEngine.n_vocab, "regex")


@pytest.mark.parametrize("constrained", [False, True], ids=["free", "constrained"])
def test_a_reply_path_lost_mid_window_fails_the_request_at_once_with_no_stale_token(constrained: bool):
    """A constrained request fails as a free one does: the masks of the frames in flight go
    with them, and the guide is left at what was committed."""
    async def scenario() -> None:
        async with two_stages(final_engine=SlowToyEngine(first=False, final=True)) as (pipeline, final):
            # from W, the grammar turns the toy model's Z + 1 into A within the first six tokens
            req = GenerationRequest([23], 40, ignore_eos=True, constraint=_capitals() if constrained else None)
            live = Live(RequestState(req))
            proposing = Proposing(ToyDraft(), Fixed(TWO), in_flight=3)
            events = generate(pipeline, pipeline.lease(SessionId(1)), live, 64, proposing)
            out: list[int] = []

            async def consume() -> None:
                async with asyncio.timeout(5):  # no hang
                    async for event in events:
                        if isinstance(event, Sampled):
                            out.append(event.token)
                            if len(out) == 6:
                                assert len(pipeline.waiters) > 1  # several frames are in flight
                                assert final.upstream is not None
                                final.upstream.close()  # the reply path goes, mid-window

            with pytest.raises(MeshUnavailableError, match="lost"):
                await consume()
            assert 6 <= len(out) < 40
            # nothing stale: the toy model's tokens, under the grammar A..Z and around again
            plain = [(23 + i) % 26 + 1 if constrained else (24 + i) % ToyEngine.n_vocab for i in range(len(out))]
            assert out == plain
            assert pipeline.waiters == {}

    asyncio.run(scenario())
