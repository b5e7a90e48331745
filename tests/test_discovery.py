"""LAN discovery without a LAN: TXT records -> the peers a coordinator adds, in a stable order,
with the wrong protocol version, unreadable records and named peers left out; and the token
probe against an in-process gRPC server on loopback."""

from __future__ import annotations

import asyncio
import random
import socket

import grpc
import pytest

from mesh.routing.discovery import Found, candidates, read_records
from mesh.routing.peer_probe import refusal
from proto import meshpipe_pb2 as pb
from proto import meshpipe_pb2_grpc as pb_grpc
from proto.announcement import SERVICE_TYPE, Announcement, AnnouncementError, parse
from proto.version import PROTOCOL_VERSION
from stage.announce import service_info
from stage.grpc_auth import TokenInterceptor


def txt(control: str, version: int = PROTOCOL_VERSION, engine: str = "llama",
        mem_free: int = 1 << 30) -> dict[bytes, bytes | None]:
    return {b"control": control.encode(), b"engine": engine.encode(), b"proto": str(version).encode(),
            b"mem_free": str(mem_free).encode()}


def test_record_round_trips_through_txt_properties():
    record = Announcement(control="10.0.0.7:7070", engine="mlx", version=PROTOCOL_VERSION, mem_free=12345)
    as_txt = {k.encode(): v.encode() for k, v in record.properties().items()}
    assert parse(as_txt) == record


@pytest.mark.parametrize(("properties", "complaint"), [
    ({b"control": b"10.0.0.7:7070", b"engine": b"llama", b"proto": b"4"}, "lacks mem_free"),
    ({**txt("10.0.0.7:7070"), b"control": b"10.0.0.7"}, "is not HOST:PORT"),
    ({**txt("10.0.0.7:7070"), b"control": b"10.0.0.7:99999"}, "is not HOST:PORT"),
    ({**txt("10.0.0.7:7070"), b"proto": b"\xd9\xa3"}, "is not a number"),  # Arabic-Indic 3
    ({**txt("10.0.0.7:7070"), b"mem_free": None}, "lacks mem_free"),
])
def test_malformed_records_are_refused_naming_the_field(properties, complaint):
    with pytest.raises(AnnouncementError, match=complaint):
        parse(properties)


def test_order_is_by_address_whatever_order_they_were_heard_in():
    controls = ["10.0.0.10:7070", "10.0.0.9:7071", "10.0.0.9:7070", "stage-b.lan:7070", "10.0.0.200:7070"]
    expected = ["10.0.0.9:7070", "10.0.0.9:7071", "10.0.0.10:7070", "10.0.0.200:7070", "stage-b.lan:7070"]
    for seed in range(5):
        heard = controls[:]
        random.Random(seed).shuffle(heard)
        found = read_records((f"s{i}.{SERVICE_TYPE}", txt(c)) for i, c in enumerate(heard))
        assert [a.control for a in found.announced] == expected


def test_unreadable_and_duplicate_records():
    found = read_records([
        ("a", txt("10.0.0.2:7070")),
        ("a-on-second-interface", txt("10.0.0.2:7070")),  # the same stage, heard twice
        ("b", {b"engine": b"llama"}),
        ("c", None),  # seen, never resolved
    ])
    assert [a.control for a in found.announced] == ["10.0.0.2:7070"]
    assert [(s.name, s.reason) for s in found.skipped] == [
        ("b", "TXT record lacks control, proto, mem_free"),
        ("c", "announced, but its records did not resolve")]


def test_candidates_skip_other_versions_and_named_peers():
    found = read_records([("x", txt("10.0.0.3:7070")), ("y", txt("10.0.0.2:7070", version=PROTOCOL_VERSION + 1)),
                          ("z", txt("10.0.0.4:7070")), ("w", txt("10.0.0.5:7070"))])
    usable, skipped = candidates(found, named=["10.0.0.4:7070"])
    assert [a.control for a in usable] == ["10.0.0.3:7070", "10.0.0.5:7070"]  # no duplicate of the --peer
    assert [s.name for s in skipped] == ["10.0.0.2:7070"]
    assert f"speaks protocol {PROTOCOL_VERSION + 1}" in skipped[0].reason


def test_nothing_announced_is_no_candidates():
    assert candidates(Found((), ()), named=["10.0.0.4:7070"]) == ([], [])


def test_the_stage_record_holds_how_to_reach_it_and_nothing_else():
    info = service_info("abc123", "10.0.0.7", 7070, "llama")
    assert info.type == SERVICE_TYPE
    assert info.parsed_addresses() == ["10.0.0.7"]
    assert info.port == 7070
    record = parse(info.properties)
    assert (record.control, record.engine, record.version) == ("10.0.0.7:7070", "llama", PROTOCOL_VERSION)
    assert record.mem_free > 0
    assert set(info.properties) == {b"control", b"engine", b"proto", b"mem_free"}  # no token, no path


class _Stage(pb_grpc.StageControlServicer):
    """Answers Status in a given protocol version, like a stage daemon behind its token check."""

    def __init__(self, version: int) -> None:
        self.version = version

    async def Status(self, request: pb.StatusRequest, context: object) -> pb.StatusReply:
        return pb.StatusReply(protocol_version=self.version)


async def _refusals_from_stage(version: int, tokens: list[str | None]) -> list[str | None]:
    server = grpc.aio.server(interceptors=[TokenInterceptor("right")])
    pb_grpc.add_StageControlServicer_to_server(_Stage(version), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        return [await refusal(f"127.0.0.1:{port}", token, None) for token in tokens]
    finally:
        await server.stop(grace=None)


def test_a_found_stage_is_used_only_if_it_takes_the_token_in_our_version():
    right, wrong, none = asyncio.run(_refusals_from_stage(PROTOCOL_VERSION, ["right", "wrong", None]))
    assert right is None
    assert wrong == none == "wrong mesh token (it refused ours)"
    [other] = asyncio.run(_refusals_from_stage(PROTOCOL_VERSION + 1, ["right"]))
    assert other == f"answers in protocol {PROTOCOL_VERSION + 1}, this coordinator speaks {PROTOCOL_VERSION}"


def test_a_found_stage_that_does_not_answer_is_skipped_saying_so():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]  # bound, never listening: connections are refused
        reason = asyncio.run(refusal(f"127.0.0.1:{closed}", "right", None))
    assert reason is not None
    assert reason.startswith("no answer (UNAVAILABLE")
