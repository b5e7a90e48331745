"""A generation's tokens and its record: the generate loop over a scripted pipeline and draft,
and usage read off the record by the OpenAI layer over the fake backend. No model is loaded."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
from typing import Any

import pytest
from fake_backend import FakeBackend
from fastapi.testclient import TestClient

from common.ids import FrameId, LaneId, SessionId
from common.sampling import Sampled, SamplingParams
from mesh.api.app import build_app
from mesh.api.responses import SpeculativeUsage, Usage
from mesh.backend import Acceptance, Account, GenerationRequest, MeshUnavailableError
from mesh.observe.metrics import Metrics
from mesh.serving.generate import generate
from mesh.serving.pipeline import Lease, Pending
from mesh.serving.proposals import Proposing
from mesh.serving.request_state import Live, Outgoing, RequestState
from mesh.speculative.proposer import Budget, Proposal
from mesh.speculative.window import Fixed, Observation, WindowPolicy

# the loop's and proposers' mechanics, not what a request's ledger allows (tests/test_ledger.py)
pytestmark = pytest.mark.usefixtures("unbounded_ledger")

PROMPT = [1, 2, 3]
TARGET = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]  # what the target samples after PROMPT
EOS = 2


class ScriptedPipeline:
    """The target's token at every row, as the final stage samples it: row i fed at
    `start` picks the token at start + i + 1."""

    def __init__(self, target: list[int]) -> None:
        self.target = target
        self.out: set[int] = set()  # frames sent and neither waited for nor void
        self.most = 0  # the most frames out at once
        self.voided: list[int] = []  # the start of each frame voided
        self.epochs: list[int] = []  # each frame's epoch, in the order sent
        self.histories: list[tuple[int, ...]] = []

    async def run(self, session: int, lane: int, start: int, tokens: list[int], sampling: Any, all_logits: bool = False,
                  kind: int = 0, history: Any = ()) -> list[Sampled]:
        rows = range(len(tokens)) if all_logits else [len(tokens) - 1]
        return [Sampled(self.target[start + i + 1 - len(PROMPT)]) for i in rows]

    async def send(self, session: int, lane: int, out: Outgoing) -> Pending:
        start, epoch = out.start, out.epoch
        self.out.add(start)
        self.most = max(self.most, len(self.out))
        self.epochs.append(epoch)
        self.histories.append(tuple(out.history))
        picks = await self.run(session, lane, start, out.tokens, out.sampling, out.all_logits, out.kind, out.history)
        # the frame id is its start here
        return Pending(SessionId(session), FrameId(start), epoch, 0.0, None, picks, 0.001)

    async def wait(self, pending: Pending) -> list[Sampled]:
        self.out.remove(pending.frame)
        assert pending.local is not None
        return pending.local

    def void(self, pending: Pending) -> None:
        self.out.remove(pending.frame)
        self.voided.append(pending.frame)


class ScriptedDraft:
    """Proposes the target's next tokens, except where `wrong` says to miss: a `Proposer`."""

    names: tuple[str, ...] = ("draft",)

    def __init__(self, target: list[int], wrong: bool = False, misses: frozenset[int] = frozenset()) -> None:
        self.target, self.wrong, self.misses = target, wrong, misses  # misses: completion indices it gets wrong

    async def propose(self, lane: int, sequence: list[int], k: int) -> list[int]:
        done = len(sequence) - len(PROMPT)
        return [t + 1000 if self.wrong or done + i in self.misses else t
                for i, t in enumerate(self.target[done:done + k])]

    async def proposal(self, lane: int, sequence: list[int], budget: Budget, guide: object = None,
                       sampling: object = None) -> Proposal:
        return Proposal(await self.propose(lane, sequence, budget("draft")), "draft", 0.001)

    def forget(self, lane: int) -> None:
        pass


def _drafted(windows: int, proposed: int, accepted: int) -> Acceptance:
    """The record of windows all proposed by the draft model."""
    return Acceptance(windows, proposed, accepted, (("draft", Acceptance(windows, proposed, accepted)),))


class Generated(list[Sampled]):
    """A generation's tokens; `records` is the acceptance record as each token left, and
    `account` the record's account at the end."""

    records: list[Acceptance]
    account: Account


