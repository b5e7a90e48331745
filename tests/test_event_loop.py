"""`mesh serve` and `mesh stage` run on uvloop where it is installed, else on asyncio's loop."""

from __future__ import annotations

import asyncio
import sys

import pytest

from common import event_loop


async def _loop_module() -> str:
    await asyncio.sleep(0)
    return type(asyncio.get_running_loop()).__module__


def test_the_processes_run_on_uvloop_when_it_is_installed():
    pytest.importorskip("uvloop", reason="uvloop is not installed here (it does not build on Windows)")
    assert event_loop.run(_loop_module()).startswith("uvloop")


def test_without_uvloop_it_is_asyncios_own_loop(monkeypatch):
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop now raises ImportError
    assert event_loop.run(_loop_module()).startswith("asyncio")
