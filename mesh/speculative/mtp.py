"""The model's own MTP layers as a proposer: they draft at the final stage (DESIGN.md §6, issue 56).

The final stage holds the trunk's last hidden state, which an MTP ("nextn") layer reads, so it
drafts there (stage/mtp_drafts.py) and sends the drafts with its reply. This proposer, on
stage 0, asks each frame's reply for the drafts of as many windows as may be out (`asks`),
keeps what a reply brought (`offered`), and proposes from it while it continues the session's
sequence: the next frame's window, and the windows of frames sent ahead of their replies
(drafts in flight included), one window each. A reply that parts from the sequence (a
rejection it saw first) leaves nothing to propose until the next one comes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mesh.speculative.proposer import Budget, DraftSampling, Proposal
from stage.frames import Offered

if TYPE_CHECKING:
    from mesh.constraints.guide import Guide

MTP = "mtp"  # its name in usage.speculative.by_proposer, in plans and on --strategy


class MtpProposer:
    names: tuple[str, ...] = (MTP,)

    def __init__(self) -> None:
        self.offers: dict[int, Offered] = {}
        self.window: dict[int, int] = {}  # per lane: the window its controller chose when asking
        self.charged: set[int] = set()  # lanes whose offer's drafting cost a proposal carries already

    def asks(self, lane: int, budget: Budget, depth: int) -> int:
        """How many drafts the frame being sent asks the final stage for: a window for each
        frame that may be out."""
        self.window[lane] = budget(MTP)
        return self.window[lane] * depth

    def offered(self, lane: int, offer: Offered | None) -> None:
        """What the lane's latest reply brought (None: nothing; an older offer still serves
        frames it covers)."""
        if offer is not None:
            self.offers[lane] = offer
            self.charged.discard(lane)

    async def proposal(self, lane: int, sequence: list[int], budget: Budget,
                       guide: Guide | None = None, sampling: DraftSampling | None = None) -> Proposal:
        """A window of the drafts the last reply brought, past the part of them `sequence`
        holds already (sent ahead); under rejection sampling each with its q. The window was
        sized when they were asked for, so `budget` is not asked again."""
        offer, k = self.offers.get(lane), self.window.get(lane, 0)
        if offer is None or k < 1 or not offer.drafts:
            return Proposal([], MTP, 0.0)
        held = len(sequence) - offer.at
        if held < 0 or [d.token for d in offer.drafts[:held]] != sequence[offer.at :]:
            return Proposal([], MTP, 0.0)
        drafts = offer.drafts[held : held + k]
        # what the final stage spent drafting for this reply (its last chain kept the rest): the
        # first frame proposed from it carries it, since each reply adds about one window a frame
        seconds = 0.0 if lane in self.charged or not drafts else offer.seconds
        self.charged.add(lane)
        return Proposal([d.token for d in drafts], MTP, seconds, drafts if sampling is not None else ())

    def forget(self, lane: int) -> None:
        self.offers.pop(lane, None)
        self.window.pop(lane, None)
        self.charged.discard(lane)
