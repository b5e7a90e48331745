"""The generate loop at stage 0, with or without a proposer (DESIGN.md §6).

A proposer is the draft model, prompt lookup, or both (mesh/speculative/proposer.py); "the
draft" below is whichever proposed. Its proposals are one long window, sent as frames. `seq` is the optimistic
sequence: the committed tokens, then every draft sent and not yet verified. A frame feeds
`seq[sent:]` plus k new drafts at position `sent`: the first frame of an epoch feeds
[last, d1..dk], where `last` is committed but in no KV yet; later ones feed only drafts.
While frames are out (up to `in_flight`, and as many as the window controller's `depth`
finds worth it), the draft goes on as if all were accepted.

The final stage samples the target's token at every row; row j of a frame predicts the
position after it. Replies come back in order, and each commits the target's tokens while
they equal what `seq` holds there. At the first difference the target's token is
committed, every frame in flight is void, and the epoch goes up: the next frame starts at
the committed position, which trims every stage's KV (and the draft's); stages drop queued
frames of the old epoch unrun, and stage 0 drops their replies. With k = 0 a frame is a
plain decode step, and nothing else is ever in flight; so is a round where the proposer
found nothing to propose (prompt lookup without a match).

The prefill starts where the lane's cached prefix ends (`Lease.cached`). After it, every
stage's KV surely holds the committed tokens but the last (each was fed by a frame whose
reply came back; later positions may hold void drafts), and the loop keeps `Lease.held` at
that, so the session's end leaves it for the next request on the lane.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

from common.sampling import Sampled
from mesh.backend import Acceptance, Finished, GenerationEvent, GenerationRequest
from mesh.pipeline import Lease, Pending, Pipeline
from mesh.speculative.draft import common_prefix
from mesh.speculative.proposer import Proposal, Proposer
from mesh.speculative.window import Controller
from proto import meshpipe_pb2 as pb


@dataclass(frozen=True)
class _Frame:
    pending: Pending
    start: int  # the position of its first row; row j predicts start + j + 1
    first: int  # the position of its first draft
    drafts: int
    alone: bool  # nothing else was in flight: its round trip is what one verify pass costs
    by: str  # the proposer of its drafts ("" for none)
    seconds: float  # what proposing them cost


# One window controller for every proposer, or one per proposer name: prompt lookup and the
# draft model differ in what a proposal costs and in how often it is accepted.
Windows = Controller | Mapping[str, Controller]


async def generate(pipeline: Pipeline, lease: Lease, req: GenerationRequest, ctx: int,
                   draft: Proposer | None = None, window: Windows | None = None,
                   in_flight: int = 1) -> AsyncIterator[GenerationEvent]:
    """The events of one generation, as `Backend.generate` documents them. `draft` is the
    proposer. `in_flight` bounds the verify frames out at once (1: each frame waits for the
    reply to the one before)."""
    session, lane, cached = lease.session, lease.lane, lease.cached
    stops = set() if req.ignore_eos else set(req.stop_tokens)
    limit = max(in_flight, 1) if draft is not None else 1
    primary = _controller(window, draft.names[0]) if window is not None and draft is not None else None
    tokens = [*req.prompt, *req.done]  # committed; the last one is in no KV yet
    targets = await pipeline.run(session, lane, cached, list(req.prefill[cached:]), req.sampling, kind=pb.PREFILL)
    lease.held = tuple(tokens[: len(tokens) - 1])
    if req.done:  # resumed on a new route: the KV is rebuilt, and the next token was drawn already
        targets = []
    acceptance = Acceptance() if draft is not None else None
    if acceptance is not None:
        yield acceptance  # with a draft, every token comes after a record that counts its window
    seq: list[int] = []
    sent = epoch = 0
    frames: deque[_Frame] = deque()
    answered: _Frame | None = None  # the frame `targets` answers (None: the prefill)
    try:
        while True:
            # commit the targets while they match what was sent after them; row j predicts `predicts + j`
            predicts = answered.start + 1 if answered else len(tokens)
            checked = max(0, min(len(targets), len(seq) - predicts))  # rows with a draft sent after them
            n = common_prefix(seq[predicts:], [s.token for s in targets])
            miss = predicts + n if n < checked else None  # the position where the target parted
            # a window is a frame: its drafts, and those accepted; the next one counts here
            # only when its first draft, checked by this reply's last row, was rejected
            settled = [answered] if answered else []  # a plain decode too: the controllers time it
            if miss is not None and frames and frames[0].first == miss:
                settled.append(frames[0])
            for frame in settled:
                accepted = frame.drafts if miss is None else max(0, min(frame.drafts, miss - frame.first))
                if window is not None:
                    _record(window, frame, accepted)
                if acceptance is not None:
                    acceptance = acceptance.add(frame.drafts, accepted, frame.by)
            if miss is not None:  # all sent beyond is void
                targets = targets[: n + 1]
                for frame in frames:
                    pipeline.void(frame.pending)
                frames.clear()
                epoch += 1
            events: list[GenerationEvent] = []
            if acceptance is not None and any(frame.drafts for frame in settled):
                events.append(acceptance)  # before the tokens this reply produced
            events += _commit(targets, tokens, stops, req, acceptance)
            lease.held = tuple(tokens[: len(tokens) - 1])
            if events and isinstance(events[-1], Finished):
                for event in events:
                    yield event
                return
            if not frames:  # a new epoch, or all verified: go on from the last committed token
                seq, sent = list(tokens), len(tokens) - 1
            # send frames until enough are out, drafting on as if every proposal is accepted
            while len(frames) < (primary.depth(limit) if primary else limit):
                # the window is bounded by context and budget, counting the drafts in flight
                room = min(ctx - len(seq), req.max_tokens - (len(seq) - len(req.prompt))) - 1
                proposal = await _propose(draft, window, lane, seq, room)
                drafts = proposal.tokens
                if frames and not drafts:
                    break  # a frame of no drafts needs the target's token first
                seq += drafts
                # the penalties count the completion only: from the prompt's end to the frame's first token
                history = seq[len(req.prompt) : sent + 1] if req.sampling.penalised else ()
                pending = await pipeline.send(session, lane, sent, seq[sent:], req.sampling,
                                              all_logits=bool(drafts), kind=pb.VERIFY if drafts else pb.DECODE,
                                              history=history, epoch=epoch)
                frames.append(_Frame(pending, sent, len(seq) - len(drafts), len(drafts), alone=not frames,
                                     by=proposal.by, seconds=proposal.seconds))
                sent = len(seq)
            for event in events:  # the next frame is on its way: the caller's work on these overlaps it
                yield event
            answered = frames.popleft()
            targets = await pipeline.wait(answered.pending)
    finally:
        for frame in frames:  # a stop, the length limit, an error or the caller leaving
            pipeline.void(frame.pending)


def _commit(targets: list[Sampled], tokens: list[int], stops: set[int], req: GenerationRequest,
            acceptance: Acceptance | None) -> list[GenerationEvent]:
    """Append a reply's tokens to `tokens` up to a stop token or the length limit; the
    events to yield, each token with the target's numbers for its position (its verify row
    drew it), ending with Finished when the generation is over."""
    events: list[GenerationEvent] = []
    for sampled in targets:
        if sampled.token in stops:
            return [*events, Finished("stop", len(req.prompt), len(tokens) - len(req.prompt), acceptance)]
        tokens.append(sampled.token)
        events.append(sampled)
        if len(tokens) - len(req.prompt) >= req.max_tokens:
            return [*events, Finished("length", len(req.prompt), len(tokens) - len(req.prompt), acceptance)]
    return events


async def _propose(draft: Proposer | None, window: Windows | None, lane: int, seq: list[int],
                   room: int) -> Proposal:
    """The drafts for the next frame; each proposer's window is its controller's, within `room`."""
    if draft is None or window is None or room < 1:
        return Proposal([], "", 0.0)
    return await draft.proposal(lane, seq, lambda name: max(0, min(_controller(window, name).next_window(), room)))


def _controller(window: Windows, name: str) -> Controller:
    return window[name] if isinstance(window, Mapping) else window


def _record(window: Windows, frame: _Frame, accepted: int) -> None:
    """What a settled frame tells its proposer's window controller: its drafts, those
    accepted, what proposing them cost, the cost of a verify pass, measured only on frames
    that had the pipeline to themselves, and stage 0's own time for it (`send`), which
    frames in flight cannot overlap. A frame of no drafts is a plain decode, the cost every
    controller compares against, so each hears of it."""
    p = frame.pending
    verify_s = p.answered_at - p.sent_at if frame.alone and p.answered_at else None
    if frame.drafts:
        controllers = [_controller(window, frame.by)]
    else:
        controllers = list({id(c): c for c in window.values()}.values()) if isinstance(window, Mapping) else [window]
    for controller in controllers:
        controller.record(frame.drafts, accepted, frame.seconds, verify_s, p.left_at - p.sent_at)