def _events(max_tokens: int, target: list[int] = TARGET, draft: ScriptedDraft | None = None,
            stop: frozenset[int] = frozenset(), in_flight: int = 1, pipeline: ScriptedPipeline | None = None,
            sampling: SamplingParams | None = None) -> Generated:
    req = GenerationRequest(PROMPT, max_tokens, sampling or SamplingParams(), stop_tokens=stop)
    window = Fixed(WindowPolicy(policy="fixed", initial=2, min=1, max=2)) if draft else None
    scripted = pipeline or ScriptedPipeline(target)
    live = Live(RequestState(req, speculative=draft is not None))
    run = Generated()
    run.records = []

    async def go() -> None:
        # on purpose: scripted stand-ins for the concrete Pipeline and Draft classes, duck-typed
        loop = generate(scripted, Lease(1, 0), live, 64, Proposing(draft, window, in_flight))  # type: ignore[arg-type]
        async for sampled in loop:
            assert isinstance(sampled, Sampled)  # no prompt logprobs were asked
            run.append(sampled)
            run.records.append(live.state.acceptance)

    asyncio.run(go())
    run.account = live.state.account()
    return run


def test_without_a_draft_tokens_then_finished_with_length():
    events = _events(4)
    assert events == [Sampled(10), Sampled(11), Sampled(12), Sampled(13)]
    assert events.account == Account(3, 4, finish_reason="length")


def test_a_stop_token_finishes_with_stop_and_is_not_a_token():
    events = _events(8, target=[10, 11, EOS, 13], stop=frozenset({EOS}))
    assert events == [Sampled(10), Sampled(11)]
    assert events.account == Account(3, 2, finish_reason="stop")


def test_with_a_draft_the_record_counts_each_window_before_its_tokens_leave():
    events = _events(7, draft=ScriptedDraft(TARGET))
    # prefill gives one token; each window of 2 accepts both drafts plus the target's next
    assert events == [Sampled(t) for t in TARGET[:7]]
    assert events.records == [Acceptance(), *[_drafted(1, 2, 2)] * 3, *[_drafted(2, 4, 4)] * 3]
    assert events.account == Account(3, 7, speculative=_drafted(2, 4, 4), finish_reason="length", rule="exact")


def test_a_draft_that_always_misses_gives_one_token_per_window():
    events = _events(4, draft=ScriptedDraft(TARGET, wrong=True))
    assert [e.token for e in events] == TARGET[:4]
    # the windows shrink with the budget left: 2, then 1, then a plain decode for the last token
    assert events.account == Account(3, 4, speculative=_drafted(2, 3, 0), finish_reason="length", rule="exact")


def test_a_stop_token_inside_an_accepted_window_ends_it_there():
    target = [10, 11, 12, EOS, 14, 15]
    events = _events(8, target=target, draft=ScriptedDraft(target), stop=frozenset({EOS}))
    assert [e.token for e in events] == [10, 11, 12]
    assert events.account == Account(3, 3, speculative=_drafted(1, 2, 2), finish_reason="stop", rule="exact")


LONG = list(range(10, 50))


def test_frames_in_flight_with_a_perfect_draft_send_ahead_and_count_every_checked_draft():
    pipeline = ScriptedPipeline(LONG)
    events = _events(20, LONG, ScriptedDraft(LONG), in_flight=3, pipeline=pipeline)
    assert [e.token for e in events] == LONG[:20]
    assert pipeline.most == 3
    assert pipeline.voided == []
    assert set(pipeline.epochs) == {0}
    done = events.account
    assert done.speculative is not None
    # a window is a frame: its drafts, all accepted here
    assert done.speculative.accepted == done.speculative.proposed <= 2 * done.speculative.windows
    assert done.speculative.proposed >= 19 - done.speculative.windows


def test_frames_in_flight_void_what_follows_a_miss_and_give_what_one_at_a_time_gives():
    misses = frozenset({4, 9, 10, 15})
    one = _events(24, LONG, ScriptedDraft(LONG, misses=misses))
    pipeline = ScriptedPipeline(LONG)
    many = _events(24, LONG, ScriptedDraft(LONG, misses=misses), in_flight=3, pipeline=pipeline)
    assert list(many) == list(one)
    assert pipeline.most == 3
    assert pipeline.voided  # frames sent past a miss were void
    assert pipeline.out == set()  # and nothing is left out at the end
    assert max(pipeline.epochs) == len(misses)  # one epoch per miss
    records = [r for r, before in zip(many.records, [None, *many.records], strict=False) if r != before]
    misses_seen = sum(b.accepted - a.accepted < b.proposed - a.proposed for a, b in itertools.pairwise(records))
    assert misses_seen == len(misses)  # a window that rejected counts its drafts after the miss as proposed
    assert max(b.proposed - a.proposed for a, b in itertools.pairwise(records)) <= 4  # at most two frames of 2


