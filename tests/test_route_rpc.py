"""Route.rpc: typed stage calls; a gRPC failure becomes a RouteError naming the stage and the RPC."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import cast

import grpc
import pytest

from mesh.routing.route import RemoteStage, Route, RouteError, RouteSettings
from packages.manifest import Manifest
from proto import meshpipe_pb2 as pb
from proto.clients import Metadata

SETTINGS = RouteSettings(token="secret", cache_dir=Path(), lanes=1, ctx_size=64, batch=1, threads=1)
STAGE = RemoteStage(endpoint="10.0.0.2:7070")


def _route() -> Route:
    return Route(Path(), cast(Manifest, None), "", SETTINGS)  # rpc reads only the settings


def test_rpc_sends_the_token_and_returns_the_reply():
    seen: list[tuple[pb.StatusRequest, float | None, Metadata | None]] = []

    async def status(request: pb.StatusRequest, *, timeout: float | None = None,  # noqa: ASYNC109 -- grpc's own signature
                     metadata: Metadata | None = None) -> pb.StatusReply:
        seen.append((request, timeout, metadata))
        return pb.StatusReply(rss_bytes=7)

    reply = asyncio.run(_route().rpc(STAGE, status, pb.StatusRequest(protocol_version=2), 1.5))
    assert reply.rss_bytes == 7
    assert seen == [(pb.StatusRequest(protocol_version=2), 1.5, (("x-mesh-token", "secret"),))]


@pytest.mark.parametrize(("details", "said"), [("connection refused", "connection refused"), ("", "UNAVAILABLE")])
def test_a_failed_rpc_names_the_stage_and_the_rpc(details: str, said: str):
    async def load(request: pb.LoadRequest, *, timeout: float | None = None,  # noqa: ASYNC109 -- grpc's own signature
                   metadata: Metadata | None = None) -> pb.LoadReply:
        raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                   details=details)

    with pytest.raises(RouteError) as err:
        asyncio.run(_route().rpc(STAGE, load, pb.LoadRequest()))
    assert str(err.value) == f"stage 10.0.0.2:7070: Load failed: {said}"
