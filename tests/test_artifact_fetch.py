"""A stage's pull from the coordinator's ArtifactTransfer: one channel, raw chunks, hashed on arrival."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from mesh.routing.artifact_server import ArtifactServer
from packages.errors import PackageError
from packages.manifest import MANIFEST_NAME, load_manifest
from proto import meshpipe_pb2 as pb
from proto import meshpipe_pb2_grpc as pb_grpc
from stage import prepare as prepare_module
from stage.artifact_fetch import ArtifactFetcher, chunk_data
from stage.prepare import Progress, Wanted, prepare_stage


@pytest.mark.parametrize(("data", "offset"), [(b"", 0), (b"x", 0), (os.urandom(300), 7), (os.urandom(1 << 20), 2**63)])
def test_chunk_data_reads_what_protobuf_wrote(data, offset):
    message = pb.Chunk(data=data, offset=offset).SerializeToString()
    assert bytes(chunk_data(message)) == data


def test_chunk_data_refuses_a_truncated_message():
    message = pb.Chunk(data=b"abcdef", offset=3).SerializeToString()
    with pytest.raises(ValueError, match="malformed"):
        chunk_data(message[:4])


async def _pull(package: Path, cache: Path, start: int, end: int) -> tuple[Path, Progress, ArtifactFetcher]:
    manifest, sha = load_manifest(package)
    server = grpc.aio.server()
    pb_grpc.add_ArtifactTransferServicer_to_server(ArtifactServer(package, manifest, sha), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        fetch, progress = ArtifactFetcher(f"127.0.0.1:{port}", sha, None), Progress()
        prepared = await prepare_stage(Wanted(str(cache / "absent"), sha, start, end), cache, fetch, progress)
        return prepared.gguf, progress, fetch
    finally:
        await server.stop(None)


@pytest.mark.parametrize("threaded", [False, True])
def test_a_pull_over_grpc_installs_verified_files_and_closes_its_channel(tiny_package, tmp_path, monkeypatch,
                                                                           threaded):
    monkeypatch.setattr(prepare_module, "_THREADED", threaded)
    gguf, progress, fetch = asyncio.run(_pull(tiny_package, tmp_path, 1, 2))
    assert gguf.is_file()
    assert progress.bytes_done == progress.bytes_total > 0
    assert fetch._channel is None  # prepare_stage closed it
    manifest, sha = load_manifest(tiny_package)
    pulled = tmp_path / "packages" / sha
    for art in [*manifest.shared.values(), manifest.layers[1]]:
        assert (pulled / art.path).read_bytes() == (tiny_package / art.path).read_bytes()
    assert not (pulled / manifest.layers[0].path).exists()


def test_corrupt_bytes_are_refused_before_the_rename(tiny_package, tmp_path):
    _manifest, sha = load_manifest(tiny_package)

    async def fetch(path: str, offset: int) -> AsyncIterator[bytes]:
        data = (tiny_package / path).read_bytes()
        yield data if path == MANIFEST_NAME else data[:-1] + bytes([data[-1] ^ 1])

    with pytest.raises(PackageError, match="failed verification"):
        asyncio.run(prepare_stage(Wanted(str(tmp_path / "absent"), sha, 0, 1), tmp_path, fetch, Progress()))
    installed = [p for p in (tmp_path / "packages" / sha).rglob("*") if p.is_file()]
    assert all(p.name == MANIFEST_NAME for p in installed)  # no artifact was renamed into place
