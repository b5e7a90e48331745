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
cache, mesh/serving/prefix_cache.py), and the next request on it prefills only what differs.
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
from common.ids import FrameId, LaneId, SessionId
from common.sampling import Sampled
from common.task_scope import TaskScope
from config.errors import MeshpipeError
from mesh.backend import MeshUnavailableError
from mesh.reports.hop_timing import HopTotals
from mesh.serving.kv_index import TierIndex
from mesh.serving.prefix_cache import PrefixCache
from mesh.serving.reply_deadline import ReplyWatch, StalledError
from mesh.serving.request_state import Outgoing
from proto import meshpipe_pb2 as pb
from stage.checkpoints import DEPTH
from stage.core import StageCore, Work, begin_lane
from stage.engine import RangeEngine, Step
from stage.frames import Asks, FrameSampling, Offered, compute_frame, offered_of, sampled_of
from stage.lane_tier import Begin
from stage.mtp_drafts import with_drafts
from stage.transport import FrameError, Link, LinkClosedError

log = logging.getLogger("meshpipe.pipeline")


class StageFailedError(MeshpipeError):
    """A stage reported an error for this request (the route itself may be fine)."""


@dataclass
class Lease:
    """A request's lane, on stage 0 and on every stage: what `Pipeline.lease` gave it.

    `cached` prompt tokens were in the lane's KV already and are not prefilled.
    """

    session: SessionId
    lane: LaneId
    cached: int = 0
    restored: str = ""  # the KV tier's entry the cached tokens come from, which a stage may have lost


@dataclass
class Pending:
    """A frame in flight: `send` returns it, `wait` gives its tokens, `void` forgets it, and
    the reply reader resolves `reply` when the final stage answers.

    `answered_at` is when its reply came back (0 until then), so a caller that was busy
    elsewhere still knows the round trip the frame took. `left_at` is when `send` made it:
    `left_at - sent_at` is stage 0's own time for the frame, which frames in flight cannot
    overlap.
    """

    session: SessionId
    frame: FrameId
    epoch: int
    sent_at: float  # before stage 0 computed it, as a verify pass's cost counts it
    reply: asyncio.Future[pb.FrameHeader] | None  # None: stage 0 is the final stage, see `local`
    local: list[Sampled] | None = None  # the tokens stage 0 sampled itself
    answered_at: float = 0.0
    left_at: float = field(default_factory=time.perf_counter)  # made as `send` returns
    rows: int = 0  # every row of the frame, earlier chunks too: its reply deadline follows them
    ahead: int = 0  # rows of this pipeline's frames still out when it left: queued before it
    kind: int = pb.DECODE  # the kind its hops are summed under
    own: pb.Hop = field(default_factory=pb.Hop)  # stage 0's part of the frame
    posted_at: float = 0.0  # onto the link: the round trip the hops divide counts from here
    hops: tuple[pb.Hop, ...] = ()  # the later stages' parts of the frame, as its reply carried them
    pace: float | None = None  # set by the loop: seconds after the frame before it left, both in one burst
    targets: tuple[int, ...] = ()  # a scored prompt's: the tokens whose logprobs this frame's rows report
    earlier: tuple[Pending, ...] = ()  # a scored prompt's earlier chunks, each answered on its own
    offered: Offered | None = None  # drafts the final stage proposed with its reply

    @property
    def scored(self) -> int:
        """The scored rows `Pipeline.wait` gives first, before the sampled ones: every chunk's."""
        return sum(len(p.targets) for p in (*self.earlier, self))

    @property
    def key(self) -> tuple[SessionId, FrameId]:
        return self.session, self.frame

    def _answered(self, _: object) -> None:
        self.answered_at = time.perf_counter()


def _tokens_of(reply: pb.FrameHeader) -> list[Sampled]:
    """The sampled tokens of the final stage's answer; its ERROR fails the request."""
    if reply.kind == pb.ERROR:
        raise StageFailedError(reply.message)
    try:
        return sampled_of(reply)
    except ValueError as exc:
        raise StageFailedError(str(exc)) from None


