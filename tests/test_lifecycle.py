"""Lanes driven through realistic histories: a stateful test of the request lifecycle (issue 39).

A real `mesh serve` of 2 and of 3 stages, with the draft, prompt lookup and the prefix cache
all on and two lanes, so each lane serves request after request: long prompts then short
ones, prompts sharing a start and prompts that do not, greedy and seeded, stop strings and
JSON schemas, streams the client cuts, pairs at once, and a stage killed and healed between
requests. After every step: no response was a 5xx, every completed request equals the same
request on a single-node `--no-draft --no-prefix-cache` server token for token (its text,
finish reason and completion tokens; tests/lanes.py), and /health is 200 with no internal
error counted.

Hypothesis shrinks a failing history; the server's lanes are not reset between examples, so
a shrunk history is a lead, and the history that broke it belongs in test_lane_history.py.
In CI it runs a few minutes (EXAMPLES x STEPS per mesh, derandomized); set
MESHPIPE_LIFECYCLE_EXAMPLES and MESHPIPE_LIFECYCLE_STEPS for a longer, random run, with
`--timeout 0` (pytest's limit is 600 s a test) and `-s` for its progress.
"""

from __future__ import annotations

import os
import random
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test
from lanes import REFERENCE_ARGS, THREADS, TIMEOUT, Answer, Reference, ask
from mesh_server import mesh_serve, wait_for

from bench.harness.local_server import stage_pids
from mesh.model.source import EMBEDDED_ID

pytestmark = pytest.mark.soak

EXAMPLES = int(os.environ.get("MESHPIPE_LIFECYCLE_EXAMPLES", "3"))
STEPS = int(os.environ.get("MESHPIPE_LIFECYCLE_STEPS", "12"))
LONG_RUN = "MESHPIPE_LIFECYCLE_STEPS" in os.environ


WORDS = ["river", "stone", "lamp", "winter", "harbour", "signal", "copper", "orchard", "lantern", "north", "quiet",
         "engine", "paper", "garden", "bridge", "window", "morning"]


def _pool() -> list[str]:
    """Prompts of about 1 to 1,500 tokens: cuts of two long texts, so many share a start with
    a longer or shorter one, a copy-heavy one (prompt lookup finds its matches) and a varied
    one (the draft proposes), each with a second ending, and short prompts sharing nothing."""
    varied = " ".join(random.Random(39).choices(WORDS, k=1200))
    copied = " ".join(f"Item {i}: the quick brown fox number {i} jumps over the lazy dog." for i in range(120))
    cuts = [30, 60, 200, 700, 2000, 5200]
    pool = [text[:n] for text in (varied, copied) for n in cuts]
    pool += [copied[:700] + " Now list the items in reverse order.", varied[:200] + "\nSummarise this.",
             "Hello", "Write a haiku about rain.", "1, 2, 3,", "def add(a, b):"]
    return pool


POOL = _pool()
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24}, "count": {"type": "integer"}},
          "required": ["name", "count"], "additionalProperties": False}
# few seeds and lengths, so the reference answers a request once and the mesh many times
_SAMPLING = st.one_of(st.just({"temperature": 0}),
                      st.builds(lambda seed, t: {"temperature": t, "seed": seed}, st.integers(0, 3),
                                st.sampled_from([0.7, 1.0])))
_MAX_TOKENS = st.sampled_from([1, 2, 5, 16, 33, 64])
_EXTRA = st.sampled_from([{}, {}, {"stop": ["\n"]}, {"stop": [" the", "."]}])
_FORMAT = st.sampled_from([{}, {}, {"response_format": {"type": "json_schema",
                                                        "json_schema": {"name": "thing", "schema": SCHEMA}}}])


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    """A completions or chat request from the pool: the path and its body."""
    prompt = draw(st.sampled_from(POOL))
    body = {"max_tokens": draw(_MAX_TOKENS), **draw(_SAMPLING), **draw(_EXTRA)}
    if draw(st.booleans()):
        return "/v1/completions", {"prompt": prompt, **body}
    return "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}], **body, **draw(_FORMAT)}