def test_a_frame_sent_ahead_counts_the_drafts_before_it_in_its_penalty_history():
    pipeline = ScriptedPipeline(LONG)
    _events(9, LONG, ScriptedDraft(LONG), in_flight=2, pipeline=pipeline,
            sampling=SamplingParams(presence_penalty=0.5))
    # the prefill gives 10; frame 1 feeds [10, 11, 12]; frame 2, sent before its reply, feeds
    # [13, 14] and counts the completion up to its first token, drafts included
    assert pipeline.histories[:3] == [(), (10,), (10, 11, 12, 13)]  # the prefill's: the prompt has none


class Recorder(Fixed):
    """A window of 2, but 0 for a while (the frames in flight drain first), and what it is told."""

    def __init__(self) -> None:
        super().__init__(WindowPolicy(policy="fixed", initial=2, min=1, max=2))
        self.asked = 0
        self.records: list[tuple[int, int, int]] = []

    def next_window(self) -> int:
        self.asked += 1
        return 0 if 4 <= self.asked <= 8 else 2

    def record(self, seen: Observation) -> None:
        assert seen.stage0_s is not None  # stage 0's own time is known for every frame
        self.records.append((seen.proposed, seen.accepted, seen.rows))


def test_controllers_hear_of_every_frame_plain_decodes_included():
    recorder = Recorder()
    req = GenerationRequest(PROMPT, 20)

    live = Live(RequestState(req, speculative=True))

    async def go() -> list[Sampled]:
        proposing = Proposing(ScriptedDraft(LONG), recorder, 3)
        return [e async for e in generate(ScriptedPipeline(LONG), Lease(1, 0), live, 64, proposing)  # type: ignore[arg-type]
                if isinstance(e, Sampled)]

    events = asyncio.run(go())
    assert [e.token for e in events] == LONG[:20]
    assert (0, 0, 1) in recorder.records  # a plain decode: one row
    assert (2, 2, 3) in recorder.records  # a window of 2: three rows
    done = live.state.account()
    assert done.speculative is not None
    assert done.speculative.windows == sum(1 for p, _, _ in recorder.records if p)


def test_without_a_draft_nothing_is_sent_ahead():
    pipeline = ScriptedPipeline(LONG)
    events = _events(6, LONG, in_flight=4, pipeline=pipeline)
    assert [e.token for e in events] == LONG[:6]
    assert pipeline.most == 1


def test_acceptance_is_frozen_and_counts_only_rounds_that_proposed():
    a = Acceptance().add(0, 0, "draft")
    assert a == Acceptance()
    assert (a.accept_rate, a.mean_window) == (0.0, 0.0)
    a = a.add(4, 3, "ngram").add(0, 0, "draft").add(2, 0, "draft").add(3, 1, "draft")
    assert (a.windows, a.proposed, a.accepted) == (3, 9, 4)
    assert a.by == (("draft", Acceptance(2, 5, 1)), ("ngram", Acceptance(1, 4, 3)))
    assert a.plus(a).by == (("draft", Acceptance(4, 10, 2)), ("ngram", Acceptance(2, 8, 6)))  # a resume
    assert a.accept_rate == 4 / 9
    assert a.mean_window == 3.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.windows = 0  # type: ignore[misc]  # on purpose: the assignment must be refused


