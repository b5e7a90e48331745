"""Slow is not dead, served (issue 53): a stage throttled as on a loaded host, with long
prompts queued at it, is waited for; the route is not rebuilt and no request fails.

The throttle stops and continues the final stage's process (SIGSTOP/SIGCONT, as cpulimit
does), so it runs a quarter of the time: every liveness ping is still answered (a pause is
shorter than the ping's 2 s deadline), but prefill chunks pile up at it, and a one-row
decode frame waits behind them far past the deadline learned on the idle host before.
Real `mesh serve --local-stages 2` processes, SmolLM2."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import random
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from mesh_server import mesh_serve, metric

from bench.harness.local_server import stage_pids

WORDS = ["river", "stone", "cloud", "lantern", "orchard", "pepper", "violin", "harbor", "meadow",
         "candle", "falcon", "copper"]
STOPPED_S, RUNNING_S = 0.6, 0.2  # a quarter of the time: chunks queue, pings are answered within 0.6 s


@contextlib.contextmanager
def throttled(pid: int) -> Iterator[None]:
    done = threading.Event()

    def cycle() -> None:
        with contextlib.suppress(ProcessLookupError):  # a route rebuilt around it ended it
            while not done.is_set():
                os.kill(pid, signal.SIGSTOP)
                time.sleep(STOPPED_S)
                os.kill(pid, signal.SIGCONT)
                time.sleep(RUNNING_S)

    worker = threading.Thread(target=cycle, daemon=True)
    worker.start()
    try:
        yield
    finally:
        done.set()
        worker.join()
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def _ask(url: str, prompt: str, max_tokens: int) -> int:
    r = httpx.post(f"{url}/v1/completions", timeout=300, json={
        "model": httpx.get(f"{url}/v1/models").json()["data"][0]["id"],
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    return r.status_code


@pytest.mark.soak
def test_long_prompts_at_a_throttled_stage_are_waited_for_not_rebuilt(serve_cache):
    rng = random.Random(53)
    long_prompts = [" ".join(rng.choice(WORDS) for _ in range(1200)) for _ in range(3)]
    with mesh_serve(serve_cache, "--local-stages", "2", "--lanes", "4") as (url, proc):
        for _ in range(3):  # the idle host's reply times: the deadlines a rush meets
            assert _ask(url, "Once upon a time", 16) == 200
        before = stage_pids(proc.pid)
        with throttled(before[-1]), concurrent.futures.ThreadPoolExecutor(4) as pool:
            asked = [pool.submit(_ask, url, p, 8) for p in long_prompts]
            time.sleep(1.0)  # the prompts' chunks are queued at the stage: a decode now waits behind them
            asked.append(pool.submit(_ask, url, "Tell me a story about a dragon.", 48))
            codes = [a.result() for a in asked]
        assert codes == [200] * 4
        assert metric(url, "meshpipe_recoveries_total") == 0
        assert metric(url, 'meshpipe_requests_total{endpoint="completions",status="5') == 0
        assert stage_pids(proc.pid) == before  # nothing respawned
        assert metric(url, "meshpipe_late_replies_total") > 0  # the deadline did pass: without the rule, a break
