"""Typed faces of the generated gRPC stubs.

grpcio-tools writes a .pyi for the messages but none for the services, so every method of
`StageControlStub` and `ArtifactTransferStub` is `Any` to mypy, and so is every reply. These
protocols give each method its request and reply types; the generated stubs satisfy them
structurally, and tests/test_proto.py checks them against the service descriptors.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, Awaitable, Sequence
from typing import Protocol, TypeVar

import grpc
from google.protobuf.message import Message

from proto import meshpipe_pb2 as pb
from proto import meshpipe_pb2_grpc as pb_grpc

Req = TypeVar("Req", bound=Message, contravariant=True)
Reply = TypeVar("Reply", bound=Message, covariant=True)
Metadata = Sequence[tuple[str, str]]


class Unary(Protocol[Req, Reply]):
    """A unary-unary method of a grpc.aio stub: awaiting the call gives the reply."""

    def __call__(self, request: Req, *, timeout: float | None = None,
                 metadata: Metadata | None = None) -> Awaitable[Reply]: ...


class ServerStream(Protocol[Req, Reply]):
    """A unary-stream method of a grpc.aio stub: the call yields the replies."""

    def __call__(self, request: Req, *, timeout: float | None = None,
                 metadata: Metadata | None = None) -> AsyncIterable[Reply]: ...


class StageControlClient(Protocol):
    Claim: Unary[pb.ClaimRequest, pb.ClaimReply]
    Prepare: Unary[pb.PrepareRequest, pb.PrepareReply]
    Inventory: Unary[pb.InventoryRequest, pb.InventoryReply]
    Load: Unary[pb.LoadRequest, pb.LoadReply]
    Stop: Unary[pb.StopRequest, pb.Ack]
    Status: Unary[pb.StatusRequest, pb.StatusReply]


class ArtifactTransferClient(Protocol):
    Fetch: ServerStream[pb.FetchRequest, pb.Chunk]


def stage_control(channel: grpc.aio.Channel) -> StageControlClient:
    return pb_grpc.StageControlStub(channel)


class RawFetch(Protocol):
    """ArtifactTransfer.Fetch with its replies left serialized: each a Chunk's bytes, which a
    stage reads `data` from as a view (stage/artifact_fetch.py chunk_data), not a parsed copy."""

    def __call__(self, request: pb.FetchRequest, *, timeout: float | None = None,
                 metadata: Metadata | None = None) -> AsyncIterable[bytes]: ...


def artifact_fetch_raw(channel: grpc.aio.Channel) -> RawFetch:
    """ArtifactTransfer's Fetch on `channel`, the path taken from the service descriptor."""
    method = pb.DESCRIPTOR.services_by_name["ArtifactTransfer"].methods_by_name["Fetch"]
    fetch: RawFetch = channel.unary_stream(f"/{method.containing_service.full_name}/{method.name}",
                                           request_serializer=pb.FetchRequest.SerializeToString,
                                           response_deserializer=None)
    return fetch


# Every StageControl request type belongs to exactly one RPC (tests/test_proto.py checks),
# so an error can name the RPC from the request alone.
_RPC_BY_REQUEST = {m.input_type.full_name: m.name
                   for m in pb.DESCRIPTOR.services_by_name["StageControl"].methods}


def rpc_name(request: Message) -> str:
    """The StageControl RPC that takes this request, e.g. "Claim" for a ClaimRequest."""
    return _RPC_BY_REQUEST[request.DESCRIPTOR.full_name]
