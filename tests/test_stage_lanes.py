"""How many lanes a shared range opens with (issue 57), on a fake engine: `mesh stage` with
defaults admits further coordinators on the range its first claim loaded, as memory allows;
`--lanes N` opens N; a claim refused for want of lanes is told memory only when memory held
the lanes down, and otherwise who holds them."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from proto import meshpipe_pb2 as pb
from stage.engine import EngineConfig
from stage.hosted import MAX_LANES, SHARES, Cost, Hosted, Hosting, size_lanes
from stage.prepare import PreparedStage

MIB = 1 << 20
COST = Cost(fixed=100 * MIB, per_lane=10 * MIB)  # weights and overhead; KV a lane
CTX = 512


class FakeEngine:
    """What Hosting and a Batcher read of an engine: it opens with the lanes asked."""

    def __init__(self, cfg: EngineConfig) -> None:
        self.lanes, self.ctx_per_lane = cfg.lanes, cfg.ctx_per_lane
        self.graph_rows, self.width = 256, 8

    def trim(self, lane: int, position: int) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hosting opens FakeEngines, costing COST, without calibrating them."""
    monkeypatch.setattr("stage.hosted.range_cost", lambda p, engine, ctx: COST)
    monkeypatch.setattr("stage.hosted.calibrate", lambda engine, layers, dtype: None)


def _hosting(lanes: int = 0, budget: int | None = 10_000 * MIB) -> Hosting:
    hosting = Hosting("llama", threads=1, budget=budget, lanes=lanes)
    hosting.engine_kind = cast(Any, SimpleNamespace(open=lambda gguf, cfg: FakeEngine(cfg)))
    return hosting


PREPARED = PreparedStage(gguf=Path("stage.gguf"), manifest=cast(Any, None), manifest_sha="ab" * 32, start=4, end=8)


async def _claim(hosting: Hosting, coordinator: str, lanes: int) -> Hosted | str:
    """What `coordinator`'s Load of PREPARED asking `lanes` lanes gets: the range, or why not."""
    try:
        hosted = await hosting.host(PREPARED, pb.LoadRequest(lanes=lanes, ctx_size=CTX, final=True), None)
    except ValueError as exc:
        return str(exc)
    granted = hosted.grant(coordinator, lanes)
    return granted if isinstance(granted, str) else hosted


def test_a_default_range_opens_room_for_more_claims_than_the_first_as_memory_allows() -> None:
    plenty = COST.of(1000)
    assert size_lanes(4, 0, COST, plenty) == SHARES * 4
    assert size_lanes(100, 0, COST, 10**15) == MAX_LANES  # llama.cpp's most
    assert size_lanes(MAX_LANES, 0, COST, 10**15) == MAX_LANES
    # the lanes past the ask take at most half of what the ask leaves: 4 lanes' worth here
    assert size_lanes(4, 0, COST, COST.of(4) + 8 * COST.per_lane) == 8
    assert size_lanes(4, 0, COST, COST.of(4) + 9 * COST.per_lane) == 8
    assert size_lanes(4, 0, COST, COST.of(4) + COST.per_lane) == 4  # none past the ask
    assert size_lanes(4, 0, COST, COST.of(2)) == 4  # never fewer than asked: the Load is refused
    assert size_lanes(4, 0, Cost(COST.fixed, 0), COST.fixed) == SHARES * 4  # no KV: memory never limits lanes


def test_an_explicit_lanes_opens_that_many_or_the_first_claim_s_ask() -> None:
    assert size_lanes(2, 6, COST, COST.of(1)) == 6  # memory is the Load's check, not the sizing's
    assert size_lanes(8, 6, COST, 10**15) == 8


