"""The event loop that `mesh serve` and `mesh stage` run on: uvloop where it installs.

Every token crosses each stage's event loop several times (a frame read, a step queued, the
engine thread's wake-up, a frame or an SSE chunk written), so the loop's own cost is paid
per token on the critical path. uvloop runs those callbacks and socket writes in C; asyncio's
loop is the fallback where uvloop does not build (Windows).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)`, on uvloop when it is installed."""
    try:
        import uvloop
    except ImportError:  # Windows: uvloop does not build there
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)
