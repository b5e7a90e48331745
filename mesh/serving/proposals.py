"""What the generate loop asks of speculation (mesh/serving/generate.py), behind one object: the
next frame's drafts, how many frames may be out, and what each settled frame cost.

Drafts come from a constrained request's forced tokens first (mesh/speculative/forced.py),
else from the proposer (a draft model, prompt lookup, or both), within the window its
controller allows. A settled frame's costs (stage 0's own time, each later stage's, the links,
the gap since the reply before) go to the window controllers (mesh/speculative/window.py),
which is how a cost-aware window learns the machine it runs on.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from mesh.backend import WindowChoice
from mesh.constraints.guide import Guide
from mesh.reports.hop_timing import hop_parts
from mesh.serving.pipeline import Pending
from mesh.serving.request_state import Frame, RequestState
from mesh.speculative.forced import forced_proposal
from mesh.speculative.ledger import Ledger
from mesh.speculative.proposer import Budget, DraftSampling, Proposal, Proposer, ask
from mesh.speculative.proposers import windowed
from mesh.speculative.window import Controller, Observation, Since

# One window controller for every proposer, or one per proposer name: prompt lookup and the
# draft model differ in what a proposal costs and in how often it is accepted.
Windows = Controller | Mapping[str, Controller]
NOTHING = Proposal([], "", 0.0)


@dataclass
class _Last:
    """The session's last reply: when it came and what kind of frame it answered (`_kind`)."""

    at: float = 0.0
    kind: str = ""


@dataclass(frozen=True)
class Proposing:
    """What a session proposes with: its proposer and window controllers (None: no
    speculation), the most frames it may keep out, and whether a constrained request's
    forced tokens are proposed."""

    draft: Proposer | None = None
    window: Windows | None = None
    in_flight: int = 1
    forced: bool = True
    bounded: bool = True  # the request's ledger bounds its windows (False: the start-up warm-up)


NO_PROPOSER = Proposing()


@dataclass
class Proposals:
    """One session's proposers and window controllers; `guide`: a constrained request's
    grammar, whose forced tokens are proposed when `forced`."""

    draft: Proposer | None = None
    window: Windows | None = None
    guide: Guide | None = None
    forced: bool = True
    in_flight: int = 1
    bounded: bool = True  # the request's ledger bounds the windows its controllers ask
    last: _Last = field(default_factory=_Last)
    # what speculation saved this request, which bounds what it may risk (ledger.py)
    ledger: Ledger = field(default_factory=lambda: Ledger(time.perf_counter()))

    def depth(self) -> int:
        """The frames that may be out at once: `in_flight`, or fewer where the primary
        proposer's controller finds more not worth it or the request's ledger cannot afford
        them; one without a proposer."""
        if self.draft is None:
            return 1
        limit = max(self.in_flight, 1)
        if self.window is None:
            return limit
        controller = _controller(self.window, self.draft.names[0])
        asked = controller.depth(limit)
        return self.ledger.allowed_depth(asked, time.perf_counter()) if self._ledgered(controller) else asked

    async def propose(self, state: RequestState, ctx: int) -> Proposal:
        """The drafts for the next frame: a grammar's forced tokens, else the proposer's, each
        proposer's window its controller's, within the room left."""
        room = state.room(ctx)
        guide = self.guide if room >= 1 else None
        if guide is not None:
            guide.sync(state.sequence[len(state.req.prompt):])
            if guide.done:
                return NOTHING  # only an end token may follow: nothing to guess
            if self.forced and (found := forced_proposal(guide, room)).tokens:
                return found
        window, draft = self.window, self.draft
        if draft is None or window is None or room < 1 or state.lane is None:
            return NOTHING
        budget = self._budget(window, room)
        params = state.req.sampling
        sampling = DraftSampling(params, len(state.req.prompt)) if params.rejects else None
        found = (await ask(draft, state.lane, list(state.sequence), budget, guide, sampling)).first(room)
        # every proposer keeps to the grammar; this holds one that does not to it too
        return found if guide is None else found.first(guide.legal(found.tokens))

    def asks(self, state: RequestState, ctx: int) -> int:
        """How many drafts the frame being sent asks the final stage to propose with its
        reply: a proposer that drafts there sizes them by its window (others ask none)."""
        asks, window = getattr(self.draft, "asks", None), self.window
        if asks is None or window is None or state.room(ctx) < 1 or state.lane is None:
            return 0
        room = state.room(ctx)
        return max(0, min(asks(state.lane, self._budget(window, room), self.depth()), room))

    def _budget(self, window: Windows, room: int) -> Budget:
        """Each proposer's window as its controller asks it, within the room left, cut to what
        the request's ledger can lose on it and on the proposer's catch-up, less what the
        catch-up is expected to earn back (`prospect`). A fixed window is the operator's,
        proposed whatever it costs."""

        def budget(name: str, catch_up: int = 0) -> int:
            controller = _controller(window, name)
            asked = max(0, min(controller.next_window(), room))
            if not self._ledgered(controller):
                return asked
            return self.ledger.allowed_window(asked, time.perf_counter(), catch_up, prospect(controller.choice, room))

        return budget

    def _ledgered(self, controller: Controller) -> bool:
        """Whether the request's ledger bounds this controller's windows: not a fixed one's,
        and not the start-up warm-up's (`bounded`)."""
        return controller.ledgered and self.bounded

    def offered(self, lane: int | None, pending: Pending) -> None:
        """What the final stage proposed with a reply, for the proposer that drafts there."""
        offered = getattr(self.draft, "offered", None)
        if offered is not None and lane is not None:
            offered(lane, pending.offered)

    def settled(self, frames: Sequence[tuple[Frame, int]], out: Sequence[Pending], committed: int) -> None:
        """A reply settled `frames` (each with its accepted drafts), the oldest of `out` first,
        and committed `committed` tokens: what each tells its proposer's window controller,
        and what the reply saved or cost, to the request's ledger (forced tokens too)."""
        kind, at = _kind(frames[0][0]), out[0].answered_at or time.perf_counter()
        # frames answer in order: one sent after the last reply had nothing ahead of it
        # (one at a time, or the first after a rejection voided the rest)
        alone = out[0].sent_at >= self.last.at
        since = Since(at - self.last.at, self.last.kind == kind, alone) if kind and self.last.kind else None
        # the controllers hear of a gap after a decode's reply only, as before forced tokens counted
        priced = since if self.last.kind != FORCED else None
        self.last.at, self.last.kind = at, kind
        if self.window is None:
            return
        for i, ((frame, accepted), pending) in enumerate(zip(frames, out, strict=False)):
            if not _kind(frame):  # a prefill is no decode to price
                continue
            seen = observed(frame, pending, accepted, *((committed, since) if i == 0 else (0, None)))
            self.ledger.heard(seen)
            if _kind(frame) != FORCED:  # no controller priced forced tokens
                _record(self.window, frame, replace(seen, since=priced if i == 0 else None))


