"""TLS across the mesh: gRPC control, ArtifactTransfer and activation links all encrypted."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from pathlib import Path

import grpc
import openai
import pytest
from certs import mesh_ca
from chat_reference import PROMPTS, chat
from mesh_server import mesh_serve

from proto import meshpipe_pb2 as pb
from proto import meshpipe_pb2_grpc as pb_grpc
from proto.version import PROTOCOL_VERSION
from stage.grpc_auth import token_metadata
from stage.tls import MeshTls, channel

pytestmark = pytest.mark.mesh


@contextlib.contextmanager
def tls_stage(cache: Path, tls_args: list[str], token: str):
    cmd = [sys.executable, "-m", "mesh.cli", "stage", "--listen", "127.0.0.1:0", "--cache-dir",
           str(cache), "--threads", "1", "--token", token, *tls_args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        yield proc.stdout.readline().decode().split()[1]
    finally:
        proc.terminate()
        proc.wait(15)


async def _status(endpoint: str, tls: MeshTls | None, token: str) -> pb.StatusReply:
    async with channel(endpoint, tls) as ch:
        return await pb_grpc.StageControlStub(ch).Status(
            pb.StatusRequest(protocol_version=PROTOCOL_VERSION), metadata=token_metadata(token),
            timeout=10)


def test_tls_stage_refuses_plaintext_and_foreign_certificates(tmp_path):
    _, nodes = mesh_ca(tmp_path, 2)
    (tmp_path / "other").mkdir()
    _, (stranger,) = mesh_ca(tmp_path / "other", 1)
    with tls_stage(tmp_path, nodes[0].args(), "t") as endpoint:
        ok = asyncio.run(_status(endpoint, MeshTls(nodes[1].cert, nodes[1].key, nodes[1].ca), "t"))
        assert ok.protocol_version == PROTOCOL_VERSION
        with pytest.raises(grpc.aio.AioRpcError):
            asyncio.run(_status(endpoint, None, "t"))
        with pytest.raises(grpc.aio.AioRpcError):  # a CA the stage's certificate is not from
            asyncio.run(_status(endpoint, MeshTls(stranger.cert, stranger.key, stranger.ca), "t"))


def test_split_serving_over_tls_matches_unsplit_model(tmp_path, serve_cache, expected_texts):
    _, (node,) = mesh_ca(tmp_path, 1)
    # the session's cache: a fresh one would make the draft and the package again first
    with mesh_serve(serve_cache, "--local-stages", "3", *node.args()) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        assert chat(client, PROMPTS[1], stream=True) == expected_texts[PROMPTS[1]]
