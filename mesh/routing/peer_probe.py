"""`mesh serve --discover`: the announced stages that accept this mesh's token, as peers.

A stage proves nothing by announcing itself; a coordinator uses one only after a Status call
carrying the token succeeds (no Claim: asking must not take a stage from anyone).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import grpc

from mesh.routing.discovery import Skipped, browse, candidates
from proto import meshpipe_pb2 as pb
from proto.clients import stage_control
from proto.version import PROTOCOL_VERSION
from stage.grpc_auth import token_metadata
from stage.tls import MeshTls, channel

PROBE_TIMEOUT = 3.0


async def refusal(endpoint: str, token: str | None, tls: MeshTls | None) -> str | None:
    """None when the stage at `endpoint` answers Status with this token, else why not."""
    async with channel(endpoint, tls) as chan:
        try:
            reply = await stage_control(chan).Status(pb.StatusRequest(protocol_version=PROTOCOL_VERSION),
                                                     timeout=PROBE_TIMEOUT, metadata=token_metadata(token))
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                return "wrong mesh token (it refused ours)"
            return f"no answer ({exc.code().name}: {exc.details()})"
    if reply.protocol_version != PROTOCOL_VERSION:
        return f"answers in protocol {reply.protocol_version}, this coordinator speaks {PROTOCOL_VERSION}"
    return None


async def _refusals(endpoints: Sequence[str], token: str | None, tls: MeshTls | None) -> list[str | None]:
    return list(await asyncio.gather(*(refusal(e, token, tls) for e in endpoints)))


def discovered_peers(seconds: float, named: Sequence[str], token: str | None, tls: MeshTls | None,
                     say: Callable[[str], None]) -> list[str]:
    """Browse for `seconds`, then return the usable announced stages not already `named` (the
    --peer and --spare ones), in their stable order; says what it found and what it left out and
    why. Runs outside an event loop."""
    usable, skipped = candidates(browse(seconds), named)
    answers = asyncio.run(_refusals([r.control for r in usable], token, tls)) if usable else []
    found = []
    for record, reason in zip(usable, answers, strict=True):
        if reason is None:
            found.append(record.control)
        else:
            skipped.append(Skipped(record.control, reason))
    say(f"discovery: {len(found)} stage(s) found on the LAN"
        + (f": {', '.join(found)}" if found else "")
        + (f"; {len(skipped)} skipped" if skipped else ""))
    for skip in skipped:
        say(f"discovery: skipped {skip.name}: {skip.reason}")
    return found