VERIFY, PLAIN, FORCED = "verify", "plain", "forced"
# What a catch-up may count on earning back: half what a cost-aware controller that chose to
# speculate predicts it saves over this many tokens (or the room left, if less). Replies end
# at EOS long before max_tokens as often as not, and the prediction is other requests'.
PROSPECT_TOKENS = 64
PROSPECT_SHARE = 0.5


def prospect(choice: WindowChoice | None, room: int) -> float:
    """Seconds a proposer's catch-up may count on earning back (the ledger still charges it):
    none unless a cost-aware controller chose to speculate, its prediction beating a plain decode."""
    if choice is None or choice.window == 0 or choice.predicted_tok_s <= choice.plain_tok_s:
        return 0.0
    saved = 1 / choice.plain_tok_s - 1 / choice.predicted_tok_s
    return PROSPECT_SHARE * min(max(room, 0), PROSPECT_TOKENS) * saved


def _kind(frame: Frame) -> str:
    """A verify frame, a plain decode, forced tokens, or none (a prefill): a reply's time since
    the one before is a decode's cost when both answered decodes (`Since`)."""
    if frame.by and not windowed(frame.by):  # forced tokens: no controller priced them
        return FORCED if frame.drafts else ""
    return VERIFY if frame.drafts else PLAIN if frame.rows == 1 else ""


def _controller(window: Windows, name: str) -> Controller:
    return window[name] if isinstance(window, Mapping) else window


def _record(window: Windows, frame: Frame, seen: Observation) -> None:
    """What a settled frame tells its proposer's window controller. A frame of no drafts is a
    plain decode, the cost every controller compares against, so each hears of it."""
    if frame.drafts:
        controllers = [_controller(window, frame.by)]
    else:
        controllers = list({id(c): c for c in window.values()}.values()) if isinstance(window, Mapping) else [window]
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
        # what the final stage spent drafting the next frame's window is that frame's proposal cost
        drafting = p.offered.seconds if p.offered is not None else 0.0
        links = max(p.answered_at - p.left_at - sum(sum(part.values()) for part in parts) - drafting, 0.0)
    return Observation(frame.drafts, accepted, frame.seconds, frame.rows, p.left_at - p.sent_at, later, links,
                       tokens, since, p.pace)
