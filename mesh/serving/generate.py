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

Speculation plugs in below the loop (mesh/serving/proposals.py): it asks for the next frame's
drafts and how many frames may be out, and tells what each settled frame cost.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator
from dataclasses import replace

from common.sampling import Sampled
from mesh.backend import MeshUnavailableError, PromptLogprobs
from mesh.constraints.guide import Guide, frame_masks
from mesh.serving.pipeline import Lease, Pending, Pipeline
from mesh.serving.proposals import NO_PROPOSER, NOTHING, Proposals, Proposing
from mesh.serving.request_state import Live


async def generate(pipeline: Pipeline, lease: Lease, live: Live, ctx: int, with_: Proposing = NO_PROPOSER
                   ) -> AsyncIterator[Sampled | PromptLogprobs]:
    """The tokens of one generation on one route, as `Backend.generate` documents them (the
    prompt's logprobs first, when asked); the record in `live` moves with every frame."""
    live.state = live.state.leased(lease.lane, lease.cached)
    constraint = live.state.req.constraint
    guide = Guide(constraint) if constraint is not None else None
    by = Proposals(with_.draft, with_.window, guide, with_.forced, with_.in_flight, with_.bounded)
    out: deque[Pending] = deque()  # the frames in flight, as `live.state.frames` counts them
    ready: tuple[Sampled | PromptLogprobs, ...] = ()
    try:
        while True:
            broke: MeshUnavailableError | None = None
            try:
                await _send(pipeline, lease, live, out, by, ctx)
            except MeshUnavailableError as exc:  # what is committed is the target's: hand it on, then resume
                broke = exc
            for event in ready:  # the next frame is on its way: the caller's work overlaps it
                if isinstance(event, Sampled):
                    live.state = live.state.delivered_one()
                yield event
            if broke is not None:
                raise broke
            if live.state.finish is not None:
                return
            ready = await _apply(pipeline, live, out, by)
    finally:
        for pending in out:  # a stop, the length limit, an error or the caller leaving
            pipeline.void(pending)


async def _send(pipeline: Pipeline, lease: Lease, live: Live, out: deque[Pending], by: Proposals, ctx: int) -> None:
    """Propose and send frames until as many are out as `by` allows, drafting on as if every
    proposal is accepted. A frame sent right after another in this burst is stamped with
    stage 0's pace: what its proposal and stage 0's work on it took, with frames ahead, as the
    wall clock saw it."""
    before: Pending | None = None
    depth = by.depth()
    while live.state.finish is None and len(out) < depth:
        s = live.state
        proposal = await by.propose(s, ctx) if s.can_draft else NOTHING
        if out and not proposal.tokens:
            return  # a frame of no drafts needs the target's token first
        live.state, frame = s.send(proposal.tokens, proposal.by, proposal.seconds)
        masks = () if by.guide is None else frame_masks(by.guide, live.state.sequence, len(s.req.prompt),
                                                        frame.start, frame.tokens, frame.drafts)
        frame = replace(frame, masks=tuple(masks), proposed=proposal.proposed() if s.req.sampling.rejects else (),
                        propose=by.asks(live.state, ctx))
        # leased with nothing cached (RequestState.leased), a prompt to score is fed from 0, no drafts
        send = pipeline.score if s.scoring else pipeline.send
        out.append(await send(lease.session, lease.lane, frame))
        if before is not None and frame.drafts:
            out[-1].pace = out[-1].left_at - before.left_at
        before = out[-1]


async def _apply(pipeline: Pipeline, live: Live, out: deque[Pending], by: Proposals
                 ) -> tuple[Sampled | PromptLogprobs, ...]:
    """Await the oldest frame's reply and apply it; what it gave: the prompt's logprobs, if it
    scored them, and the tokens it committed."""
    before = live.state
    got = await pipeline.wait(out[0])
    scores, got = tuple(got[: out[0].scored]), got[out[0].scored :]
    live.state, reply = before.apply(got, out[0].epoch)
    scored = (PromptLogprobs(scores),) if before.scoring and out[0].epoch == before.epoch else ()
    if scored:
        live.state = live.state.prompt_scored()
    if reply.settled:
        by.settled(reply.settled, out, len(reply.committed))
    by.offered(live.state.lane, out[0])
    out.popleft()
    if live.state.epoch != before.epoch or live.state.finish is not None:
        while out:  # all sent beyond is void
            pipeline.void(out.popleft())
    return (*scored, *reply.committed)
