"""The work that an object with a `start` and a `stop` owns: one anyio task group in one cancel scope.

The coordinator (the server) and each route's pipeline live from a `start` to a `stop` that
are separate calls, not one `async with` block, so each keeps its task group open in a host
task of its own. `stop` cancels the scope and returns once every task in it has ended: what
an owner started ends with it, and nothing it started outlives it (DESIGN.md §2, "Healing").

anyio's cancellation is level-triggered: inside a cancelled scope every await is cancelled
again, not only the first. Cleanup that must finish (tearing down a route's stages) shields
itself with `anyio.CancelScope(shield=True)`.

A task that fails is logged and ends alone. The owner has no `await` open on the group to be
told, and the liveness watcher must not stop watching because one rebuild raised.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import anyio
from anyio.abc import TaskGroup

log = logging.getLogger("meshpipe.tasks")

Job = Callable[[], Awaitable[None]]


class TaskScope:
    def __init__(self, name: str) -> None:
        self.name = name
        self.scope: anyio.CancelScope | None = None  # made in `start`: anyio needs the running loop
        self.stopped = False
        self._group: TaskGroup | None = None
        self._early: list[tuple[Job, str]] = []  # spawned before the host entered the group
        self._host: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Open the group (in a host task, so that a caller need not be async)."""
        assert self._host is None, f"{self.name} started twice"
        self.scope = anyio.CancelScope()
        self._host = asyncio.get_running_loop().create_task(self._hold(self.scope), name=self.name)

    def spawn(self, job: Job, name: str) -> bool:
        """Run `job` in the group. Once `stop` was called nothing more starts: False."""
        if self.stopped:
            return False
        if self._group is None:
            self._early.append((job, name))
        else:
            self._group.start_soon(self._guarded, job, name, name=f"{self.name}: {name}")
        return True

    async def stop(self) -> None:
        """Cancel every task of the group and return once all of them have ended."""
        self.stopped = True
        if self.scope is not None and self._host is not None:
            self.scope.cancel()
            await asyncio.wait([self._host])

    async def _hold(self, scope: anyio.CancelScope) -> None:
        with scope:
            async with anyio.create_task_group() as group:
                self._group = group
                for job, name in self._early:
                    group.start_soon(self._guarded, job, name, name=f"{self.name}: {name}")
                self._early.clear()
                await anyio.sleep_forever()

    async def _guarded(self, job: Job, name: str) -> None:
        try:
            await job()
        except Exception:  # logged here: nobody awaits the group to be told
            log.exception("%s: %s failed", self.name, name)
