"""The request lifecycle's fast variant (issue 39): `Requests` in-process on the tiny model.

The same machine as tests/test_lifecycle.py, without processes or HTTP: a mesh with the
draft, prompt lookup and the prefix cache on, two lanes, against one with none of them,
each request starting from an empty lane there. Prompts share starts and come long then
short; greedy and seeded; single, in pairs, or left by their caller partway. Every request
that completes gives the reference's tokens, and none fails. The tiny model is quantized to
Q4_0, whose kernels give a k-row decode the k single rows' logits bit for bit (in f32 they
differ by up to 2e-3, which flipped 2 of 640 seeded draws), and a draw depends only on the
seed and the position, so speculation and the prefix cache may change nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from pathlib import Path
from typing import TypeVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test
from inproc_requests import Served, serving

from common.sampling import Sampled, SamplingParams
from mesh.backend import GenerationRequest
from mesh.serving.warm_up import warm_up
from mesh.speculative.draft import Draft
from packages.requantize import requantize

T = TypeVar("T")

# a long and a repetitive sequence; prompts are their cuts, with other endings, and short ones
_LONG = [(i * 7 + 3) % 60 + 3 for i in range(200)]
_COPY = [3 + i % 9 for i in range(160)]
POOL = [_LONG[:n] for n in (1, 5, 40, 120, 200)] + [_COPY[:n] for n in (12, 80, 160)] + \
       [[*_LONG[:40], 9, 9, 9], [*_COPY[:80], 50, 51], [4], [7, 8]]
_SAMPLING = st.one_of(st.just(SamplingParams()),
                      st.builds(lambda seed: SamplingParams(temperature=0.9, seed=seed), st.integers(0, 2**32)))
_REQUESTS = st.builds(lambda prompt, n, sampling: GenerationRequest(prompt, n, sampling, ignore_eos=True),
                      st.sampled_from(POOL), st.integers(1, 24), _SAMPLING)


async def _tokens(served: Served, req: GenerationRequest, leave_after: int | None = None) -> list[int]:
    """The request's tokens; with `leave_after`, the caller leaves after that many."""
    out: list[int] = []
    async with contextlib.aclosing(served.requests.generate(req)) as events:
        async for event in events:
            if isinstance(event, Sampled):
                out.append(event.token)
                if leave_after is not None and len(out) >= leave_after:
                    break
    return out


async def _both(a: Awaitable[list[int]], b: Awaitable[list[int]]) -> list[list[int]]:
    """Two requests at once, on the running loop."""
    return list(await asyncio.gather(a, b))


class Lifecycle(RuleBasedStateMachine):
    gguf: Path
    tmp: Path

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.stack = contextlib.AsyncExitStack()
        self.mesh = self._run(self.stack.enter_async_context(
            serving(self.gguf, self.tmp, draft=True, prefix_cache=True, lookup=True)))
        self.reference = self._run(self.stack.enter_async_context(
            serving(self.gguf, self.tmp, draft=False, prefix_cache=False)))
        self.known: dict[GenerationRequest, list[int]] = {}

    def _run(self, work: Awaitable[T]) -> T:
        return self.loop.run_until_complete(work)

    async def _expected(self, req: GenerationRequest) -> list[int]:
        if req not in self.known:
            self.known[req] = await _tokens(self.reference, req)
        return self.known[req]

    @rule(req=_REQUESTS)
    def one(self, req: GenerationRequest) -> None:
        assert self._run(_tokens(self.mesh, req)) == self._run(self._expected(req))

    @rule(a=_REQUESTS, b=_REQUESTS)
    def pair(self, a: GenerationRequest, b: GenerationRequest) -> None:
        got = self._run(_both(_tokens(self.mesh, a), _tokens(self.mesh, b)))
        assert got == [self._run(self._expected(a)), self._run(self._expected(b))]

    @rule(req=_REQUESTS, after=st.integers(1, 8))
    def leave(self, req: GenerationRequest, after: int) -> None:
        got = self._run(_tokens(self.mesh, req, after))
        assert got == self._run(self._expected(req))[:after]

    @invariant()
    def nothing_failed_and_every_lane_is_free(self) -> None:
        assert self.mesh.requests.failures.count == 0
        # freed when the request's caller is done with it, a caller that left included
        assert not self.mesh.pipeline.core.lanes.by_session
        assert self.mesh.requests.admission.inside == 0

    def teardown(self) -> None:
        self._run(self.stack.aclose())
        self.loop.close()


@pytest.fixture(scope="module")
def tiny_q4_0(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return requantize(tiny_gguf, tmp_path_factory.mktemp("tiny-q4_0") / "tiny-q4_0.gguf", "Q4_0")


def test_lanes_through_any_history_give_the_reference_tokens(tiny_q4_0: Path, tmp_path: Path):
    machine = type("TinyLifecycle", (Lifecycle,), {"gguf": tiny_q4_0, "tmp": tmp_path})
    run_state_machine_as_test(machine, settings=settings(
        max_examples=15, stateful_step_count=20, deadline=None, derandomize=True, database=None,
        suppress_health_check=[HealthCheck.too_slow]))


def test_two_proposals_on_one_draft_lane_take_turns(tiny_q4_0: Path):
    """A request paused by a route break may still be in a long catch-up when the rebuilt route
    hands its lane to a new request: the two proposals on that draft lane must not interleave."""

    async def scenario() -> tuple[list[list[int]], list[list[int]]]:
        draft = Draft(tiny_q4_0, lanes=2, ctx_per_lane=256, threads=1)
        draft.start()
        try:
            a, b = POOL[4], POOL[7]  # a long catch-up, and another sequence altogether
            alone = [await draft.propose(1, a, 4), await draft.propose(1, b, 4)]
            draft.forget(0)
            both = list(await asyncio.gather(draft.propose(0, a, 4), draft.propose(0, b, 4)))
            return alone, both
        finally:
            await draft.stop()

    alone, both = asyncio.run(scenario())
    assert both == alone


class _WarmUpTokenizer:
    """What the warm-up reads of a tokenizer: its prompt, as tokens of the tiny model."""

    def render_chat(self, messages: object) -> str:
        return "the warm-up's prompt"

    def tokenize(self, text: str) -> list[int]:
        return list(POOL[3])


def test_the_warm_up_leaves_nothing_for_a_first_request_to_find(tiny_q4_0: Path, tmp_path: Path):
    """A fresh server's first request had reported cached prompt tokens it never sent: the
    warm-up's, left in its lane for the prefix cache."""

    async def scenario() -> int:
        async with serving(tiny_q4_0, tmp_path, draft=True, prefix_cache=True) as served:
            await warm_up(served.requests, _WarmUpTokenizer(), lambda _: None)  # type: ignore[arg-type]
            first = served.requests.generate(GenerationRequest([*POOL[3], 5], 4))
            async with contextlib.aclosing(first) as events:
                assert len([e async for e in events if isinstance(e, Sampled)]) == 4
            return first.account.cached_tokens

    assert asyncio.run(scenario()) == 0
