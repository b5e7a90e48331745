"""The committed generated protobuf code matches proto/meshpipe.proto."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest

from proto import meshpipe_pb2 as pb
from proto.clients import ArtifactTransferClient, ServerStream, StageControlClient, Unary, rpc_name
from proto.generate import HERE, OUTPUTS, generate
from proto.version import PROTOCOL_VERSION, check_version


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    generate(tmp_path)
    stale = [name for name in OUTPUTS if (tmp_path / name).read_bytes() != (HERE / name).read_bytes()]
    assert not stale, f"{stale} are stale: run `python -m proto.generate` and commit the result"


def test_version_check_names_both_versions() -> None:
    assert check_version(PROTOCOL_VERSION) is None
    message = check_version(PROTOCOL_VERSION + 1)
    assert message is not None
    assert str(PROTOCOL_VERSION + 1) in message
    assert str(PROTOCOL_VERSION) in message


@pytest.mark.parametrize(("client", "service"), [(StageControlClient, "StageControl"),
                                                 (ArtifactTransferClient, "ArtifactTransfer")])
def test_typed_clients_match_the_services(client: type, service: str) -> None:
    """proto/clients.py types the stubs by hand; here it must agree with the .proto, method by method."""
    methods = pb.DESCRIPTOR.services_by_name[service].methods
    hints = typing.get_type_hints(client)
    assert set(hints) == {m.name for m in methods}
    for m in methods:
        assert not m.client_streaming
        request, reply = typing.get_args(hints[m.name])
        assert typing.get_origin(hints[m.name]) is (ServerStream if m.server_streaming else Unary)
        assert (m.input_type, m.output_type) == (request.DESCRIPTOR, reply.DESCRIPTOR), m.name


def test_each_stage_control_rpc_is_named_by_its_request() -> None:
    methods = pb.DESCRIPTOR.services_by_name["StageControl"].methods
    for m in methods:
        request = getattr(pb, m.input_type.name)()
        assert rpc_name(request) == m.name
    assert len({m.input_type for m in methods}) == len(methods)
