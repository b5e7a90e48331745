"""The data plane of a loaded stage: frames in, batched engine steps, frames out.

Frames from upstream are admitted in arrival order; their engine work is batched across
sessions by the Batcher; results leave in the same order, downstream as hidden states or,
at the final stage, back upstream as sampled tokens. Replies from downstream are relayed
upstream unchanged, so stage 0 sees one reply stream whatever the depth.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

import numpy as np

from proto import meshpipe_pb2 as pb
from stage.batcher import Batcher, StepClock
from stage.engine import RangeEngine, Step
from stage.lanes import LanePool, LanesExhaustedError
from stage.sampling import Sampled, SamplingParams, sample_rows
from stage.transport import Link, LinkClosedError, decode_tensor, encode_tensor

log = logging.getLogger("meshpipe.stage")
COMPUTE_KINDS = (pb.PREFILL, pb.DECODE, pb.VERIFY)


@dataclass
class _Admitted:
    header: pb.FrameHeader
    future: asyncio.Future[np.ndarray] | None
    error: str | None = None
    clock: StepClock = field(default_factory=StepClock)
    codec_s: float = 0.0  # decoding the payload; encoding the output adds to it


def hop(stage_index: int, clock: StepClock, codec_s: float = 0.0, sample_s: float = 0.0) -> pb.Hop:
    """The timings a stage stamps on a frame it ran."""
    return pb.Hop(stage_index=stage_index, queue_us=int(clock.queue_s * 1e6),
                  compute_us=int(clock.compute_s * 1e6), codec_us=int(codec_s * 1e6),
                  sample_us=int(sample_s * 1e6), batch_rows=clock.rows)


@dataclass(frozen=True)
class FrameSampling:
    """What the final stage needs to sample a frame: the parameters and the penalty history."""

    params: SamplingParams
    history: tuple[int, ...] = ()  # row i of the logits counts history + drafts[:i]
    drafts: tuple[int, ...] = ()

    def to_wire(self) -> pb.Sampling:
        p = self.params
        wire = pb.Sampling(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, seed=p.seed,
                           presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                           logit_bias=[pb.LogitBias(token=t, bias=b) for t, b in p.logit_bias])
        if p.logprobs >= 0:
            wire.logprobs = p.logprobs
        if p.penalised:  # the history costs bytes on every frame: only when it counts
            wire.history.extend(self.history)
            wire.drafts.extend(self.drafts)
        return wire

    def problem(self, vocab: int, ctx: int, rows: int) -> str | None:
        """None when a frame with `rows` logits rows can be sampled like this, else why not."""
        if (problem := self.params.problem(vocab)) is not None:
            return problem
        if len(self.history) + len(self.drafts) > ctx or len(self.drafts) >= max(rows, 1):
            return (f"penalty history of {len(self.history)} + {len(self.drafts)} drafts does not fit "
                    f"{rows} logits rows in a context of {ctx}")
        if any(not 0 <= t < vocab for t in (*self.history, *self.drafts)):
            return f"penalty history holds a token outside the vocabulary of {vocab}"
        return None


def sampling_of(header: pb.FrameHeader) -> FrameSampling:
    s = header.sampling
    params = SamplingParams(s.temperature, s.top_p or 1.0, s.top_k, s.seed, s.presence_penalty, s.frequency_penalty,
                            tuple((b.token, b.bias) for b in s.logit_bias),
                            s.logprobs if s.HasField("logprobs") else -1)
    return FrameSampling(params, tuple(s.history), tuple(s.drafts))


def add_sampled(reply: pb.FrameHeader, picks: list[Sampled]) -> None:
    reply.tokens.extend(p.token for p in picks)
    if picks and picks[0].logprob is not None:
        reply.logprobs.extend(p.logprob or 0.0 for p in picks)
        reply.top.extend(pb.TopLogprobs(tokens=[t for t, _ in p.top], logprobs=[lp for _, lp in p.top])
                         for p in picks)


def sampled_of(reply: pb.FrameHeader) -> list[Sampled]:
    """The reply's tokens with their logprobs, when the frame asked for them."""
    if not reply.logprobs:
        return [Sampled(t) for t in reply.tokens]
    if not len(reply.logprobs) == len(reply.top) == len(reply.tokens):
        raise ValueError("a reply's logprobs do not match its tokens")
    return [Sampled(t, lp, tuple(zip(top.tokens, top.logprobs, strict=True)))
            for t, lp, top in zip(reply.tokens, reply.logprobs, reply.top, strict=True)]


def _input_rows(h: pb.FrameHeader) -> int:
    """Rows the frame feeds: hidden-state rows, or token ids at a first stage."""
    return int(h.shape[0]) if len(h.shape) else len(h.tokens)


