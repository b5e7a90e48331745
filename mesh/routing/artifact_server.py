"""ArtifactTransfer: stages pull their layer files from the coordinator, not the internet."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from packages.manifest import MANIFEST_NAME, Manifest
from proto import meshpipe_pb2 as pb
from proto import meshpipe_pb2_grpc as pb_grpc
from proto.version import check_version

# 1 MiB: 4 MiB messages tripled this server's CPU per byte, and a pull ran slower (stage/artifact_fetch.py).
CHUNK = 1 << 20


class ArtifactServer(pb_grpc.ArtifactTransferServicer):
    def __init__(self, package_dir: Path, manifest: Manifest, manifest_sha: str) -> None:
        self.root = package_dir
        self.sha = manifest_sha
        # Only files the manifest names can be fetched: never an arbitrary path.
        self.files = {MANIFEST_NAME, *(a.path for a in manifest.artifacts())}

    async def Fetch(self, request: pb.FetchRequest, context: grpc.aio.ServicerContext
                    ) -> AsyncIterator[pb.Chunk]:
        problem = check_version(request.protocol_version)
        if problem:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, problem)
        if request.manifest_sha256 != self.sha:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                "this coordinator serves a different package version")
        if request.path not in self.files:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no such artifact: {request.path}")
        path = self.root / request.path
        size = path.stat().st_size
        if request.offset > size:
            await context.abort(grpc.StatusCode.OUT_OF_RANGE, "offset beyond end of file")
        with path.open("rb") as f:
            f.seek(request.offset)
            offset = request.offset
            while block := f.read(CHUNK):
                yield pb.Chunk(data=block, offset=offset)
                offset += len(block)
