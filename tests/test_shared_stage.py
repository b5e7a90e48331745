"""One stage, several coordinators (issue 45): a StageControl in this process, real
SmolLM2 and Gemma-3 ranges, real activation links. Each coordinator's claim runs on lanes
of its own over one shared engine; claims past the lanes or the memory are refused with the
numbers; a frame can never reach another claim's lane; a lease that runs out frees its lanes;
a stage with defaults admits a second coordinator (issue 57)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest

from common.ids import FrameId, LaneId, SessionId
from common.sampling import SamplingParams
from packages.manifest import load_manifest
from proto import meshpipe_pb2 as pb
from proto.version import PROTOCOL_VERSION as V
from stage.control import StageControl, StageOptions, split_endpoint
from stage.engine_choice import LLAMA
from stage.frames import Asks, FrameSampling, compute_frame
from stage.hosted import SHARES, range_cost
from stage.transport import Link, connect, encode_tensor

pytestmark = pytest.mark.mesh  # real model ranges

CTX = 128
GREEDY = FrameSampling(SamplingParams())


def _control(cache: Path, **options: int | None) -> StageControl:
    return StageControl(StageOptions(host="127.0.0.1", advertise="127.0.0.1", cache_dir=cache, token=None,
                                     threads=1, **options))  # type: ignore[arg-type]


async def _load(control: StageControl, package: Path, coordinator: str, start: int, lanes: int,
                lease_s: float = 120, term: int = 1) -> pb.LoadReply:
    """Claim, prepare and load layers [start, end of model) for `coordinator`."""
    manifest, sha = load_manifest(package)
    until = int((time.time() + lease_s) * 1000)
    claim = await control.Claim(pb.ClaimRequest(protocol_version=V, coordinator_id=coordinator, term=term,
                                                lease_until_ms=until), None)
    assert claim.ok, claim.message
    end = manifest.layer_count
    assert (await control.Prepare(pb.PrepareRequest(
        protocol_version=V, coordinator_id=coordinator, term=term, package_ref=str(package),
        manifest_sha256=sha, layer_start=start, layer_end=end), None)).accepted
    asked = pb.InventoryRequest(protocol_version=V, coordinator_id=coordinator)
    while (inventory := await control.Inventory(asked, None)).state == pb.PREPARING:  # noqa: ASYNC110 -- polled as a coordinator polls
        await asyncio.sleep(0.05)
    assert inventory.state == pb.PREPARED, inventory.message
    return await control.Load(pb.LoadRequest(
        protocol_version=V, coordinator_id=coordinator, term=term, layer_start=start, layer_end=end,
        ctx_size=CTX, lanes=lanes, final=True, threads=1, wire_dtype=pb.F32), None)


async def _link(reply: pb.LoadReply) -> Link:
    assert reply.ready, reply.message
    host, port = split_endpoint(reply.endpoint)
    return await connect(host, port, token=None, role="coordinator")


async def _ask(link: Link, session: int, lane: int, start: int, hidden: np.ndarray) -> pb.FrameHeader:
    """Feed `hidden` to the session's lane at `start`; the final stage's REPLY or ERROR."""
    header = compute_frame(SessionId(session), FrameId(start + 1), LaneId(lane), start, 0,
                           Asks(pb.PREFILL, GREEDY))
    shape, data = encode_tensor(hidden, pb.F32)
    header.dtype, header.payload_bytes = pb.F32, len(data)
    header.shape.extend(shape)
    await link.send(header, data)
    reply, _ = await asyncio.wait_for(link.recv(), 60)
    return reply


def test_two_claims_share_one_range_on_lanes_of_their_own(smollm2_package, tmp_path):
    async def scenario() -> None:
        control = _control(tmp_path, lanes=4)
        try:
            a = await _link(await _load(control, smollm2_package, "a", 24, 2))
            b = await _link(await _load(control, smollm2_package, "b", 24, 2))
            status = await control.Status(pb.StatusRequest(protocol_version=V, coordinator_id="b"), None)
            assert status.ranges_loaded == 1  # one engine, two claims
            assert sorted((c.coordinator_id, c.lanes) for c in status.claims) == [("a", 2), ("b", 2)]
            refused = await _load(control, smollm2_package, "c", 24, 1)
            assert not refused.ready
            assert "asks 1 lanes" in refused.message
            assert "0 of this stage's 4 are free" in refused.message
            assert "coordinator a holds 2" in refused.message

            width = next(iter(control.hosting.ranges.values())).engine.width
            rng = np.random.default_rng(0)
            prompt, step, other = (rng.standard_normal((n, width)).astype(np.float32) for n in (5, 1, 5))
            # a's session 1 and b's session 1 both name lane 0: each its own claim's lane 0
            assert (await _ask(a, 1, 0, 0, prompt)).kind == pb.REPLY
            assert (await _ask(b, 1, 0, 0, other)).kind == pb.REPLY
            after_b = await _ask(a, 1, 0, 5, step)
            alone = (await _ask(a, 2, 1, 0, prompt), await _ask(a, 2, 1, 5, step))[1]
            assert list(after_b.tokens) == list(alone.tokens)  # b's prompt never touched a's KV
            stray = await _ask(b, 3, 2, 0, prompt)  # a lane past b's grant: a's, were it not scoped
            assert stray.kind == pb.ERROR
            assert "lane 2 out of range (this claim holds 2 lanes" in stray.message
            assert (await _ask(b, 1, 0, 5, step)).kind == pb.REPLY  # and b serves on

            assert (await control.Stop(pb.StopRequest(protocol_version=V, coordinator_id="a", term=1), None)).ok
            assert (await _load(control, smollm2_package, "c", 24, 2)).ready  # a's lanes are free again
            assert (await _ask(b, 1, 0, 6, step)).kind == pb.REPLY
            for link in (a, b):
                link.close()
        finally:
            await control.close()

    asyncio.run(scenario())


def test_a_lease_that_runs_out_frees_only_its_own_lanes(smollm2_package, tmp_path):
    async def scenario() -> None:
        control = _control(tmp_path, lanes=3)
        try:
            kept = await _link(await _load(control, smollm2_package, "kept", 24, 2))
            assert (await _load(control, smollm2_package, "dies", 24, 1, lease_s=1.5)).ready
            assert not (await _load(control, smollm2_package, "late", 24, 1)).ready  # all 3 granted
            started = time.monotonic()
            while any(c.coordinator_id == "dies" for c in
                      (await control.Status(pb.StatusRequest(protocol_version=V), None)).claims):
                assert time.monotonic() - started < 10, "the lease never ran out"
                await asyncio.sleep(0.1)
            status = await control.Status(pb.StatusRequest(protocol_version=V, coordinator_id="kept"), None)
            # late's claim stands, its Load refused: it holds nothing
            assert {c.coordinator_id: c.lanes for c in status.claims} == {"kept": 2, "late": 0}
            assert status.state == pb.READY
            assert status.ranges_loaded == 1
            assert (await _load(control, smollm2_package, "late", 24, 1)).ready  # its lane is free
            width = next(iter(control.hosting.ranges.values())).engine.width
            hidden = np.zeros((2, width), dtype=np.float32)
            assert (await _ask(kept, 1, 1, 0, hidden)).kind == pb.REPLY
            # a coordinator restarted under its own name (a newer term) takes over its lanes at
            # once, where a new name would wait for the old lease to run out
            assert (await _load(control, smollm2_package, "kept", 24, 2, term=2)).ready
            with pytest.raises(ConnectionError):  # the old term's link went with its lease
                await _ask(kept, 1, 1, 2, hidden)
            kept.close()
        finally:
            await control.close()

    asyncio.run(scenario())


def test_a_second_model_loads_beside_the_first_or_is_refused_with_the_figures(
        smollm2_package, gemma3_package, tmp_path):
    async def scenario() -> None:
        control = _control(tmp_path, memory=None)
        try:
            smol = await _link(await _load(control, smollm2_package, "smol", 24, 1))
            held = sum(h.footprint for h in control.hosting.ranges.values())
            control.hosting.budget = held + (1 << 20)  # as `mesh stage --memory` would set it
            gemma_start = load_manifest(gemma3_package)[0].layer_count - 2
            refused = await _load(control, gemma3_package, "gemma", gemma_start, 1)
            assert not refused.ready
            assert "MiB (weights and KV for 1 lanes of 128 tokens) and 1 MiB is left of this stage's --memory" \
                in refused.message, refused.message
            control.hosting.budget = None  # what the machine has free
            gemma = await _link(await _load(control, gemma3_package, "gemma", gemma_start, 1))
            assert len(control.hosting.ranges) == 2
            for link, key in ((smol, "smol"), (gemma, "gemma")):
                hosted = next(h for h in control.hosting.ranges.values() if key in h.holders)
                hidden = np.zeros((2, hosted.engine.width), dtype=np.float32)
                assert (await _ask(link, 1, 0, 0, hidden)).kind == pb.REPLY
                link.close()
        finally:
            await control.close()

    asyncio.run(scenario())


def test_a_stage_with_defaults_admits_a_second_coordinator_unless_memory_says_no(smollm2_package, tmp_path):
    async def scenario() -> None:
        control = _control(tmp_path)  # no --lanes, no --memory: as `mesh stage` starts by default
        try:
            a = await _link(await _load(control, smollm2_package, "a", 24, 2))
            b = await _link(await _load(control, smollm2_package, "b", 24, 2))
            hosted = next(iter(control.hosting.ranges.values()))
            assert hosted.engine.lanes == SHARES * 2
            hidden = np.zeros((2, hosted.engine.width), dtype=np.float32)
            for link in (a, b):
                assert (await _ask(link, 1, 1, 0, hidden)).kind == pb.REPLY
                link.close()
            prepared = control.leases["a"].prepared
            assert prepared is not None
            for name in "ab":
                assert (await control.Stop(pb.StopRequest(protocol_version=V, coordinator_id=name, term=1), None)).ok
            assert not control.hosting.ranges  # the last claim let go: unloaded

            cost = range_cost(prepared, LLAMA, CTX)
            control.hosting.budget = cost.of(2) + cost.per_lane  # room for half a lane past the ask
            assert (await _load(control, smollm2_package, "a", 24, 2)).ready
            refused = await _load(control, smollm2_package, "b", 24, 1)
            assert not refused.ready
            assert "0 of this stage's 2 are free (coordinator a holds 2): memory held this range to 2 lanes" \
                in refused.message, refused.message
        finally:
            await control.close()

    asyncio.run(scenario())
