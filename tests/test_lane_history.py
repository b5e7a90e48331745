"""A lane's history never breaks a request (issue 39).

A lane serves request after request, and the prefix cache hands a later request the lane
whose KV matches its prompt best, whatever came before. The draft kept where its KV started
in the lane's sequence across requests: after a long prompt it had started over near that
prompt's end, and a shorter prompt on the same lane found nothing to propose from, at
position -1 (HTTP 500, every time). Real `mesh serve` processes; every answer must equal a
single-node `--no-draft` server's (tests/lanes.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from lanes import REFERENCE_ARGS, THREADS, Reference, ask
from mesh_server import mesh_serve

pytestmark = pytest.mark.mesh

LONG = " ".join(f"Item {i}: the quick brown fox number {i} jumps over the lazy dog." for i in range(40))
# the reproduction: a short prompt, a long one sharing its start, then its start again
HISTORY = ["Item 0: the quick brown fox", LONG, LONG[:60], LONG[:200], "Hello"]


@pytest.fixture(scope="module")
def reference(serve_cache: Path) -> Iterator[Reference]:
    with mesh_serve(serve_cache, *REFERENCE_ARGS, threads=THREADS) as (url, _):
        yield Reference(url)


def test_a_shorter_prompt_after_a_long_one_on_the_same_lane_is_served(serve_cache, reference):
    with mesh_serve(serve_cache, "--local-stages", "2", "--draft-window", "4", threads=THREADS) as (url, _):
        answers = [ask(url, "/v1/completions", {"prompt": p, "max_tokens": 8, "temperature": 0}) for p in HISTORY]
        health = httpx.get(f"{url}/health", timeout=10).json()
    expected = [reference("/v1/completions", {"prompt": p, "max_tokens": 8, "temperature": 0}) for p in HISTORY]
    assert [a.status for a in answers] == [200] * len(HISTORY), [a.error for a in answers]
    assert answers == expected
    assert health["ok"]
    assert health["internal_errors"] == 0
