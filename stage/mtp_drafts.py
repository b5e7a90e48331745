"""What a final stage with MTP layers proposes with its reply (DESIGN.md §6, issue 56).

A frame that asks for drafts (`FrameHeader.propose`) gets them in its REPLY: the MTP layer
drafts on from the last token the reply commits, as stage 0 will read the reply, so the
drafts are the next frame's window. Stage 0 checks they continue its sequence
(`proposed_at`); a reply it reads otherwise (a rejection it saw first) just goes unused.

Greedy and exact-match requests get the MTP layer's likeliest token. A request accepted by
rejection sampling gets a token drawn from the MTP row processed as the target's (bias,
temperature, top-k, top-p; stage/distribution.py), cut to its TOP tokens, and that q with it:
rejection sampling needs the draft drawn from exactly the q it is sent with, nothing more,
so penalties and a grammar's mask, which stage 0 holds, are left out here (a draft the grammar
forbids is cut from the window there; one the target would never draw is rejected here).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np

from common.errors import EngineError
from common.ids import SessionId
from common.sampling import Proposed
from proto import meshpipe_pb2 as pb
from stage.core import StageCore
from stage.frames import FrameSampling
from stage.mtp_head import Choose
from stage.rejection import drawn
from stage.sampling import processed_rows

log = logging.getLogger("meshpipe.stage")


def committed_last(start: int, fed: Sequence[int], picks: Sequence[int], all_logits: bool,
                   checks_first: bool) -> tuple[int, int] | None:
    """(position, token) of the last token a reply commits, as stage 0 applies it: a frame fed
    `fed` at `start`, its rows sampled as `picks` (every row's with `all_logits`, a first one
    more where the frame `checks_first`). Each fed draft stands while the row before it
    sampled it; the token after the last that stands is the target's."""
    if not picks or not fed:
        return None
    if not all_logits:
        return start + len(fed), picks[-1]
    if checks_first:
        if picks[0] != fed[0]:
            return start, picks[0]
        picks = picks[1:]
    kept = 1
    while kept < len(fed) and kept <= len(picks) and fed[kept] == picks[kept - 1]:
        kept += 1
    return (start + kept, picks[kept - 1]) if kept <= len(picks) else None


def chooser(frame: FrameSampling) -> Choose:
    """How the MTP layer's row becomes a draft for this frame's request."""
    params = frame.params
    if not params.rejects or params.greedy:
        return _likeliest
    return lambda logits, position: drawn(processed_rows(logits[None, :], params)[0], params, position)


def _likeliest(logits: np.ndarray, _: int) -> Proposed:
    return Proposed(int(np.argmax(logits)))



async def with_drafts(core: StageCore, h: pb.FrameHeader, reply: pb.FrameHeader, frame: FrameSampling,
                      fed: Sequence[int]) -> pb.FrameHeader:
    """`reply` to frame `h` (which fed `fed`), with up to `h.propose` drafts from the MTP layer
    when the stage has one: drafted on the engine thread, in order with the steps queued there."""
    draft = getattr(core.engine, "mtp_draft", None)
    if not h.propose or reply.kind != pb.REPLY or draft is None or frame.targets:
        return reply
    at = committed_last(h.start_pos, fed, list(reply.tokens), h.all_logits, frame.checks_first)
    if at is None:
        return reply
    position, token = at
    lane = core.lanes.by_session.get(SessionId(h.session_id))
    if lane is None:
        return reply
    out: list[Proposed] = []
    took = [0.0]

    def run() -> None:  # timed on the engine thread: the frames queued ahead of it are not its cost
        began = time.perf_counter()
        out.extend(draft(lane, position, token, min(h.propose, core.engine.ctx_per_lane - position - 1),
                         chooser(frame)))
        took[0] = time.perf_counter() - began

    try:
        await core.batcher.control(run)
    except EngineError as exc:  # the reply stands without drafts: they only ever save time
        log.warning("stage %d: MTP drafting failed: %s", core.index, exc)
        return reply
    reply.propose_us = int(took[0] * 1e6)
    reply.proposed_at = position + 1
    reply.proposals.extend(pb.Proposed(token=d.token, ids=d.ids, weights=d.weights) for d in out)
    return reply