def test_with_defaults_a_second_third_and_fourth_coordinator_are_granted_lanes(fake: None) -> None:
    async def scenario() -> None:
        hosting = _hosting()
        try:
            hosted = [await _claim(hosting, name, 4) for name in "abcd"]
            assert all(h is hosted[0] for h in hosted)  # one engine, four claims
            first = hosted[0]
            assert isinstance(first, Hosted)
            assert first.engine.lanes == 16
            assert first.footprint == COST.of(16)
            assert sorted((c, len(lanes)) for c, lanes in first.holders.items()) == \
                [("a", 4), ("b", 4), ("c", 4), ("d", 4)]
            refused = await _claim(hosting, "e", 1)
            assert isinstance(refused, str)
            assert "coordinator e asks 1 lanes" in refused
            assert "0 of this stage's 16 are free (coordinator a holds 4, coordinator b holds 4, " \
                   "coordinator c holds 4, coordinator d holds 4)" in refused
            assert "memory" not in refused  # the lanes held are why, not memory
            assert "larger --lanes" in refused
        finally:
            await hosting.close()

    asyncio.run(scenario())


def test_a_claim_refused_because_memory_held_the_lanes_down_is_told_so(fake: None) -> None:
    async def scenario() -> None:
        budget = COST.of(4) + 4 * COST.per_lane + MIB  # room for 2 lanes past the first claim's 4
        hosting = _hosting(budget=budget)
        try:
            a = await _claim(hosting, "a", 4)
            assert isinstance(a, Hosted)
            assert a.engine.lanes == 6
            refused = await _claim(hosting, "b", 4)
            assert isinstance(refused, str)
            assert "2 of this stage's 6 are free (coordinator a holds 4)" in refused
            assert "memory held this range to 6 lanes when it loaded (a lane's KV for 512 tokens takes 10.0 MiB; " \
                   "with its first claim's 4 lanes it took 140 MiB of the 181 MiB left of this stage's --memory " \
                   "181 MiB" in refused, refused
            assert "give the stage more --memory" in refused
            assert await _claim(hosting, "b", 2) is a  # what memory left room for
        finally:
            await hosting.close()

    asyncio.run(scenario())


def test_memory_held_lanes_on_a_stage_without_memory_says_what_is_free(
        fake: None, monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario() -> None:
        free = COST.of(2) + COST.per_lane  # half a lane past the ask: none
        monkeypatch.setattr("stage.hosted.psutil.virtual_memory", lambda: SimpleNamespace(available=free))
        hosting = _hosting(budget=None)
        try:
            assert isinstance(await _claim(hosting, "a", 2), Hosted)
            refused = await _claim(hosting, "b", 1)
            assert isinstance(refused, str)
            assert "memory held this range to 2 lanes" in refused
            assert "130 MiB left free on this machine" in refused
            assert "free memory on this machine, or start the stage with --lanes N" in refused
        finally:
            await hosting.close()

    asyncio.run(scenario())


def test_an_explicit_lanes_is_what_the_claims_share_and_its_refusal_names_no_memory(fake: None) -> None:
    async def scenario() -> None:
        hosting = _hosting(lanes=4, budget=COST.of(4))  # exactly full: memory is not why
        try:
            a = await _claim(hosting, "a", 2)
            assert isinstance(a, Hosted)
            assert a.engine.lanes == 4
            assert await _claim(hosting, "b", 2) is a
            refused = await _claim(hosting, "c", 1)
            assert isinstance(refused, str)
            assert "0 of this stage's 4 are free (coordinator a holds 2, coordinator b holds 2): start the stage " \
                   "with a larger --lanes" in refused
            assert "memory" not in refused
        finally:
            await hosting.close()

    asyncio.run(scenario())


def test_a_first_claim_that_does_not_fit_is_refused_with_the_figures(fake: None) -> None:
    async def scenario() -> None:
        hosting = _hosting(budget=COST.of(3))
        try:
            refused = await _claim(hosting, "a", 4)
            assert refused == (f"layers [4,8) of package {'ab' * 6} needs 140 MiB (weights and KV for 4 lanes of "
                               "512 tokens) and 130 MiB is left of this stage's --memory 130 MiB")
            assert not hosting.ranges
        finally:
            await hosting.close()

    asyncio.run(scenario())
