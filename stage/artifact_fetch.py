"""The stage's side of ArtifactTransfer: one gRPC channel to the coordinator for every file.

A channel per file paid a connection (and a TLS handshake) per layer. Chunks arrive as raw
messages whose `data` is taken as a view (chunk_data), not copied by a protobuf parse, which
nearly halved what gRPC received per second on one core. The server's chunk stays 1 MiB:
4 MiB messages cost more CPU per byte, and a 64 MiB stream window
(`grpc.http2.lookahead_bytes`) made no measurable difference (BENCHMARKS.md, "Figures behind the code's choices").
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import grpc

from proto import meshpipe_pb2 as pb
from proto.clients import artifact_fetch_raw
from proto.version import PROTOCOL_VERSION
from stage.tls import MeshTls, channel

# Past the server's chunk (mesh/routing/artifact_server.py), which may grow without a client change.
MAX_MESSAGE = 64 << 20
CHANNEL_OPTIONS = (("grpc.max_receive_message_length", MAX_MESSAGE),)


def chunk_data(message: bytes) -> memoryview:
    """The `data` field of a serialized Chunk, as a view of `message`.

    protobuf's parse copies every byte of `data` into a new object: on a stage's one core that
    copy cost a third of a transfer. Chunk is `bytes data = 1; uint64 offset = 2;`; fields this
    does not know are skipped as the wire format says.
    """
    view, pos, data = memoryview(message), 0, memoryview(b"")
    while pos < len(view):
        key, pos = _varint(view, pos)
        wire = key & 7
        if wire == 0:
            _, pos = _varint(view, pos)
        elif wire == 2:
            size, pos = _varint(view, pos)
            if key >> 3 == 1:
                data = view[pos:pos + size]
            pos += size
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
        else:
            raise ValueError(f"malformed Chunk: wire type {wire}")
    if pos != len(view):
        raise ValueError("malformed Chunk: truncated field")
    return data


def _varint(view: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(view) or shift > 63:
            raise ValueError("malformed Chunk: bad varint")
        byte = view[pos]
        value |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if not byte & 0x80:
            return value, pos


class ArtifactFetcher:
    """A stage/prepare.py Fetcher over one channel, opened on first use; `aclose` closes it."""

    def __init__(self, source: str, manifest_sha: str, tls: MeshTls | None,
                 metadata: Sequence[tuple[str, str]] = ()) -> None:
        self.source = source
        self.manifest_sha = manifest_sha
        self.tls = tls
        self.metadata = tuple(metadata)
        self._channel: grpc.aio.Channel | None = None

    async def __call__(self, path: str, offset: int) -> AsyncIterator[bytes | memoryview]:
        if self._channel is None:
            self._channel = channel(self.source, self.tls, CHANNEL_OPTIONS)
        request = pb.FetchRequest(protocol_version=PROTOCOL_VERSION, manifest_sha256=self.manifest_sha,
                                  path=path, offset=offset)
        fetch = artifact_fetch_raw(self._channel)  # raw bytes: see chunk_data
        async for message in fetch(request, metadata=self.metadata, timeout=3600):
            yield chunk_data(message)

    async def aclose(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