class ActivationStage:
    def __init__(self, engine: RangeEngine, stage_index: int, wire_dtype: int,
                 downstream: Link | None) -> None:
        self.engine = engine
        self.index = stage_index
        self.wire_dtype = wire_dtype
        self.downstream = downstream
        self.batcher = Batcher(engine)
        self.lanes = LanePool(engine.lanes)
        self.upstream: Link | None = None
        self.relay: asyncio.Task[None] | None = None
        self.failed: str | None = None

    def start(self) -> None:
        self.batcher.start()
        if self.downstream is not None:
            self.relay = asyncio.get_running_loop().create_task(self._relay_replies())

    async def stop(self) -> None:
        if self.relay:
            self.relay.cancel()
        await self.batcher.stop()
        for link in (self.upstream, self.downstream):
            if link is not None:
                link.close()

    async def handle_upstream(self, link: Link) -> None:
        """Serve one upstream connection until it closes."""
        if self.upstream is not None:
            self.upstream.close()  # a reconnecting coordinator replaces the old link
        self.upstream = link
        outbox: asyncio.Queue[_Admitted | None] = asyncio.Queue()
        sender = asyncio.get_running_loop().create_task(self._send_results(link, outbox))
        try:
            while True:
                header, payload = await link.recv()
                outbox.put_nowait(self._admit(header, payload))
        except (LinkClosedError, ConnectionError):
            pass
        finally:
            outbox.put_nowait(None)
            await asyncio.gather(sender, return_exceptions=True)
            if self.upstream is link:
                self.upstream = None
                await self._free_all()

    def _admit(self, header: pb.FrameHeader, payload: bytes) -> _Admitted:
        try:
            if header.kind in COMPUTE_KINDS:
                return self._submit(header, payload)
            if header.kind == pb.END:
                lane = self.lanes.release(header.session_id)
                future = None if lane is None else self.batcher.trim(lane, 0)
                return _Admitted(header, future)
            return _Admitted(header, None, error=f"unexpected frame kind {header.kind}")
        except (LanesExhaustedError, ValueError) as exc:
            return _Admitted(header, None, error=str(exc))

    def _submit(self, header: pb.FrameHeader, payload: bytes) -> _Admitted:
        if self.downstream is None and header.want_reply and (problem := self._sampling_problem(header)):
            return _Admitted(header, None, error=f"stage {self.index}: {problem}")
        clock = StepClock()
        lane = self.lanes.lane_for(header.session_id)
        if self.engine.first:
            tokens = np.asarray(header.tokens, dtype=np.int32)
            step = Step(lane, header.start_pos, tokens=tokens, all_logits=header.all_logits)
        else:
            hidden = decode_tensor(header, payload)
            step = Step(lane, header.start_pos, hidden=hidden, all_logits=header.all_logits)
        codec_s = time.perf_counter() - clock.queued
        return _Admitted(header, self.batcher.submit(step, clock), clock=clock, codec_s=codec_s)

    def _sampling_problem(self, header: pb.FrameHeader) -> str | None:
        """Sampling arrives from the network: check it before it reaches the sampler."""
        rows = _input_rows(header) if header.all_logits else 1
        return sampling_of(header).problem(self.engine.n_vocab, self.engine.ctx_per_lane, rows)

    async def _send_results(self, link: Link, outbox: asyncio.Queue[_Admitted | None]) -> None:
        while (item := await outbox.get()) is not None:
            try:
                result = await item.future if item.future is not None else None
            except Exception as exc:
                item.error = f"stage {self.index}: {exc}"
                result = None
            try:
                await self._emit(link, item, result)
            except (LinkClosedError, ConnectionError) as exc:
                log.warning("stage %d: cannot send: %s", self.index, exc)

    async def _emit(self, link: Link, item: _Admitted, result: np.ndarray | None) -> None:
        h = item.header
        if item.error is not None:
            await link.send(pb.FrameHeader(session_id=h.session_id, window_id=h.window_id,
                                           kind=pb.ERROR, message=item.error))
            return
        if h.kind not in COMPUTE_KINDS:
            if self.downstream is not None:
                await self.downstream.send(h)
            return
        assert result is not None
        if self.downstream is None:
            if h.want_reply:
                await link.send(self._reply(item, result))
            return
        out = pb.FrameHeader()
        out.CopyFrom(h)
        encoding = time.perf_counter()
        shape, data = encode_tensor(result, self.wire_dtype)
        out.timings.hops.append(self._hop(item, codec_s=time.perf_counter() - encoding))
        del out.shape[:]
        out.shape.extend(shape)
        out.dtype = self.wire_dtype  # type: ignore[assignment]
        out.payload_bytes = len(data)
        await self.downstream.send(out, data)

    def _reply(self, item: _Admitted, logits: np.ndarray) -> pb.FrameHeader:
        h = item.header
        rows = _input_rows(h)
        reply = pb.FrameHeader(session_id=h.session_id, window_id=h.window_id, kind=pb.REPLY,
                               start_pos=h.start_pos)
        sampling = time.perf_counter()
        frame = sampling_of(h)
        try:
            picks = sample_rows(logits, frame.params, h.start_pos, rows, frame.history, frame.drafts)
        except ValueError as exc:  # finite but extreme values can still overflow to NaN probabilities
            return pb.FrameHeader(session_id=h.session_id, window_id=h.window_id, kind=pb.ERROR,
                                  message=f"stage {self.index}: cannot sample: {exc}")
        add_sampled(reply, picks)
        reply.timings.CopyFrom(h.timings)
        reply.timings.hops.append(self._hop(item, sample_s=time.perf_counter() - sampling))
        return reply

    def _hop(self, item: _Admitted, codec_s: float = 0.0, sample_s: float = 0.0) -> pb.Hop:
        return hop(self.index, item.clock, item.codec_s + codec_s, sample_s)

    async def _relay_replies(self) -> None:
        assert self.downstream is not None
        try:
            while True:
                header, payload = await self.downstream.recv()
                if self.upstream is not None:
                    await self.upstream.send(header, payload or None)
        except (LinkClosedError, ConnectionError) as exc:
            self.failed = f"stage {self.index}: downstream link lost ({exc})"
            log.error(self.failed)
            if self.upstream is not None:
                self.upstream.close()  # the coordinator must see the route break now

    async def _free_all(self) -> None:
        for session in list(self.lanes.by_session):
            lane = self.lanes.release(session)
            if lane is not None:
                with contextlib.suppress(Exception):
                    await self.batcher.trim(lane, 0)
