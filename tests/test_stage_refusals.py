"""A stage daemon refuses a wrong token, a wrong protocol version, and a stale term."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Callable
from typing import TypeVar

import grpc
import pytest
from google.protobuf.message import Message

from proto import meshpipe_pb2 as pb
from proto.clients import StageControlClient, Unary, stage_control
from proto.version import PROTOCOL_VERSION as V
from stage.grpc_auth import token_metadata
from stage.transport import Link, TransportRefusedError, connect, serve

pytestmark = pytest.mark.mesh

TOKEN = "s3cret-mesh-token"


@pytest.fixture(scope="module")
def stage_endpoint(tmp_path_factory):
    env = {**os.environ, "MESHPIPE_TOKEN": TOKEN}
    proc = subprocess.Popen([sys.executable, "-m", "mesh.cli", "stage", "--listen", "127.0.0.1:0",
                             "--cache-dir", str(tmp_path_factory.mktemp("stage"))],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline().decode().split()
    yield line[1]
    proc.terminate()
    proc.wait(10)


Req = TypeVar("Req", bound=Message)
Reply = TypeVar("Reply", bound=Message)


def _call(endpoint: str, rpc: Callable[[StageControlClient], Unary[Req, Reply]], request: Req,
          token: str | None = TOKEN) -> Reply:
    async def go() -> Reply:
        async with grpc.aio.insecure_channel(endpoint) as channel:
            return await rpc(stage_control(channel))(request, metadata=token_metadata(token), timeout=10)

    return asyncio.run(go())


def test_wrong_or_missing_token_is_refused(stage_endpoint):
    for token in ("wrong", None):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            _call(stage_endpoint, lambda c: c.Status, pb.StatusRequest(protocol_version=V), token=token)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    status = _call(stage_endpoint, lambda c: c.Status, pb.StatusRequest(protocol_version=V))
    assert status.protocol_version == V


def test_protocol_version_mismatch_is_refused(stage_endpoint):
    reply = _call(stage_endpoint, lambda c: c.Claim, pb.ClaimRequest(protocol_version=V + 1, term=1))
    assert not reply.ok
    assert "protocol version" in reply.message


def test_stale_term_is_refused(stage_endpoint):
    """A coordinator's older term is refused (fencing); another coordinator's claim is not."""
    assert _call(stage_endpoint, lambda c: c.Claim, pb.ClaimRequest(
        protocol_version=V, term=100, coordinator_id="a", lease_until_ms=2**62)).ok
    old = _call(stage_endpoint, lambda c: c.Claim, pb.ClaimRequest(
        protocol_version=V, term=50, coordinator_id="a", lease_until_ms=2**62))
    assert not old.ok
    assert "stale" in old.message
    stop = _call(stage_endpoint, lambda c: c.Stop, pb.StopRequest(protocol_version=V, term=50, coordinator_id="a"))
    assert not stop.ok
    assert "stale coordinator term" in stop.message
    load = _call(stage_endpoint, lambda c: c.Load, pb.LoadRequest(protocol_version=V, term=50, coordinator_id="a"))
    assert not load.ready
    assert "stale" in load.message
    other = _call(stage_endpoint, lambda c: c.Claim, pb.ClaimRequest(
        protocol_version=V, term=50, coordinator_id="b", lease_until_ms=2**62))
    assert other.ok  # a claim of its own beside a's
    status = _call(stage_endpoint, lambda c: c.Status, pb.StatusRequest(protocol_version=V, coordinator_id="b"))
    assert status.term == 50
    assert {(c.coordinator_id, c.term) for c in status.claims} >= {("a", 100), ("b", 50)}
    unknown = _call(stage_endpoint, lambda c: c.Stop, pb.StopRequest(protocol_version=V, term=50, coordinator_id="c"))
    assert "holds no live claim" in unknown.message


def test_activation_link_checks_token_and_version():
    async def go() -> None:
        async def echo(link: Link) -> None:
            header, payload = await link.recv()
            await link.send(header, payload)

        server = await serve("127.0.0.1", 0, echo, token=TOKEN)
        port = server.sockets[0].getsockname()[1]
        with pytest.raises(TransportRefusedError, match="token"):
            await connect("127.0.0.1", port, token="nope")
        link = await connect("127.0.0.1", port, token=TOKEN)
        await link.send(pb.FrameHeader(session_id=7, kind=pb.END))
        header, _ = await link.recv()
        assert header.session_id == 7
        link.close()
        server.close()

    asyncio.run(go())
