"""Stage 0 and the way through the mesh: one `run` is one pass through every stage.

Stage 0 computes its layers in-process on a stage core (`stage/core.py`, as every stage
does), sends the hidden states down the activation link, and waits for the final stage's
sampled tokens to come back: on the reply link to the final stage when there is one
(direct return), else up the data link, which also brings any stage's ERROR frames.
Long inputs go in chunks: the next chunk is computed here while later stages work on the
previous one (pipelined prefill).

A request holds one lane for its whole life: `lease` (or `open`) takes it, every `run` is
given it, and `end` frees it here and on every stage. Every frame names the lane, so all
stages use the same one: a free lane keeps what the request before left in it (the prefix
cache, mesh/prefix_cache.py), and the next request on it prefills only what differs.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from common.errors import EngineError
from common.sampling import Sampled, SamplingParams
from config.errors import MeshpipeError
from mesh.backend import MeshUnavailableError
from mesh.hop_timing import HopTotals
from mesh.prefix_cache import PrefixCache
from mesh.reply_deadline import ReplyDeadline
from mesh.task_scope import TaskScope
from proto import meshpipe_pb2 as pb
from stage.core import CannotSampleError, StageCore, Work
from stage.engine import RangeEngine, Step
from stage.frames import FrameSampling, sampled_of
from stage.transport import FrameError, Link, LinkClosedError

log = logging.getLogger("meshpipe.pipeline")


class StageFailedError(MeshpipeError):
    """A stage reported an error for this request (the route itself may be fine)."""


@dataclass(frozen=True)
class _Waiter:
    future: asyncio.Future[pb.FrameHeader]
    own: pb.Hop  # stage 0's part of the frame
    sent_at: float
    kind: int
    epoch: int
    rows: int  # every row of the frame, earlier chunks too: later stages may still hold them


@dataclass
class Lease:
    """A request's lane, on stage 0 and on every stage: what `Pipeline.lease` gave it.

    `cached` prompt tokens were in the lane's KV already and are not prefilled.
    """

    session: int
    lane: int
    cached: int = 0


@dataclass
class Pending:
    """A frame on its way: `send` returns it, `wait` gives its tokens, `void` forgets it.

    `answered_at` is when its reply came back (0 until then), so a caller that was busy
    elsewhere still knows the round trip the frame took. `left_at` is when `send` made it:
    `left_at - sent_at` is stage 0's own time for the frame, which frames in flight cannot
    overlap.
    """

    session: int
    window: int
    epoch: int
    sent_at: float  # before stage 0 computed it, as a verify pass's cost counts it
    reply: asyncio.Future[pb.FrameHeader] | None  # None: sampled here, in `local`
    local: list[Sampled] | None = None
    answered_at: float = 0.0
    left_at: float = field(default_factory=time.perf_counter)  # made as `send` returns
    rows: int = 0  # the frame's, its reply deadline follows them

    def _answered(self, _: object) -> None:
        self.answered_at = time.perf_counter()


class Pipeline:
    def __init__(self, engine: RangeEngine, link: Link | None, wire_dtype: int = pb.F32,
                 chunk: int = 128, hops: HopTotals | None = None, replies: Link | None = None,
                 micro_batches: int = 1, on_break: Callable[[str], None] | None = None,
                 prefix_cache: bool = True) -> None:
        self.core = StageCore(engine, 0, wire_dtype, micro_batches)
        self.cache = PrefixCache() if prefix_cache else None
        self.link = link
        self.reply_link = replies  # to the final stage, past the middle ones (direct return)
        self.chunk = chunk
        self.deadline = ReplyDeadline()
        self.on_break = on_break  # told once, when the route breaks: the coordinator heals it
        self.windows = itertools.count(1)
        self.waiters: dict[tuple[int, int], _Waiter] = {}
        self.hops = hops or HopTotals()
        self.broken: str | None = None
        self.tasks = TaskScope("pipeline")  # the route's own: its reply readers

    def start(self) -> None:
        """Start the stage core, and a reply reader per link in the route's task scope."""
        self.core.start()
        self.tasks.start()
        links = [(self.link, "activation link to stage 1"), (self.reply_link, "reply link from the final stage")]
        for link, name in links:
            if link is not None:
                self.tasks.spawn(functools.partial(self._read_replies, link, name), f"reads the {name}")

    async def stop(self) -> None:
        """Stop exactly what `start` started. The readers have ended when this returns, and
        every frame still waiting has failed: none is left to wait for a reply that cannot
        come (DESIGN.md §2, "One engine thread, and stops"). Stopping is not breaking: the
        route is marked broken, so later sends fail at once, but nobody is asked to heal it."""
        await self.tasks.stop()
        for link in (self.link, self.reply_link):
            if link:
                link.close()
        # set before `fail`, which tells on_break of a first break only
        self.broken = self.broken or "the route was stopped"
        self.fail(self.broken)
        await self.core.stop()

    def open(self, session: int, prefer: int | None = None) -> int:
        """The session's lane at stage 0, taken once per request and freed by `end`; a resumed
        request asks for its old lane, where the draft's KV still holds its tokens."""
        return self.core.lane_for(session, prefer)

    def lease(self, session: int, prompt: Sequence[int] = (), prefer: int | None = None) -> Lease:
        """`open`, choosing the lane by the prefix cache: the free lane that holds most of
        `prompt` already, else the least recently used (`prefer`, if given, goes first)."""
        free = self.core.lanes.free
        if self.cache is None or not free or self.core.lanes.by_session.get(session) is not None:
            return Lease(session, self.open(session, prefer))
        lane = self.open(session, prefer if prefer in free else self.cache.choose(prompt, free))
        cached = self.cache.match(lane, prompt)
        self.cache.take(lane)
        return Lease(session, lane, cached)

    async def run(self, session: int, lane: int, start: int, tokens: list[int], sampling: SamplingParams,
                  all_logits: bool = False, kind: int = pb.DECODE, history: Sequence[int] = ()) -> list[Sampled]:
        """Feed `tokens` at `start`; return the sampled next token, or one per row if all_logits.

        `lane` is the one `open(session)` gave. `history` is the completion the penalties
        count at the first sampled row, that row's token included; the later rows extend it
        with the tokens fed before them. A prompt has none: only the completion is penalised.
        """
        return await self.wait(await self.send(session, lane, start, tokens, sampling, all_logits, kind, history))

    async def send(self, session: int, lane: int, start: int, tokens: list[int], sampling: SamplingParams,
                   all_logits: bool = False, kind: int = pb.DECODE, history: Sequence[int] = (),
                   epoch: int = 0) -> Pending:
        """`run` up to the point where the frame has left stage 0; `wait` gives its tokens, so
        several frames of a session can be in flight (DESIGN.md §6). `epoch` tags the frame:
        a stage skips a session's queued frames of an older epoch than the newest it saw."""
        sent_at = time.perf_counter()
        if self.broken:
            raise MeshUnavailableError(self.broken)
        if all_logits and len(tokens) > self.chunk:  # rows are sampled from the last chunk only
            raise ValueError(f"a window of {len(tokens)} rows exceeds the chunk of {self.chunk}")
        pieces = [tokens[i : i + self.chunk] for i in range(0, len(tokens), self.chunk)]
        frame = FrameSampling.for_rows(sampling, history, tokens, len(pieces[-1]) if all_logits else 1)
        reply: tuple[int, asyncio.Future[pb.FrameHeader]] | None = None
        pos = start
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            step = Step(lane, pos, tokens=np.asarray(piece, dtype=np.int32),
                        all_logits=all_logits and last)
            work = self.core.submit(step)
            try:
                out = await work.output
            except EngineError:
                if self.broken:  # stopped under us: the route broke, and the caller may resume
                    raise MeshUnavailableError(self.broken) from None
                raise
            if self.link is None:
                if last:
                    local = self._sample_here(work, out, frame, pos, len(piece), kind)
                    return Pending(session, 0, epoch, sent_at, None, local, time.perf_counter())
            else:
                reply = await self._send(session, lane, pos, work, out, frame, kind, last, all_logits,
                                         epoch, len(tokens))
            pos += len(piece)
        assert reply is not None
        pending = Pending(session, reply[0], epoch, sent_at, reply[1], rows=len(tokens))
        reply[1].add_done_callback(pending._answered)
        return pending

    async def wait(self, pending: Pending) -> list[Sampled]:
        """The tokens of a frame `send` sent."""
        if pending.reply is None:
            assert pending.local is not None
            return pending.local
        deadline = self.deadline.for_rows(pending.rows)
        if self.broken and not pending.reply.done():  # no reply can come any more
            raise MeshUnavailableError(self.broken)
        try:
            return await self._await_reply(pending.reply, deadline - (time.perf_counter() - pending.left_at))
        except TimeoutError:
            self.fail(f"no reply from the pipeline within {deadline:.1f}s (the deadline for a frame of "
                      f"{pending.rows} rows, from the replies so far)")
            raise MeshUnavailableError(self.broken) from None

    def void(self, pending: Pending) -> None:
        """Forget a frame whose reply can no longer count: it is dropped when it comes."""
        self.waiters.pop((pending.session, pending.window), None)
        if pending.reply is not None:
            if pending.reply.done() and not pending.reply.cancelled():
                pending.reply.exception()  # retrieved: a void frame's failure is nobody's error
            pending.reply.cancel()

    def _sample_here(self, work: Work, logits: np.ndarray, frame: FrameSampling, pos: int, rows: int,
                     kind: int) -> list[Sampled]:
        try:
            tokens, own = self.core.sample(work, logits, frame, pos, rows)
        except CannotSampleError as exc:  # fails the request, not the route, as at a remote final stage
            raise StageFailedError(str(exc)) from None
        self.hops.record(kind, own)
        return tokens

    async def _send(self, session: int, lane: int, pos: int, work: Work, hidden: np.ndarray,
                    frame: FrameSampling, kind: int, last: bool, all_logits: bool, epoch: int, rows: int
                    ) -> tuple[int, asyncio.Future[pb.FrameHeader]] | None:
        """Send one chunk; for the last, (its window id, the future its reply resolves)."""
        assert self.link is not None
        encoded = self.core.encode(work, hidden)
        window = next(self.windows)
        header = pb.FrameHeader(
            session_id=session, window_id=window, kind=kind if last else pb.PREFILL,  # type: ignore[arg-type]
            start_pos=pos, want_reply=last, all_logits=all_logits and last,
            sampling=frame.to_wire() if last else None, epoch=epoch, lane=lane + 1,
        )
        encoded.describe(header)
        future = None
        if self.broken:  # it broke while this frame was computed: `fail` has failed every waiter already
            raise MeshUnavailableError(self.broken)
        if last:
            future = asyncio.get_running_loop().create_future()
            self.waiters[(session, window)] = _Waiter(future, encoded.hop, time.perf_counter(), kind, epoch, rows)
        try:
            await self.link.send(header, encoded.data)
        except ConnectionError as exc:
            if future is not None:  # nobody will wait for it: the caller gets the error below
                self.waiters.pop((session, window), None)
                future.cancel()
            self.fail(f"activation link to stage 1 lost: {exc}")
            raise MeshUnavailableError(self.broken) from None
        return None if future is None else (window, future)

    async def _await_reply(self, future: asyncio.Future[pb.FrameHeader], timeout_s: float) -> list[Sampled]:
        header = await asyncio.wait_for(future, max(timeout_s, 0.0))
        if header.kind == pb.ERROR:
            raise StageFailedError(header.message)
        try:
            return sampled_of(header)
        except ValueError as exc:
            raise StageFailedError(str(exc)) from None

    async def end(self, session: int, keep: Sequence[int] = ()) -> None:
        """Free the session's lane here and on every stage. With the prefix cache, `keep` (the
        tokens every stage's KV surely holds, the record's `computed`) stays in the lane for a later
        request; the rest of its KV is dropped."""
        lane = self.core.lanes.by_session.get(session)
        keep = keep if self.cache is not None and lane is not None else ()
        # END leaves before the lane is free here: a later request's frames for this lane
        # must reach every stage after it, or the stage would find the lane still taken
        if self.link is not None and not self.broken:
            with contextlib.suppress(ConnectionError):
                await self.link.send(pb.FrameHeader(session_id=session, kind=pb.END, keep=len(keep)))
        trim = self.core.release(session, len(keep))
        if self.cache is not None and lane is not None:
            self.cache.keep(lane, keep)
        if trim is not None:
            with contextlib.suppress(Exception):
                await trim

    async def _read_replies(self, link: Link, name: str) -> None:
        try:
            while True:
                header, _ = await link.recv()
                key = (header.session_id, header.window_id)
                waiter = self.waiters.get(key)
                if waiter is None or header.epoch != waiter.epoch:
                    continue  # a void frame's reply, or one of another epoch: it never counts
                del self.waiters[key]
                self._deliver(waiter, header)
        except LinkClosedError as exc:
            self.fail(f"{name} lost: {exc or 'closed'}")
        except FrameError as exc:
            self.fail(f"{name} sent a bad frame: {exc}")

    def fail(self, reason: str) -> None:
        """Call the route broken: every frame waiting fails now, and so does every later send."""
        if self.broken is None:
            self.broken = reason
            log.error("route broken: %s", reason)
            if self.on_break is not None:
                self.on_break(reason)
        for waiter in self.waiters.values():
            if not waiter.future.done():
                waiter.future.set_exception(MeshUnavailableError(reason))
        self.waiters.clear()

    def _deliver(self, waiter: _Waiter, header: pb.FrameHeader) -> None:
        if waiter.future.done():
            return
        if header.kind == pb.REPLY:
            round_trip = time.perf_counter() - waiter.sent_at
            self.hops.record(waiter.kind, waiter.own, header.timings.hops, round_trip)
            self.deadline.observe(waiter.rows, round_trip)
        waiter.future.set_result(header)

