"""The generate loop at stage 0: propose, send, await, apply (DESIGN.md §2, §6).

The request's record (mesh/serving/request_state.py) decides everything: what the next frame feeds,
what a reply commits, what is void. This loop only moves frames. A proposer is the draft
model, prompt lookup, or both (mesh/speculative/proposer.py); its drafts ride on a frame once
only the last committed token is left to feed. While frames are out (up to `in_flight`, and
as many as the window controller's `depth` finds worth it) it drafts on as if every draft
were accepted. A reply's tokens are handed on after the next frame has left, so the
caller's work on them overlaps the pipeline.

A constrained request (mesh/constraints/) has a guide: its grammar's matcher, moved to the
sequence each frame is built from. Forced tokens are proposed before any proposer runs,
every proposal is one the grammar allows, and each frame carries one mask per sampled row.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

from common.sampling import Sampled
from mesh.backend import MeshUnavailableError
from mesh.constraints.guide import Guide, frame_masks
from mesh.reports.hop_timing import hop_parts
from mesh.serving.pipeline import Lease, Pending, Pipeline
from mesh.serving.request_state import Frame, Live, RequestState
from mesh.speculative.forced import FORCED, forced_proposal
from mesh.speculative.proposer import Proposal, Proposer
from mesh.speculative.window import Controller, Observation, Since
from proto import meshpipe_pb2 as pb

# One window controller for every proposer, or one per proposer name: prompt lookup and the
# draft model differ in what a proposal costs and in how often it is accepted.
Windows = Controller | Mapping[str, Controller]
_NOTHING = Proposal([], "", 0.0)


async def generate(pipeline: Pipeline, lease: Lease, live: Live, ctx: int, draft: Proposer | None = None,
                   window: Windows | None = None, in_flight: int = 1, forced: bool = True
                   ) -> AsyncIterator[Sampled]:
    """The tokens of one generation on one route, as `Backend.generate` documents them; the
    record in `live` moves with every frame. `in_flight` bounds the frames out at once;
    `forced`: a constrained request's forced tokens are proposed."""
    live.state = live.state.leased(lease.lane, lease.cached)
    constraint = live.state.req.constraint
    guide = _Guided(Guide(constraint), forced) if constraint is not None else None
    limit = max(in_flight, 1) if draft is not None else 1
    primary = _controller(window, draft.names[0]) if window is not None and draft is not None else None
    out: deque[Pending] = deque()  # the frames in flight, as `live.state.frames` counts them
    ready: tuple[Sampled, ...] = ()
    last = _Last()
    try:
        while True:
            broke: MeshUnavailableError | None = None
            try:
                await _fill(pipeline, lease, live, out, _Proposers(draft, window, guide), ctx,
                            primary.depth(limit) if primary else limit)
            except MeshUnavailableError as exc:  # what is committed is the target's: hand it on, then resume
                broke = exc
            for sampled in ready:  # the next frame is on its way: the caller's work overlaps it
                live.state = live.state.delivered_one()
                yield sampled
            if broke is not None:
                raise broke
            if live.state.finish is not None:
                return
            ready = await _answer(pipeline, live, out, window, last)
    finally:
        for pending in out:  # a stop, the length limit, an error or the caller leaving
            pipeline.void(pending)


@dataclass
class _Last:
    """The session's last reply: when it came and what kind of frame it answered (`_kind`)."""

    at: float = 0.0
    kind: str = ""


def _kind(frame: Frame) -> str:
    """A verify frame, a plain decode, or neither (a prefill, forced tokens): a reply's time
    since the one before is a decode's cost when both answered decodes (`Since`)."""
    if frame.by == FORCED:
        return ""
    return "verify" if frame.drafts else "plain" if frame.rows == 1 else ""


@dataclass(frozen=True)
class _Guided:
    guide: Guide
    forced: bool  # its forced tokens are proposed


@dataclass(frozen=True)
class _Proposers:
    """What proposes a frame's drafts: the proposer and its windows, and a constrained
    request's guide."""

    draft: Proposer | None
    window: Windows | None
    guided: _Guided | None


