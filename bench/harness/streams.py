"""Streams at once against one server: prompts cycled to a count, sent in parallel, in batches."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from bench.harness.client import StreamTiming, stream_chat
from bench.harness.harness import Setup


def cycled(prompts: list[str], n: int) -> list[str]:
    """`n` prompts, the given ones over again as often as it takes."""
    return [prompts[i % len(prompts)] for i in range(n)]


def run_batches(url: str, setup: Setup, batches: list[list[str]]) -> int:
    return sum(parallel(url, setup, batch)[0] for batch in batches)


def parallel(url: str, setup: Setup, prompts: list[str]) -> tuple[int, float, list[StreamTiming]]:
    start = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        timings = list(pool.map(lambda p: stream_chat(url, setup.model_id, p, setup.tokens), prompts))
    wall = time.perf_counter() - start
    return sum(t.completion_tokens for t in timings), wall, timings
