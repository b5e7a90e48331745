"""Continuous batching: whatever steps are ready run together in one engine decode.

Sessions submit steps in order and await their outputs. The worker takes everything queued,
at most one step per lane (a lane's next step depends on the previous one), runs a single
engine.step in a thread so the event loop keeps moving frames, and resolves the futures.

Every engine call in the process runs on one thread, shared by all batchers (stage 0 and
the draft at the coordinator). llama.cpp's CPU backend keeps an OpenMP thread team per
calling thread: calls spread over a pool's threads made decode three to four times
slower, and a second engine on its own thread made speculative windows ten times slower.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from common.errors import EngineError
from stage.engine import RangeEngine, Step

T = TypeVar("T")


class VoidFrameError(Exception):
    """A queued step was dropped unrun: a newer epoch of its session made it void (DESIGN.md §6)."""


ENGINE_THREAD = ThreadPoolExecutor(1, thread_name_prefix="engine")  # every engine, llama.cpp or MLX


async def close_engine(engine: RangeEngine) -> None:
    """Free an engine on the engine thread, after any decode still running there."""
    await asyncio.get_running_loop().run_in_executor(ENGINE_THREAD, engine.close)


async def on_engine_thread(fn: Callable[..., T], *args: object) -> T:
    """Run `fn` (an engine's construction) on the engine thread, where its steps will run:
    MLX arrays belong to the thread that made them (stage.mlx_engine.release_streams)."""
    return await asyncio.get_running_loop().run_in_executor(ENGINE_THREAD, fn, *args)


@dataclass
class StepClock:
    """When a step was queued, and when the decode that ran it started and ended.

    perf_counter seconds in this process. The decode's time is shared by every step batched
    into it, so `compute_s` is the wall time a step waited on the engine, not its share.
    """

    queued: float = field(default_factory=time.perf_counter)
    started: float = 0.0
    finished: float = 0.0
    rows: int = 0  # in the decode that ran the step, every session's together

    @property
    def queue_s(self) -> float:
        return max(self.started - self.queued, 0.0)

    @property
    def compute_s(self) -> float:
        return max(self.finished - self.started, 0.0)


@dataclass
class _Job:
    step: Step | None  # None: a control job (trim/free) run between decodes
    future: asyncio.Future[np.ndarray]
    control: Callable[[], None] | None = None
    clock: StepClock = field(default_factory=StepClock)


class Batcher:
    def __init__(self, engine: RangeEngine) -> None:
        self.engine = engine
        self.max_rows = engine.graph_rows  # a decode of several sessions fits one graph
        # micro-batches (DESIGN.md §3): the most steps one decode may take, asked per decode
        self.max_steps: Callable[[], int] | None = None
        self.busy_s = 0.0  # engine time spent on this batcher's decodes and controls, since start
        self.jobs: list[_Job] = []
        self.wake = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        self.stopped = False

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        self.stopped = True  # work queued from here on fails at once: no worker will take it
        if self.task:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        for job in self.jobs:
            if not job.future.done():
                job.future.set_exception(EngineError("stage stopped"))
        self.jobs.clear()

    def submit(self, step: Step, clock: StepClock | None = None) -> asyncio.Future[np.ndarray]:
        """Queue `step`; `clock`, if given, is stamped when its decode starts and ends."""
        future = asyncio.get_running_loop().create_future()
        return self._enqueue(_Job(step, future, clock=clock or StepClock()))

    def control(self, action: Callable[[], None]) -> asyncio.Future[np.ndarray]:
        """Run `action` on the engine thread, ordered after every step queued before it."""
        job = _Job(None, asyncio.get_running_loop().create_future(), control=action)
        return self._enqueue(job)

    def trim(self, lane: int, position: int) -> asyncio.Future[np.ndarray]:
        """Drop the lane's KV from `position` on, in order with the steps queued before."""
        return self.control(functools.partial(self.engine.trim, lane, position))

    def discard_lane(self, lane: int) -> int:
        """Drop the lane's queued steps before they run (control jobs stay); their futures
        fail with VoidFrameError. A step already running runs to its end. Returns how many."""
        dropped = [j for j in self.jobs if j.step is not None and j.step.lane == lane]
        self.jobs = [j for j in self.jobs if j not in dropped]
        for job in dropped:
            if not job.future.done():
                job.future.set_exception(VoidFrameError("dropped before it ran: its epoch is void"))
        return len(dropped)

    def _enqueue(self, job: _Job) -> asyncio.Future[np.ndarray]:
        if self.stopped:
            job.future.set_exception(EngineError("stage stopped"))
            return job.future
        self.jobs.append(job)
        self.wake.set()
        return job.future

    def _take(self) -> list[_Job]:
        """The longest queue prefix that is safe to run as one unit, in order."""
        if self.jobs[0].step is None:
            return [self.jobs.pop(0)]
        taken: list[_Job] = []
        lanes: set[int] = set()
        rows = 0
        steps = self.max_steps() if self.max_steps else len(self.jobs)
        for job in self.jobs:
            if job.step is None or job.step.lane in lanes or len(taken) >= steps:
                break
            if taken and rows + job.step.n > self.max_rows:
                break
            taken.append(job)
            lanes.add(job.step.lane)
            rows += job.step.n
        del self.jobs[: len(taken)]
        return taken

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._next()
            # One wake-up of the event loop per decode: the engine thread hands back every
            # result in one callback (`_finish`), where wrapping the executor's future
            # would post a second callback for the same decode.
            done: asyncio.Future[None] = loop.create_future()
            work = ENGINE_THREAD.submit(self._execute, batch, done)
            try:
                await done
            except asyncio.CancelledError:
                # Stopped while the batch waited for the engine thread (shared with other
                # engines): it will never run now, so fail its steps or they wait forever.
                # A batch already running resolves them itself when its decode ends: failing
                # them earlier would let callers free what the decode still uses.
                if work.cancel():
                    for job in batch:
                        if not job.future.done():
                            job.future.set_exception(EngineError("stage stopped"))
                raise

    async def _next(self) -> list[_Job]:
        """Wait for work, then take what runs next."""
        while not self.jobs:
            self.wake.clear()
            await self.wake.wait()
        return self._take()

    def _execute(self, batch: list[_Job], done: asyncio.Future[None]) -> None:
        results: list[np.ndarray | BaseException] = []
        started = time.perf_counter()
        try:
            if batch[0].control is not None:
                results = [self._guard(batch[0].control)]
            else:
                results = self._step_all([j.step for j in batch if j.step is not None])
        except Exception as exc:  # noqa: BLE001 -- never let the worker die with futures pending
            results = [exc] * len(batch)
        finally:
            finished = time.perf_counter()
            self.busy_s += finished - started
            rows = sum(job.step.n for job in batch if job.step is not None)
            for job in batch:
                job.clock.started, job.clock.finished, job.clock.rows = started, finished, rows
            done.get_loop().call_soon_threadsafe(_finish, batch, results, done)

    def _step_all(self, steps: list[Step]) -> list[np.ndarray | BaseException]:
        try:
            return list(self.engine.step(steps))
        except EngineError as exc:
            if len(steps) == 1:
                return [exc]
        # One bad step must not fail its neighbours: retry each alone.
        return [self._guard(functools.partial(self._one, s)) for s in steps]

    def _one(self, step: Step) -> np.ndarray:
        return self.engine.step([step])[0]

    @staticmethod
    def _guard(action: Callable[[], object]) -> np.ndarray | BaseException:
        try:
            result = action()
            return result if isinstance(result, np.ndarray) else np.empty(0)
        except Exception as exc:  # noqa: BLE001 -- the error goes to the job's future, not up the worker
            return exc


def _finish(batch: list[_Job], results: list[np.ndarray | BaseException], done: asyncio.Future[None]) -> None:
    """On the event loop: resolve a decode's steps, then let the worker take the next batch."""
    if len(results) != len(batch):  # the decode was interrupted (BaseException): none of it counts
        results = [EngineError("the engine step was interrupted")] * len(batch)
    for job, result in zip(batch, results, strict=True):
        _resolve(job.future, result)
    if not done.done():
        done.set_result(None)


def _resolve(future: asyncio.Future[np.ndarray], result: np.ndarray | BaseException) -> None:
    if future.done():
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)
