"""The data plane of a loaded stage: frames in, batched engine steps, frames out.

Frames from upstream are admitted in arrival order; the stage core (`stage/core.py`) runs
them, batched across sessions; results leave in the same order, downstream as hidden
states or, at the final stage, as sampled tokens. The final stage sends its REPLY and
ERROR frames straight to stage 0 on the reply link stage 0 opens to it (direct return,
DESIGN.md §2), or upstream when there is none (two stages, or the benchmark's relay mode).
Whatever arrives from downstream (a middle stage's ERROR, a relayed REPLY) goes on
upstream unchanged.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import numpy as np

from common.ids import SessionId
from proto import meshpipe_pb2 as pb
from stage.batcher import VoidFrameError
from stage.core import StageCore, Work
from stage.engine import RangeEngine
from stage.frames import FrameSampling, error_frame, input_rows, sampling_of
from stage.lanes import LanesExhaustedError
from stage.mtp_drafts import with_drafts
from stage.transport import NO_EMULATION, REPLIES_ROLE, FrameError, Link, LinkClosedError, WireEmulation

log = logging.getLogger("meshpipe.stage")
COMPUTE_KINDS = (pb.PREFILL, pb.DECODE, pb.VERIFY)


@dataclass
class _Admitted:
    header: pb.FrameHeader
    work: Work | None  # a compute frame's step or an END's trim; None when there is nothing to wait for
    error: str | None = None
    sampling: FrameSampling | None = None  # a frame the final stage answers: read once, at admission


class ActivationStage:
    def __init__(self, engine: RangeEngine, stage_index: int, wire_dtype: int,
                 downstream: Link | None, emulation: WireEmulation = NO_EMULATION,
                 core: StageCore | None = None) -> None:
        """`core`: one over a range shared with other claims (stage/hosted.py), else its own."""
        self.core = core if core is not None else StageCore(engine, stage_index, wire_dtype)
        self.downstream = downstream
        self.emulation = emulation  # benchmark-only delay on the links accepted here
        self.upstream: Link | None = None
        self.replies: Link | None = None  # final stage: stage 0's reply link, when it opened one
        self.relay: asyncio.Task[None] | None = None
        self.relayed = 0  # frames relayed upstream from downstream
        self.failed: str | None = None
        self.withheld = 0  # frames computed, then found void: neither forwarded nor answered

    def start(self) -> None:
        self.core.start()
        if self.downstream is not None:
            self.relay = asyncio.get_running_loop().create_task(self._relay_replies())

    async def stop(self) -> None:
        if self.relay:
            self.relay.cancel()
        await self.core.stop()
        for link in (self.upstream, self.replies, self.downstream):
            if link is not None:
                link.close()

    async def handle_upstream(self, link: Link) -> None:
        """Serve one upstream connection until it closes: the data link, or stage 0's reply
        link. While the route's link is open, a second one is refused: a peer that holds the
        token must still not be able to cut the route (a new route Loads a new listener)."""
        if link.role == REPLIES_ROLE:
            await self._serve_reply_link(link)
            return
        if self.upstream is not None:
            log.warning("stage %d: refused a second upstream link from %s: the route's link is open",
                        self.core.index, link.peer)
            link.close()
            return
        self.upstream = link
        link.emulate(self.emulation, f"stage{self.core.index}->upstream")
        outbox: asyncio.Queue[_Admitted | None] = asyncio.Queue()
        sender = asyncio.get_running_loop().create_task(self._send_results(link, outbox))
        try:
            while True:
                header, payload = await link.recv()
                outbox.put_nowait(self._admit(header, payload))
        except LinkClosedError:
            pass
        except FrameError as exc:  # the stream is out of step now: drop the link, keep serving
            log.warning("stage %d: upstream link from %s dropped: %s", self.core.index, link.peer, exc)
            link.close()
        finally:
            outbox.put_nowait(None)
            await asyncio.gather(sender, return_exceptions=True)
            if self.upstream is link:
                self.upstream = None
                await self.core.release_all()

    async def _serve_reply_link(self, link: Link) -> None:
        if self.downstream is not None:
            log.warning("stage %d: refused a reply link: only the final stage sends replies", self.core.index)
            link.close()
            return
        if self.replies is not None:
            log.warning("stage %d: refused a second reply link from %s: one is open", self.core.index, link.peer)
            link.close()
            return
        self.replies = link
        link.emulate(self.emulation, f"stage{self.core.index}->stage0")
        try:
            while True:
                await link.recv()  # stage 0 sends nothing here: this only sees the link close
        except (LinkClosedError, FrameError):
            pass
        finally:
            link.close()
            if self.replies is link:
                self.replies = None

    def _admit(self, header: pb.FrameHeader, payload: bytes) -> _Admitted:
        try:
            if header.kind in COMPUTE_KINDS:
                return self._submit(header, payload)
            if header.kind == pb.END:
                trim = self.core.release(SessionId(header.session_id), header.keep, header.stash)
                return _Admitted(header, None if trim is None else Work(trim))
            return _Admitted(header, None, error=f"unexpected frame kind {header.kind}")
        except (LanesExhaustedError, ValueError) as exc:
            return _Admitted(header, None, error=str(exc))

    def _submit(self, header: pb.FrameHeader, payload: bytes) -> _Admitted:
        sampling = None
        if self.downstream is None and header.want_reply:
            sampling = sampling_of(header)
            if problem := self.core.sampling_problem(header, sampling):
                return _Admitted(header, None, error=problem)
        return _Admitted(header, self.core.submit_frame(header, payload), sampling=sampling)

    async def _send_results(self, link: Link, outbox: asyncio.Queue[_Admitted | None]) -> None:
        while (item := await outbox.get()) is not None:
            try:
                result = await item.work.output if item.work is not None else None
            except VoidFrameError:
                continue  # dropped unrun: nothing leaves for it (counted in core.skipped)
            except Exception as exc:  # noqa: BLE001 -- one frame's failure is its ERROR reply, not the stage's end
                item.error = f"stage {self.core.index}: {exc}"
                result = None
            if item.header.kind in COMPUTE_KINDS and self.core.is_void(item.header):
                self.withheld += 1  # it ran before its epoch turned void; its output must not count
                continue
            try:
                await self._emit(link, item, result)
            except ConnectionError as exc:
                log.warning("stage %d: cannot send: %s", self.core.index, exc)

    async def _emit(self, link: Link, item: _Admitted, result: np.ndarray | None) -> None:
        h = item.header
        if self.downstream is None and self.replies is not None:
            link = self.replies  # direct return: the final stage answers stage 0 itself
        if item.error is not None:
            await link.send(error_frame(h, item.error))
            return
        if h.kind not in COMPUTE_KINDS:
            if self.downstream is not None:
                await self.downstream.send(h)
            return
        assert item.work is not None
        assert result is not None
        if self.downstream is None:
            if item.sampling is not None:
                reply = self.core.answer(h, item.work, result, item.sampling, input_rows(h))
                await link.send(await with_drafts(self.core, h, reply, item.sampling, h.fed))
            return
        out = pb.FrameHeader()
        out.CopyFrom(h)
        encoded = self.core.encode(item.work, result)
        out.timings.hops.append(encoded.hop)
        encoded.describe(out)
        await self.downstream.send(out, encoded.data)

    async def _relay_replies(self) -> None:
        """Relay upstream what comes from downstream: ERROR frames, and REPLY frames when the
        final stage has no reply link."""
        assert self.downstream is not None
        try:
            while True:
                header, payload = await self.downstream.recv()
                if self.upstream is not None:
                    self.relayed += 1
                    await self.upstream.send(header, payload or None)
        except ConnectionError as exc:
            self.failed = f"stage {self.core.index}: downstream link lost ({exc})"
            log.error(self.failed)
            if self.upstream is not None:
                self.upstream.close()  # the coordinator must see the route break now