@dataclass(frozen=True)
class PipelineOptions:
    """How stage 0's pipeline runs (the route keeper's settings, mesh/routing/keeper.py)."""

    wire_dtype: int = pb.F32  # hidden states on the wire
    chunk: int = 128  # rows a frame feeds at most; a longer input goes in several
    micro_batches: int = 1  # session groups stage 0 computes apart (DESIGN.md §3)
    prefix_cache: bool = True  # a finished request's tokens stay in its lane (DESIGN.md §2)
    # Some stage's layers keep recurrent state (None: stage 0's do), which rolls back only to a
    # checkpoint (stage/checkpoints.py): the prefix cache is then exact, and a session keeps at
    # most `most_in_flight` frames out, within the checkpoints kept.
    recurrent: bool | None = None
    # The final stage drafts with the model's MTP layers: every frame carries its tokens, which
    # those layers read (stage/mtp_head.py).
    mtp: bool = False
    # What the stages' KV tiers keep (mesh/serving/kv_index.py), outliving the route; None: no tier.
    tier: TierIndex | None = None


class Pipeline:
    def __init__(self, engine: RangeEngine, link: Link | None, replies: Link | None = None,
                 hops: HopTotals | None = None, on_break: Callable[[str], None] | None = None,
                 options: PipelineOptions = PipelineOptions()) -> None:
        """`link` goes to stage 1 (None: stage 0 is the whole model); `replies` comes back from
        the final stage, past the middle ones (direct return); `on_break` is told once, when
        the route breaks."""
        self.core = StageCore(engine, 0, options.wire_dtype, options.micro_batches)
        recurrent = options.recurrent
        if recurrent is None:
            recurrent = getattr(engine, "recurrent", None) is not None
        self.cache = PrefixCache(exact=recurrent, index=options.tier) if options.prefix_cache else None
        self.begins: dict[LaneId, Begin] = {}  # what a lane's next first frame asks of the later stages
        self.most_in_flight = DEPTH - 1 if recurrent else None
        self.link = link
        self.reply_link = replies  # to the final stage, past the middle ones (direct return)
        self.chunk = options.chunk
        self.hops = hops or HopTotals()
        self.watch = ReplyWatch(self.hops)  # how long each reply is waited for
        self.on_break = on_break  # told once, when the route breaks: the coordinator heals it
        self.frames = itertools.count(1)  # frame ids, one per frame sent
        self.waiters: dict[tuple[SessionId, FrameId], Pending] = {}  # frames sent, their replies awaited
        self.broken: str | None = None
        self.tasks = TaskScope("pipeline")  # the route's own: its reply readers
        self.mtp = options.mtp

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
        if self.cache is not None:
            self.cache.close()  # the stages file their free lanes as they stop
        for link in (self.link, self.reply_link):
            if link:
                link.close()
        # set before `fail`, which tells on_break of a first break only
        self.broken = self.broken or "the route was stopped"
        self.fail(self.broken)
        await self.core.stop()

    def open(self, session: SessionId, prefer: LaneId | None = None) -> LaneId:
        """The session's lane at stage 0, taken once per request and freed by `end`; a resumed
        request asks for its old lane, where the draft's KV still holds its tokens."""
        return self.core.lane_for(session, prefer)

    def lease(self, session: SessionId, prompt: Sequence[int] = (), prefer: LaneId | None = None) -> Lease:
        """`open`, choosing the lane by the prefix cache: the free lane that holds most of
        `prompt` already, else the least recently used (`prefer`, if given, goes first)."""
        free = self.core.lanes.free
        if self.cache is None or not free or self.core.lanes.by_session.get(session) is not None:
            return Lease(session, self.open(session, prefer))
        taken = self.cache.take(prompt, free, prefer if prefer in free else None)
        lane = self.open(session, LaneId(taken.lane))
        begin_lane(self.core, lane, taken.begin)  # queued ahead of the request's first step here
        if taken.begin:
            self.begins[lane] = taken.begin  # and told the later stages by its first frame
        return Lease(session, lane, taken.cached, taken.begin.restore)

    async def send(self, session: SessionId, lane: LaneId, out: Outgoing) -> Pending:
        """Feed the frame's tokens up to the point where it has left stage 0; `wait` gives its
        tokens, so several frames of a session can be in flight (DESIGN.md §6). Its epoch tags
        it: a stage skips a session's queued frames of an older epoch than the newest it saw."""
        sent_at = time.perf_counter()
        if self.broken:
            raise MeshUnavailableError(self.broken)
        tokens, all_logits, epoch = out.tokens, out.all_logits, out.epoch
        if all_logits and len(tokens) > self.chunk:  # rows are sampled from the last chunk only
            raise ValueError(f"a frame of {len(tokens)} rows exceeds the chunk of {self.chunk}")
        pieces = [tokens[i : i + self.chunk] for i in range(0, len(tokens), self.chunk)]
        pos = out.start
        for piece in pieces[:-1]:  # a long input's earlier chunks go on unanswered
            work, hidden = await self._compute(Step(lane, pos, tokens=np.asarray(piece, dtype=np.int32)))
            if self.link is not None:
                header = _begun(compute_frame(session, FrameId(next(self.frames)), lane, pos, epoch), self.begins)
                await self._forward(_fed(header, piece, self.mtp), work, hidden)
            pos += len(piece)
        last = pieces[-1]
        work, rows = await self._compute(Step(lane, pos, tokens=np.asarray(last, dtype=np.int32),
                                              all_logits=all_logits))
        frame = FrameSampling.for_rows(out.sampling, out.history, tokens, len(last) if all_logits else 1, out.masks,
                                       out.proposed)
        header = compute_frame(session, FrameId(next(self.frames)), lane, pos, epoch, Asks(out.kind, frame, all_logits))
        header.propose = out.propose if self.mtp else 0
        _begun(header, self.begins)
        _fed(header, last, self.mtp)
        pending = Pending(session, FrameId(header.frame_id), epoch, sent_at, None, rows=len(tokens), kind=out.kind,
                          ahead=_rows_out(self.waiters))
        self.hops.rows_sent += len(tokens)
        if self.link is None:
            return await self._answer_here(pending, header, work, rows, frame, len(last))
        await self._forward(header, work, rows, pending)
        return pending

    async def score(self, session: SessionId, lane: LaneId, out: Outgoing) -> Pending:
        """Feed a whole prompt (the frame, at position 0) as `send` would, every row's logits
        computed: each row reports the logprob of the prompt's next token (a scored row), and
        the last row samples the first token. Each chunk asks for its own reply, since the final
        stage keeps nothing between frames; `wait` gives every chunk's scored rows, then the token."""
        sent_at = time.perf_counter()
        if self.broken:
            raise MeshUnavailableError(self.broken)
        assert out.start == 0, "a prompt to score is fed whole"
        tokens, sampling, epoch, masks = out.tokens, out.sampling, out.epoch, out.masks
        chunks: list[Pending] = []
        for pos in range(0, len(tokens), self.chunk):
            piece = tokens[pos : pos + self.chunk]
            last = pos + len(piece) == len(tokens)
            # each row's next prompt token; the prompt's last row has none: it is sampled
            frame = FrameSampling(sampling, masks=tuple(masks) if last else (),
                                  targets=tuple(tokens[pos + 1 : pos + len(piece) + 1]))
            work, rows = await self._compute(Step(lane, pos, tokens=np.asarray(piece, dtype=np.int32),
                                                 all_logits=True))
            header = _begun(compute_frame(session, FrameId(next(self.frames)), lane, pos, epoch,
                                          Asks(pb.PREFILL, frame, True)), self.begins)
            # its own rows: the reply deadline learns a frame's time by its rows, and a void counts them
            chunk = Pending(session, FrameId(header.frame_id), epoch, sent_at, None, rows=len(piece),
                            kind=pb.PREFILL, targets=frame.targets, ahead=_rows_out(self.waiters))
            if self.link is None:
                await self._answer_here(chunk, header, work, rows, frame, len(piece))
            else:
                await self._forward(_fed(header, piece, self.mtp), work, rows, chunk)
            chunks.append(chunk)
        self.hops.rows_sent += len(tokens)
        chunks[-1].earlier = tuple(chunks[:-1])
        return chunks[-1]

    async def wait(self, pending: Pending) -> list[Sampled]:
        """The tokens of a frame `send` sent; of one `score` sent, every chunk's scored rows first."""
        got: list[Sampled] = []
        for p in (*pending.earlier, pending):
            if p.reply is None:
                assert p.local is not None
                answered = p.local
            else:
                if self.broken and not p.reply.done():  # no reply can come any more
                    raise MeshUnavailableError(self.broken)
                try:
                    answered = _tokens_of(await self.watch.reply(p.reply, p.rows + p.ahead, p.left_at))
                except StalledError as exc:
                    self.fail(str(exc))
                    raise MeshUnavailableError(self.broken) from None
            if [s.token for s in answered[: len(p.targets)]] != list(p.targets):
                raise StageFailedError("a reply's scored rows are not the tokens the frame asked for")
            got += answered
        return got

    def void(self, pending: Pending) -> None:
        """Forget a frame whose reply can no longer count: it is dropped when it comes."""
        for chunk in pending.earlier:
            self.void(chunk)
        self.waiters.pop(pending.key, None)
        self.hops.rows_voided += pending.rows
        if pending.reply is not None:
            if pending.reply.done() and not pending.reply.cancelled():
                pending.reply.exception()  # retrieved: a void frame's failure is nobody's error
            pending.reply.cancel()

    async def _compute(self, step: Step) -> tuple[Work, np.ndarray]:
        """Run one chunk through stage 0's layers: its hidden states, or logits at a final stage 0."""
        work = self.core.submit(step)
        try:
            return work, await work.output
        except EngineError:
            if self.broken:  # stopped under us: the route broke, and the caller may resume
                raise MeshUnavailableError(self.broken) from None
            raise

    async def _answer_here(self, pending: Pending, header: pb.FrameHeader, work: Work, logits: np.ndarray,
                           frame: FrameSampling, rows: int) -> Pending:
        """Stage 0 holds the final layer: it answers its own frame as a remote final stage would."""
        reply = await with_drafts(self.core, header, self.core.answer(header, work, logits, frame, rows), frame,
                                  header.fed)
        pending.local = _tokens_of(reply)  # an ERROR fails the request, not the route
        pending.offered = offered_of(reply)
        self.hops.record(pending.kind, reply.timings.hops[-1])
        pending.answered_at = pending.left_at = time.perf_counter()
        return pending

    async def _forward(self, header: pb.FrameHeader, work: Work, hidden: np.ndarray,
                       pending: Pending | None = None) -> None:
        """Send a frame down the activation link; with `pending`, its reply is awaited."""
        assert self.link is not None
        encoded = self.core.encode(work, hidden)
        encoded.describe(header)
        if self.broken:  # it broke while this frame was computed: `fail` has failed every waiter already
            raise MeshUnavailableError(self.broken)
        if pending is not None:
            pending.own, pending.posted_at = encoded.hop, time.perf_counter()
            pending.reply = asyncio.get_running_loop().create_future()
            pending.reply.add_done_callback(pending._answered)
            self.waiters[pending.key] = pending
        self.hops.bytes_sent += len(encoded.data)
        try:
            await self.link.send(header, encoded.data)
        except ConnectionError as exc:
            if pending is not None and pending.reply is not None:  # nobody waits for it: the caller gets the error
                self.waiters.pop(pending.key, None)
                pending.reply.cancel()
            self.fail(f"activation link to stage 1 lost: {exc}")
            raise MeshUnavailableError(self.broken) from None
        if pending is not None:
            pending.left_at = time.perf_counter()

    async def end(self, session: SessionId, keep: Sequence[int] = ()) -> None:
        """Free the session's lane here and on every stage. With the prefix cache, `keep` (the
        tokens every stage's KV surely holds, the record's `computed`) stays in the lane for a later
        request; the rest of its KV is dropped."""
        lane = self.core.lanes.by_session.get(session)
        keep = keep if self.cache is not None and lane is not None else ()
        stash = self.cache.stash_key(keep) if self.cache is not None else ""
        # END leaves before the lane is free here: a later request's frames for this lane
        # must reach every stage after it, or the stage would find the lane still taken
        # (the send is queued before it drains, so END leaves first even when a slow link's
        # drain outlasts the caller's bound and cancels this: the lane is freed here regardless)
        try:
            if self.link is not None and not self.broken:
                with contextlib.suppress(ConnectionError):
                    await self.link.send(pb.FrameHeader(session_id=session, kind=pb.END, keep=len(keep),
                                                        stash=stash))
        finally:
            trim = self.core.release(session, len(keep), stash)
            if self.cache is not None and lane is not None:
                self.cache.keep(lane, keep)
        if trim is not None:
            with contextlib.suppress(Exception):
                await trim

    async def _read_replies(self, link: Link, name: str) -> None:
        try:
            while True:
                header, _ = await link.recv()
                key = (SessionId(header.session_id), FrameId(header.frame_id))
                pending = self.waiters.get(key)
                if pending is None or header.epoch != pending.epoch:
                    continue  # a void frame's reply, or one of another epoch: it never counts
                del self.waiters[key]
                _deliver(pending, header, self.hops, self.watch)
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
        for pending in self.waiters.values():
            if pending.reply is not None and not pending.reply.done():
                pending.reply.set_exception(MeshUnavailableError(reason))
        self.waiters.clear()

