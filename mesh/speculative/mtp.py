"""The model's own MTP layers as a proposer: they draft at the final stage (DESIGN.md §6, issue 56).

The final stage holds the trunk's last hidden state, which an MTP ("nextn") layer reads, so it
drafts there (stage/mtp_drafts.py) and sends the drafts with its reply. This proposer, on
stage 0, asks each frame's reply for as many drafts as its window controller allows
(`asks`), keeps what the reply brought (`offered`), and proposes them as the next frame's
window when they continue the session's sequence. Since its drafts come with replies, a frame
cannot be drafted ahead of the reply before it: a session keeps one frame out (`ahead`).
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
    ahead = False  # it proposes from a reply: the next frame waits for it

    def __init__(self) -> None:
        self.offers: dict[int, Offered] = {}

    def asks(self, budget: Budget) -> int:
        """How many drafts the frame being sent asks the final stage for: the next window."""
        return budget(MTP)

    def offered(self, lane: int, offer: Offered | None) -> None:
        """What the lane's latest reply brought (None: nothing, and an older offer is stale)."""
        if offer is None:
            self.offers.pop(lane, None)
        else:
            self.offers[lane] = offer

    async def proposal(self, lane: int, sequence: list[int], budget: Budget,
                       guide: Guide | None = None, sampling: DraftSampling | None = None) -> Proposal:
        """The drafts the last reply brought, where they continue `sequence` (the window was
        sized when they were asked for); under rejection sampling each with its q."""
        offer = self.offers.pop(lane, None)
        if offer is None or offer.at != len(sequence) or not offer.drafts:
            return Proposal([], MTP, 0.0)
        drafts = offer.drafts
        return Proposal([d.token for d in drafts], MTP, offer.seconds, drafts if sampling is not None else ())

    def forget(self, lane: int) -> None:
        self.offers.pop(lane, None)