def test_usage_from_the_account_has_todays_keys_and_rounding():
    usage = Usage.of(Account(5, 7, 2, speculative=Acceptance(3, 9, 1), finish_reason="length")).model_dump()
    assert usage == {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12,
                     "prompt_tokens_details": {"cached_tokens": 2},
                     "speculative": {"windows": 3, "proposed": 9, "accepted": 1, "accept_rate": 0.1111,
                                     "mean_window": 3.0}}
    assert Usage.of(Account(5, 0, finish_reason="stop")).model_dump() == {"prompt_tokens": 5, "completion_tokens": 0,
                                                             "total_tokens": 5,
                                                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert SpeculativeUsage.of(Acceptance(3, 10, 10)).mean_window == 3.333


HI = [{"role": "user", "content": "hi"}]
SPEC = {"windows": 11, "proposed": 33, "accepted": 11, "accept_rate": 0.3333, "mean_window": 3.0,
        "by_proposer": {"draft": {"windows": 11, "proposed": 33, "accepted": 11, "accept_rate": 0.3333}}}


@pytest.fixture
def draft_backend(byte_tokenizer) -> FakeBackend:
    return FakeBackend(byte_tokenizer, "Hello world", window=3)  # 3 proposed, 1 accepted, before each token


def test_a_body_reports_speculative_usage_from_the_account(draft_backend: FakeBackend):
    with TestClient(build_app(draft_backend, Metrics())) as client:
        body = client.post("/v1/chat/completions", json={"model": "tiny", "messages": HI}).json()
        metrics = client.get("/metrics").text
    assert body["choices"][0]["finish_reason"] == "stop"
    prompt = len(draft_backend.requests[0].prompt)
    assert body["usage"] == {"prompt_tokens": prompt, "completion_tokens": 11, "total_tokens": prompt + 11,
                             "prompt_tokens_details": {"cached_tokens": 0},
                             "speculative": SPEC}
    assert "meshpipe_speculative_proposed_tokens_total 33.0" in metrics
    assert 'meshpipe_speculative_proposer_accepted_tokens_total{proposer="draft"} 11.0' in metrics


def test_the_stream_usage_chunk_reports_speculative_usage(draft_backend: FakeBackend):
    body = {"model": "tiny", "prompt": "hi", "stream": True, "max_tokens": 4,
            "stream_options": {"include_usage": True}}
    with TestClient(build_app(draft_backend, Metrics())) as client, \
            client.stream("POST", "/v1/completions", json=body) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: {")]
    usage = json.loads(lines[-1][6:])
    assert usage["choices"] == []
    assert usage["object"] == "text_completion"
    assert usage["usage"]["completion_tokens"] == 4
    assert usage["usage"]["speculative"] == {"windows": 4, "proposed": 12, "accepted": 4, "accept_rate": 0.3333,
                                             "mean_window": 3.0, "by_proposer": {"draft": {
                                                 "windows": 4, "proposed": 12, "accepted": 4, "accept_rate": 0.3333}}}


def test_a_stop_string_reports_what_was_generated_before_it(draft_backend: FakeBackend):
    """The run closes the generation at the stop string, before it finished by itself: usage is
    the account of the tokens handed out so far."""
    with TestClient(build_app(draft_backend, Metrics())) as client:
        body = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "stop": "wor"}).json()
    assert (body["choices"][0]["text"], body["choices"][0]["finish_reason"]) == ("Hello ", "stop")
    assert body["usage"]["completion_tokens"] == len("Hello wor")
    assert body["usage"]["speculative"]["windows"] == len("Hello wor")
    assert draft_backend.closed == 1


class BreakingPipeline(ScriptedPipeline):
    """The route breaks at the `at`-th send: the frame never leaves."""

    def __init__(self, target: list[int], at: int) -> None:
        super().__init__(target)
        self.sends, self.at = 0, at

    async def send(self, *args: Any, **kwargs: Any) -> Pending:
        self.sends += 1
        if self.sends == self.at:
            raise MeshUnavailableError("activation link to stage 1 lost")
        return await super().send(*args, **kwargs)


def test_a_route_that_breaks_while_sending_still_hands_on_every_committed_token():
    """A resume goes on from the record's output, so the caller must have every token of it:
    the tokens of the last reply leave before the break is raised."""
    pipeline = BreakingPipeline(LONG, at=3)  # the prefill, one window, then the break
    req = GenerationRequest(PROMPT, 20)
    live = Live(RequestState(req, speculative=True))
    got: list[int] = []

    async def go() -> None:
        window = Fixed(WindowPolicy(policy="fixed", initial=2, min=1, max=2))
        proposing = Proposing(ScriptedDraft(LONG), window)
        async for sampled in generate(pipeline, Lease(SessionId(1), LaneId(0)), live, 64, proposing):  # type: ignore[arg-type]
            assert isinstance(sampled, Sampled)
            got.append(sampled.token)

    with pytest.raises(MeshUnavailableError):
        asyncio.run(go())
    assert got == LONG[:4]  # the prefill's token, then the window's two drafts and the target's next
    assert list(live.state.output) == got
    assert live.state.delivered == len(got)
