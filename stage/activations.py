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
from stage.frames import add_sampled, input_rows, sampling_of
from stage.lanes import LanePool, LanesExhaustedError
from stage.sampling import sample_rows
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
        rows = input_rows(header) if header.all_logits else 1
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
        rows = input_rows(h)
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
