"""Batcher._take: which queued jobs run together in one decode, and in what order."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from types import SimpleNamespace

import numpy as np
import pytest

from stage.batcher import Batcher, _Job
from stage.engine import Step


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def _batcher(loop: asyncio.AbstractEventLoop, jobs: list[tuple[int, int] | None], max_rows: int = 512) -> Batcher:
    """Jobs are (lane, rows) steps, or None for a control job."""
    batcher = Batcher(SimpleNamespace(graph_rows=max_rows))  # _take reads only that
    for spec in jobs:
        future = loop.create_future()
        if spec is None:
            batcher.jobs.append(_Job(None, future, control=lambda: None))
        else:
            lane, rows = spec
            batcher.jobs.append(_Job(Step(lane, 0, tokens=np.zeros(rows, np.int32)), future))
    return batcher


def _lanes(jobs: list[_Job]) -> list[tuple[int, int] | None]:
    return [None if j.step is None else (j.step.lane, j.step.n) for j in jobs]


def _drain(batcher: Batcher) -> list[list[tuple[int, int] | None]]:
    batches = []
    while batcher.jobs:
        batches.append(_lanes(batcher._take()))
    return batches


def test_distinct_lanes_run_together_in_queue_order(loop: asyncio.AbstractEventLoop):
    b = _batcher(loop, [(2, 1), (0, 1), (1, 5)])
    assert _drain(b) == [[(2, 1), (0, 1), (1, 5)]]


def test_a_lanes_second_step_waits_for_the_next_decode_and_keeps_the_order_behind_it(
        loop: asyncio.AbstractEventLoop):
    # the prefix stops at the repeated lane, even though lane 2 behind it is free
    b = _batcher(loop, [(0, 1), (1, 1), (0, 1), (2, 1), (1, 1)])
    assert _drain(b) == [[(0, 1), (1, 1)], [(0, 1), (2, 1), (1, 1)]]


def test_a_control_job_runs_alone_between_decodes(loop: asyncio.AbstractEventLoop):
    b = _batcher(loop, [(0, 1), (1, 1), None, (2, 1), None, None, (0, 1)])
    assert _drain(b) == [[(0, 1), (1, 1)], [None], [(2, 1)], [None], [None], [(0, 1)]]


def test_rows_are_capped_but_a_single_large_step_still_runs(loop: asyncio.AbstractEventLoop):
    b = _batcher(loop, [(0, 3), (1, 2), (2, 1), (3, 10), (4, 4)], max_rows=6)
    assert _drain(b) == [[(0, 3), (1, 2), (2, 1)], [(3, 10)], [(4, 4)]]


def test_the_cap_is_inclusive_and_a_later_small_step_does_not_jump_the_queue(loop: asyncio.AbstractEventLoop):
    b = _batcher(loop, [(0, 4), (1, 2), (2, 3), (3, 1)], max_rows=6)
    assert _drain(b) == [[(0, 4), (1, 2)], [(2, 3), (3, 1)]]


def test_take_removes_exactly_what_it_returns(loop: asyncio.AbstractEventLoop):
    b = _batcher(loop, [(0, 1), (0, 1), (1, 1)])
    queued = list(b.jobs)
    first = b._take()
    assert first == queued[:1]
    assert b.jobs == queued[1:]


def test_work_queued_after_stop_fails_at_once_instead_of_waiting_forever(loop: asyncio.AbstractEventLoop):
    from types import SimpleNamespace

    from common.errors import EngineError

    async def scenario() -> None:
        never = SimpleNamespace(graph_rows=48, trim=lambda lane, position: pytest.fail("a stopped batcher ran a job"))
        batcher = Batcher(engine=never)  # only trim (and its row cap) is ever looked up
        batcher.start()
        await batcher.stop()
        trim = batcher.trim(0, 0)
        assert trim.done()
        with pytest.raises(EngineError, match="stage stopped"):
            await trim

    loop.run_until_complete(scenario())


def test_micro_batches_cap_the_steps_of_a_decode(loop: asyncio.AbstractEventLoop):
    b = _batcher(loop, [(0, 1), (1, 1), (2, 5), (3, 1), (4, 1)])
    b.max_steps = lambda: 2
    assert _drain(b) == [[(0, 1), (1, 1)], [(2, 5), (3, 1)], [(4, 1)]]


def test_a_batch_dropped_unrun_by_a_stop_fails_its_steps():
    """The engine thread is shared: a batch may wait there behind another engine's work, and
    a stop then drops it unrun. Its steps must fail, not wait forever (seen in the chaos soak)."""
    from concurrent.futures import Future

    from common.errors import EngineError
    from stage import batcher as module

    class Blocked:
        def submit(self, *_: object) -> Future[None]:
            return Future()  # never runs, as behind a long decode

    async def go() -> None:
        saved, module.ENGINE_THREAD = module.ENGINE_THREAD, Blocked()  # type: ignore[assignment]
        try:
            b = Batcher(engine=SimpleNamespace(graph_rows=48))
            b.start()
            step = b.submit(Step(0, 0, tokens=np.zeros(1, np.int32)))
            await asyncio.sleep(0.05)  # the worker took it and waits for the engine thread
            await b.stop()
            with pytest.raises(EngineError, match="stage stopped"):
                await asyncio.wait_for(step, 1)
        finally:
            module.ENGINE_THREAD = saved

    asyncio.run(go())


class _Rows:
    """An engine whose step returns each step's tokens as its output (the batcher reads graph_rows)."""

    graph_rows = 512

    def __init__(self) -> None:
        self.decodes = 0

    def step(self, steps: list[Step]) -> list[np.ndarray]:
        self.decodes += 1
        return [s.tokens.astype(np.float32) for s in steps if s.tokens is not None]


def test_a_decode_wakes_the_event_loop_once_and_resolves_every_step_batched_in_it():
    """The engine thread hands back a decode's results in one callback: the loop's wake-ups
    cost on every token (DESIGN.md §2), so three steps batched together cost one."""
    async def main() -> tuple[list[np.ndarray], int, int]:
        loop = asyncio.get_running_loop()
        posted = 0
        post = loop.call_soon_threadsafe

        def counting(*args: object, **kwargs: object) -> asyncio.Handle:
            nonlocal posted
            posted += 1
            return post(*args, **kwargs)  # type: ignore[arg-type]

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        engine = _Rows()
        batcher = Batcher(engine)  # type: ignore[arg-type]
        futures = [batcher.submit(Step(lane, 0, tokens=np.full(2, lane, np.int32))) for lane in range(3)]
        batcher.start()
        outs = await asyncio.gather(*futures)
        await batcher.stop()
        return outs, posted, engine.decodes

    outs, posted, decodes = asyncio.run(main())
    assert decodes == 1
    assert posted == 1
    assert [o.tolist() for o in outs] == [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]
