"""How many frames the window controllers keep in flight (`Controller.depth`), from synthetic
measurements, and the generate loop keeping no more out. No model is loaded."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from test_generate_events import LONG, PROMPT, ScriptedDraft, ScriptedPipeline

from common.sampling import Sampled
from mesh.backend import GenerationRequest
from mesh.pipeline import Lease
from mesh.request_state import Live, RequestState
from mesh.speculative.loop import generate
from mesh.speculative.window import Adaptive, CostAware, Fixed
from packages.speculative import WindowPolicy

POLICY = WindowPolicy(policy="cost-aware", initial=4, min=1, max=8)
Line = Callable[[int], float]  # seconds for a window of k drafts


def measured(limit: int, accept: float, draft_step: float, verify: Line, stage0: Line | None) -> CostAware:
    """A cost-aware controller that has timed plain decodes and windows of 10 and 20 (each sent
    alone), with `accept` of every window's drafts accepted, under a bound of `limit`."""
    w = CostAware(POLICY)
    w.depth(limit)
    for _ in range(5):
        for k in (0, 10, 20):
            w.record(k, round(k * accept), draft_step * k, verify(k), stage0(k) if stage0 else None)
    return w


def one_at_a_time(accept: float, draft_step: float, verify: Line) -> int:
    """The window the cost-aware controller chose before it priced frames in flight."""
    best_k, best_rate = 0, 1.0 / verify(0)
    for k in range(POLICY.min, POLICY.max + 1):
        rate = (1 - accept ** (k + 1)) / (1 - accept) / (k * draft_step + verify(k))
        if rate > best_rate:
            best_k, best_rate = k, rate
    return best_k


# a 20 ms-each-way hop: the round trip dwarfs the draft and stage 0's own compute
def LONG_TRIP(k: int) -> float:
    return 0.045 + 0.001 * k


def STAGE0(k: int) -> float:
    return 0.002 + 0.0005 * k


def test_a_long_round_trip_and_high_acceptance_keep_several_frames_in_flight():
    w = measured(3, 0.8, 0.001, LONG_TRIP, STAGE0)
    assert w.depth(3) > 1
    assert 1 <= w.next_window() <= one_at_a_time(0.8, 0.001, LONG_TRIP)  # no longer: a frame ahead is cheap


def test_a_fast_link_and_a_slow_draft_keep_one_frame_in_flight():
    # stage 0 is nearly the whole round trip and drafting costs more than a verify pass's rows
    w = measured(3, 0.8, 0.006, lambda k: 0.010 + 0.001 * k, lambda k: 0.0095 + 0.00095 * k)
    assert w.next_window() >= 1  # speculation pays, frames ahead do not
    assert w.depth(3) == 1


def test_low_acceptance_keeps_one_frame_in_flight():
    # a frame ahead pays only when every draft before it is accepted: here 1 in 10
    w = measured(3, 0.1, 0.001, LONG_TRIP, STAGE0)
    assert w.next_window() >= 1  # a window still pays over a 20 ms hop
    assert w.depth(3) == 1


def test_stage0_never_measured_keeps_one_frame_in_flight():
    w = measured(3, 0.8, 0.001, LONG_TRIP, None)
    assert w.depth(3) == 1
    assert w.accept is not None
    assert w.next_window() == one_at_a_time(w.accept, 0.001, LONG_TRIP)


@pytest.mark.parametrize(("accept", "draft_step", "verify"), [
    (0.8, 0.001, LONG_TRIP), (0.5, 0.002, LONG_TRIP), (0.9, 0.0005, lambda k: 0.010 + 0.002 * k),
    (0.3, 0.01, lambda k: 0.010 + 0.001 * k),  # speculation off
])
def test_one_frame_in_flight_is_the_one_at_a_time_choice_exactly(accept, draft_step, verify):
    w = measured(1, accept, draft_step, verify, STAGE0)
    assert w.depth(1) == 1
    assert w.accept is not None
    assert w.next_window() == one_at_a_time(w.accept, draft_step, verify)


def test_depth_never_exceeds_the_limit():
    for limit in range(1, 7):
        w = measured(limit, 0.95, 0.0005, lambda k: 0.1 + 0.001 * k, STAGE0)
        assert 1 <= w.depth(limit) <= limit
        assert w.depth(1) == 1
    assert w.depth(6) > 3  # so the limit was what held it


def test_fixed_and_adaptive_keep_the_limit():
    assert Fixed(POLICY).depth(4) == 4
    assert Adaptive(POLICY).depth(2) == 2


class TwoDeep(Fixed):
    def depth(self, limit: int) -> int:
        return min(2, limit)


def test_the_loop_keeps_no_more_frames_out_than_the_controller_asks():
    pipeline = ScriptedPipeline(LONG)
    req = GenerationRequest(PROMPT, 20)
    window = TwoDeep(WindowPolicy(policy="fixed", initial=2, min=1, max=2))

    async def go() -> list[int]:
        loop = generate(pipeline, Lease(1, 0), Live(RequestState(req)), 64, ScriptedDraft(LONG), window, 4)  # type: ignore[arg-type]
        return [e.token async for e in loop if isinstance(e, Sampled)]

    assert asyncio.run(go()) == LONG[:20]
    assert pipeline.most == 2