class Lifecycle(RuleBasedStateMachine):
    url: str
    pid: int
    stages: int
    reference: Reference
    asked = 0  # requests sent, over every example: the long run reports them
    steps = 0

    def __init__(self) -> None:
        super().__init__()
        self.kills = 0

    def _check(self, path: str, body: dict[str, Any], got: Answer) -> None:
        Lifecycle.asked += 1
        assert got.status < 500, f"{got.status} for {path} {body}: {got.error}"
        assert got.status == 200, f"{got.status} for {path} {body}: {got.error}"
        assert got == self.reference(path, body), f"{path} {body}"

    @rule(request=requests())
    def one(self, request: tuple[str, dict[str, Any]]) -> None:
        self._check(*request, ask(self.url, *request))

    @rule(a=requests(), b=requests())
    def pair(self, a: tuple[str, dict[str, Any]], b: tuple[str, dict[str, Any]]) -> None:
        with ThreadPoolExecutor(2) as both:
            answers = list(both.map(lambda r: ask(self.url, *r), (a, b)))
        for request, got in zip((a, b), answers, strict=True):
            self._check(*request, got)

    @rule(request=requests(), after=st.integers(1, 12))
    def cut(self, request: tuple[str, dict[str, Any]], after: int) -> None:
        """A stream the client closes after `after` events: what came was no error."""
        path, body = request
        with httpx.stream("POST", f"{self.url}{path}", json={"model": EMBEDDED_ID, **body, "stream": True},
                          timeout=TIMEOUT) as r:
            assert r.status_code == 200, r.read()
            events = 0
            for line in r.iter_lines():
                assert '"error"' not in line, line
                events += line.startswith("data: ")
                if events >= after:
                    break
        Lifecycle.asked += 1

    @precondition(lambda self: self.kills < 1)
    @rule(which=st.integers(0, 1))
    def kill(self, which: int) -> None:
        """A stage SIGKILLed between requests; the next step finds the route rebuilt."""
        victims = stage_pids(self.pid)
        before = _recoveries(self.url)
        os.kill(victims[min(which, len(victims) - 1)], signal.SIGKILL)
        self.kills += 1
        # healthy again after the coordinator has seen the loss and rebuilt: before it sees it,
        # /health still answers for the old route (a race that failed a CI run)
        wait_for(lambda: _recoveries(self.url) > before and _healthy(self.url)
                 and len(stage_pids(self.pid)) == self.stages - 1, timeout=90)

    @invariant()
    def healthy(self) -> None:
        Lifecycle.steps += 1
        if LONG_RUN and Lifecycle.steps % 100 == 0:
            print(f"lifecycle: {self.stages} stages, {Lifecycle.steps} steps", flush=True)
        health = httpx.get(f"{self.url}/health", timeout=10)
        assert health.status_code == 200, health.text
        assert health.json()["internal_errors"] == 0, health.text


def _recoveries(url: str) -> int:
    """The route recoveries /health counts (-1 while it does not answer)."""
    try:
        return int(httpx.get(f"{url}/health", timeout=10).json()["recoveries"])
    except (httpx.HTTPError, ValueError, KeyError):
        return -1


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=10).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def reference(serve_cache: Path) -> Iterator[Reference]:
    with mesh_serve(serve_cache, *REFERENCE_ARGS, threads=THREADS) as (url, _):
        yield Reference(url)


@pytest.mark.parametrize("stages", [2, 3])
def test_lanes_through_any_history_answer_as_a_single_node_does(serve_cache, reference, stages):
    args = ("--local-stages", str(stages), "--strategy", "ngram+draft", "--lanes", "2", "--warm-up")
    with mesh_serve(serve_cache, *args, threads=THREADS) as (url, proc):
        machine = type(f"Lifecycle{stages}", (Lifecycle,), {"url": url, "pid": proc.pid, "stages": stages,
                                                          "reference": reference})
        run_state_machine_as_test(machine, settings=settings(
            max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None, derandomize=not LONG_RUN,
            database=None, suppress_health_check=list(HealthCheck), print_blob=True))
    print(f"lifecycle: {stages} stages, {Lifecycle.steps} steps and {Lifecycle.asked} requests so far, "
          f"{len(reference.known)} distinct")

