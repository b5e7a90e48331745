"""One coordinator's claim on a stage: its term, its lease, what it prepared, and the links
and lanes it runs on a shared range (DESIGN.md §4).

A stage keeps one Lease per coordinator. Each is fenced by its own term: a coordinator's
newer term supersedes only its own older lease, never another coordinator's. A lease ends
when its coordinator stops it, when a newer term of the same coordinator claims, or when it
is not renewed in time; ending it closes its links and gives its lanes back, emptied.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from proto import meshpipe_pb2 as pb
from stage.activations import ActivationStage
from stage.hosted import Hosted
from stage.prepare import Fetcher, PreparedStage, Progress, Wanted, prepare_stage

log = logging.getLogger("meshpipe.stage")


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass
class Lease:
    coordinator: str
    term: int
    until_ms: int
    state: int = pb.STARTING
    message: str = ""
    range: tuple[int, int] = (0, 0)
    progress: Progress = field(default_factory=Progress)
    prepare_task: asyncio.Task[PreparedStage] | None = None
    prepared: PreparedStage | None = None
    hosted: Hosted | None = None  # the range it runs, shared with other claims
    active: ActivationStage | None = None  # its links and sessions on that range
    listener: asyncio.Server | None = None
    loading: bool = False  # a Load runs for it: the lease does not run out meanwhile
    length_ms: int = field(init=False)  # how long it was claimed for: what any call of its renews it by

    def __post_init__(self) -> None:
        self.length_ms = max(self.until_ms - now_ms(), 1000)

    @property
    def live(self) -> bool:
        return self.loading or self.until_ms > now_ms()

    def touch(self) -> None:
        """Its coordinator called (Inventory while it prepares, Load): it is alive."""
        self.until_ms = max(self.until_ms, now_ms() + self.length_ms)

    def prepare(self, request: pb.PrepareRequest, fetch: Fetcher | None, cache_dir: Path,
                placeholders: bool) -> None:
        """Start preparing the request's range in the background (Inventory reports it)."""
        self.progress, self.prepared = Progress(), None
        self.range = (request.layer_start, request.layer_end)
        wanted = Wanted(request.package_ref, request.manifest_sha256, request.layer_start, request.layer_end,
                        mtp=request.mtp)
        self.prepare_task = asyncio.get_running_loop().create_task(prepare_stage(
            wanted, cache_dir, fetch, self.progress, placeholders=placeholders))
        self.prepare_task.add_done_callback(self._prepared)

    def _prepared(self, task: asyncio.Task[PreparedStage]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self.message = f"prepare failed: {exc}"
            log.error(self.message)
        else:
            self.prepared = task.result()

    async def cancel_prepare(self) -> None:
        if self.prepare_task and not self.prepare_task.done():
            self.prepare_task.cancel()
            await asyncio.gather(self.prepare_task, return_exceptions=True)
        self.prepare_task = None

    def inventory(self, engine: str) -> pb.InventoryReply:
        task = self.prepare_task
        if task is None:
            state = pb.IDLE
        elif not task.done():
            state = pb.PREPARING
        elif not task.cancelled() and task.exception() is None:
            # read the result here: `_prepared` runs a loop turn after the task is done, and
            # an Inventory in that turn would otherwise report a failure with no message
            self.prepared, state = task.result(), pb.PREPARED
        else:
            state = pb.PREPARE_FAILED
        sha = self.prepared.manifest_sha if self.prepared else ""
        return pb.InventoryReply(state=state, message=self.message if state == pb.PREPARE_FAILED else "",
                                 bytes_done=self.progress.bytes_done, bytes_total=self.progress.bytes_total,
                                 layer_start=self.range[0], layer_end=self.range[1],
                                 manifest_sha256=sha, engine=engine)

    async def unload(self, release: Callable[[Hosted, str], Awaitable[None]]) -> None:
        """Close its links and give its lanes back (`release`: the stage's Hosting.release)."""
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        if self.active is not None:
            await self.active.stop()
            self.active = None
        if self.hosted is not None:
            hosted, self.hosted = self.hosted, None
            await release(hosted, self.coordinator)

    async def end(self, release: Callable[[Hosted, str], Awaitable[None]]) -> None:
        """Stop preparing, close its links and give its lanes back."""
        await self.cancel_prepare()
        await self.unload(release)

    def claim_info(self) -> pb.ClaimInfo:
        sessions = len(self.active.core.lanes) if self.active is not None else 0
        lanes = self.active.core.lanes.lanes if self.active is not None else 0
        sha = self.hosted.key.manifest_sha if self.hosted is not None else ""
        return pb.ClaimInfo(coordinator_id=self.coordinator, term=self.term, lease_until_ms=self.until_ms,
                            layer_start=self.range[0], layer_end=self.range[1], manifest_sha256=sha,
                            lanes=lanes, lanes_in_use=sessions, state=self.state)  # type: ignore[arg-type]