def unrestored(pipeline: Pipeline, lane: LaneId, restored: str) -> None:
    """The lane's request is prefilled again without its restore: a first frame that has not
    left yet still files what the lane held on the later stages, and loads nothing. An entry
    that was to stay in the tier (`Begin.keep`) is gone from some stage: the index forgets it."""
    begin = pipeline.begins.get(lane)
    if begin is not None:
        pipeline.begins[lane] = Begin(evict=begin.evict)
    if restored and pipeline.cache is not None and pipeline.cache.index is not None:
        pipeline.cache.index.remove(restored)


def _begun(header: pb.FrameHeader, begins: dict[LaneId, Begin]) -> pb.FrameHeader:
    """`header`, the lane's first frame of a request, with what the stages do to the lane first."""
    begin = begins.pop(LaneId(header.lane), None)
    if begin is not None:
        header.evict, header.restore, header.restore_positions = begin.evict, begin.restore, begin.positions
        header.restore_keep = begin.keep
    return header


def _fed(header: pb.FrameHeader, tokens: Sequence[int], mtp: bool) -> pb.FrameHeader:
    """`header`, with the tokens it feeds where the final stage's MTP layers read them."""
    if mtp:
        header.fed.extend(tokens)
    return header


def _deliver(pending: Pending, header: pb.FrameHeader, hops: HopTotals, watch: ReplyWatch) -> None:
    if pending.reply is None or pending.reply.done():
        return
    if header.kind == pb.REPLY:
        round_trip = time.perf_counter() - pending.posted_at
        hops.record(pending.kind, pending.own, header.timings.hops, round_trip)
        pending.hops = tuple(header.timings.hops)
        pending.offered = offered_of(header)
        watch.observe(pending.rows, round_trip)
    else:
        watch.progressed()  # an ERROR frame: the stages answer
    pending.reply.set_result(header)


def _rows_out(waiters: dict[tuple[SessionId, FrameId], Pending]) -> int:
    """Rows of the frames sent and not yet answered: what a frame sent now queues behind."""
    return sum(p.rows for p in waiters.values())


async def round_trip(pipeline: Pipeline, session: SessionId, lane: LaneId, out: Outgoing) -> list[Sampled]:
    """One frame there and back: the sampled next token, or one per row of a window. `lane` is
    the one `open(session)` gave. The frame's `history` is the completion the penalties count
    at the first sampled row, that row's token included; the later rows extend it with the
    tokens fed before them. A prompt has none: only the completion is penalised."""
    return await pipeline.wait(await pipeline.send(session, lane, out))
