"""Inventory reports a finished Prepare as PREPARED at once (issue 17's mixed-mesh tests found
a race: the result was stored by a callback one loop turn later, and an Inventory in that
turn read PREPARE_FAILED with no message, which failed `mesh serve` about once in 12 starts)."""

from __future__ import annotations

import asyncio
import time

import pytest

from packages.manifest import load_manifest
from proto import meshpipe_pb2 as pb
from proto.version import PROTOCOL_VERSION as V
from stage.control import StageControl, StageOptions

pytestmark = pytest.mark.mesh  # prepares a real SmolLM2 range


def test_inventory_polled_every_loop_turn_never_sees_a_silent_failure(smollm2_package, tmp_path):
    async def scenario() -> list[int]:
        control = StageControl(StageOptions(host="127.0.0.1", advertise="127.0.0.1", cache_dir=tmp_path,
                                            token=None, threads=1))
        _, sha = load_manifest(smollm2_package)
        lease = int(time.time() * 1000) + 60_000
        assert (await control.Claim(pb.ClaimRequest(protocol_version=V, term=1, lease_until_ms=lease), None)).ok
        reply = await control.Prepare(pb.PrepareRequest(
            protocol_version=V, term=1, package_ref=str(smollm2_package), manifest_sha256=sha,
            layer_start=19, layer_end=30), None)
        assert reply.accepted
        seen: list[int] = []
        while not seen or seen[-1] == pb.PREPARING:
            seen.append((await control.Inventory(pb.InventoryRequest(protocol_version=V), None)).state)
            await asyncio.sleep(0)  # one loop turn between polls: the turn the race lived in
        return seen

    seen = asyncio.run(scenario())
    assert seen[-1] == pb.PREPARED
    assert pb.PREPARE_FAILED not in seen