async def _fill(pipeline: Pipeline, lease: Lease, live: Live, out: deque[Pending], by: _Proposers, ctx: int,
                depth: int) -> None:
    """Send frames until `depth` are out, drafting on as if every proposal is accepted. A
    frame sent right after another in this burst is stamped with stage 0's pace: what its
    proposal and stage 0's work on it took, with frames ahead, as the wall clock saw it."""
    before: Pending | None = None
    while live.state.finish is None and len(out) < depth:
        s = live.state
        proposal = await _propose(by, s, ctx) if s.can_draft else _NOTHING
        if out and not proposal.tokens:
            return  # a frame of no drafts needs the target's token first
        live.state, frame = s.send(proposal.tokens, proposal.by, proposal.seconds)
        masks = () if by.guided is None else frame_masks(by.guided.guide, live.state.sequence, len(s.req.prompt),
                                                           frame.start, frame.tokens, frame.drafts)
        kind = pb.VERIFY if frame.drafts else pb.DECODE if len(frame.tokens) == 1 else pb.PREFILL
        out.append(await pipeline.send(lease.session, lease.lane, frame.start, frame.tokens, s.req.sampling,
                                       all_logits=bool(frame.drafts), kind=kind, history=frame.history,
                                       epoch=live.state.epoch, masks=masks))
        if before is not None and frame.drafts:
            out[-1].pace = out[-1].left_at - before.left_at
        before = out[-1]


async def _answer(pipeline: Pipeline, live: Live, out: deque[Pending], window: Windows | None, last: _Last
                  ) -> tuple[Sampled, ...]:
    """Await the oldest frame's reply and apply it; the tokens it committed."""
    before = live.state
    live.state, reply = before.apply(await pipeline.wait(out[0]), out[0].epoch)
    if reply.settled:
        kind, at = _kind(reply.settled[0][0]), out[0].answered_at or time.perf_counter()
        # frames answer in order: one sent after the last reply had nothing ahead of it
        # (one at a time, or the first after a rejection voided the rest)
        alone = out[0].sent_at >= last.at
        since = Since(at - last.at, last.kind == kind, alone) if kind and last.kind else None
        last.at, last.kind = at, kind
        if window is not None:
            for i, ((frame, accepted), pending) in enumerate(zip(reply.settled, out, strict=False)):
                if _kind(frame):  # a prefill is no decode to price
                    timed = (len(reply.committed), since) if i == 0 else (0, None)
                    _record(window, frame, pending, accepted, *timed)
    out.popleft()
    if live.state.epoch != before.epoch or live.state.finish is not None:
        while out:  # all sent beyond is void
            pipeline.void(out.popleft())
    return reply.committed


async def _propose(by: _Proposers, state: RequestState, ctx: int) -> Proposal:
    """The drafts for the next frame: a grammar's forced tokens, else the proposer's, each
    proposer's window its controller's, within the room left."""
    room = state.room(ctx)
    guide = None
    if by.guided is not None and room >= 1:
        guide = by.guided.guide
        guide.sync(state.sequence[len(state.req.prompt):])
        if guide.done:
            return _NOTHING  # only an end token may follow: nothing to guess
        if by.guided.forced and (found := forced_proposal(guide, room)).tokens:
            return found
    window, draft = by.window, by.draft
    if draft is None or window is None or room < 1 or state.lane is None:
        return _NOTHING
    budget = lambda name: max(0, min(_controller(window, name).next_window(), room))  # noqa: E731
    if guide is None:
        return await draft.proposal(state.lane, list(state.sequence), budget)
    found = await draft.proposal(state.lane, list(state.sequence), budget, guide)
    # every proposer keeps to the grammar; this holds one that does not to it too
    return Proposal(found.tokens[: guide.legal(found.tokens)], found.by, found.seconds)


def _controller(window: Windows, name: str) -> Controller:
    return window[name] if isinstance(window, Mapping) else window


def _record(window: Windows, frame: Frame, p: Pending, accepted: int, tokens: int, since: Since | None) -> None:
    """What a settled frame tells its proposer's window controller. A frame of no drafts is a
    plain decode, the cost every controller compares against, so each hears of it."""
    if frame.drafts:
        controllers = [_controller(window, frame.by)]
    else:
        controllers = list({id(c): c for c in window.values()}.values()) if isinstance(window, Mapping) else [window]
    seen = observed(frame, p, accepted, tokens, since)
    for controller in controllers:
        controller.record(seen)


def observed(frame: Frame, p: Pending, accepted: int, tokens: int = 0, since: Since | None = None) -> Observation:
    """The frame's costs: stage 0's own time (`send`), each later stage's service time from
    the hops its reply carried, and what the round trip held beyond every stage's queue and
    service: the links; and what its reply committed, how long after the one before."""
    parts = [hop_parts(h) for h in p.hops]
    later = tuple(sum(part.values()) - part["queue"] for part in parts)
    links = None
    if p.answered_at and p.reply is not None:
        links = max(p.answered_at - p.left_at - sum(sum(part.values()) for part in parts), 0.0)
    return Observation(frame.drafts, accepted, frame.seconds, frame.rows, p.left_at - p.sent_at, later, links,
                       tokens, since, p.pace)
