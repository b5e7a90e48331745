"""The protocol version every message carries, and the refusal a mismatch gets."""

from __future__ import annotations

PROTOCOL_VERSION = 9  # 9: Sampling.targets (scored prompt rows); an 8 stage would sample every row
# of such a frame and answer with tokens where stage 0 reads logprobs of the prompt
# 8: several coordinators share a stage, each call naming its coordinator_id;
# a 7 stage would let a second coordinator's Claim unload the first's range
# 7: Sampling.rejection, .proposed and .checks_first (rejection sampling): a 6 peer
# would sample such a frame by exact match and answer a checks_first frame one token short
# 6: Sampling.masks (grammar masks); a 5 peer would sample a constrained frame free
# 5: FrameHeader.lane is the lane itself, optional (4 sent lane + 1, 0 for unset):
# a 4 peer would read every lane one off, so the two must not share a route
# 4: FrameHeader.lane and .keep (the prefix cache)
# 3: the reply link (direct return), wire emulation at Load, FrameHeader.epoch
# 2: penalties, logit_bias and logprobs in Sampling and REPLY


def check_version(version: int) -> str | None:
    """None when compatible, else a message telling the operator what to do."""
    if version == PROTOCOL_VERSION:
        return None
    return (f"protocol version {version} not supported (this node speaks {PROTOCOL_VERSION}); "
            "run the same meshpipe version on every machine")
