"""Forced tokens as a proposer: where the grammar allows one continuation only, the tokens
that spell it are drafts that cost no model (`{"name": "`, a strict schema's next key,
closing braces). They ride a verify window like any draft; the target samples each row
under its mask, so they are accepted unless the model picks another tokenization of the
same text."""

from __future__ import annotations

import time

from mesh.constraints.guide import Guide
from mesh.speculative.proposer import Proposal

FORCED = "forced"  # its name in usage.speculative.by_proposer


def forced_proposal(guide: Guide, room: int) -> Proposal:
    """The forced tokens from where the guide stands, up to `room`; none when the grammar
    leaves a choice."""
    began = time.perf_counter()
    tokens = guide.forced(room)
    # the forced bytes are tokenized by llama.cpp, which may spell them in tokens the grammar
    # reads differently (an SPM vocabulary without a space token escapes it as U+2581): keep
    # only what the matcher itself takes
    tokens = tokens[: guide.legal(tokens)]
    return Proposal(tokens, FORCED, time.perf_counter() - began)
