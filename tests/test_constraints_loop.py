"""The generate loop under a grammar, over a fake pipeline whose final stage samples each
row under the mask the frame carries (issue 27). No model: the logits of a row are a fixed
random function of its position and the token fed there, over the tiny byte vocabulary.

Speculation must not change a constrained output, greedy or seeded: forced tokens, a
proposer that guesses badly (its illegal tokens cut), frames in flight, and a resume, which
replays the committed output into a fresh matcher."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import llguidance
import numpy as np
import pytest

from common.ids import FrameId, LaneId, SessionId
from common.sampling import Sampled, SamplingParams
from mesh.backend import GenerationRequest
from mesh.constraints.compile import Constraint, build
from mesh.constraints.errors import ConstraintError
from mesh.serving.generate import generate
from mesh.serving.pipeline import Lease, Pending
from mesh.serving.proposals import Proposing
from mesh.serving.request_state import Live, Outgoing, RequestState
from mesh.speculative.proposer import Budget, Proposal
from mesh.speculative.window import Fixed, WindowPolicy
from stage.sampling import sample_rows

# the loop's and proposers' mechanics, not what a request's ledger allows (tests/test_ledger.py)
pytestmark = pytest.mark.usefixtures("unbounded_ledger")

SCHEMA = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 5},
                                           "b": {"enum": ["yes", "no"]}, "c": {"type": "integer"}},
          "required": ["a", "b", "c"], "additionalProperties": False}
PROMPT = (1, 5, 7)
EOS = 2


class MaskingPipeline:
    """A final stage that samples every row under its mask, as stage/sampling.py does."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self.masked_rows = 0

    def _logits(self, start: int, tokens: list[int], rows: range) -> np.ndarray:
        return np.stack([np.random.default_rng([start + i, tokens[i]]).standard_normal(self.vocab).astype(np.float32)
                         for i in rows])

    async def send(self, session: int, lane: int, out: Outgoing) -> Pending:
        start, tokens, sampling, masks, epoch = out.start, out.tokens, out.sampling, out.masks, out.epoch
        rows = range(len(tokens)) if out.all_logits else range(len(tokens) - 1, len(tokens))
        assert len(masks) == len(rows)  # a constrained frame masks every row it samples
        self.masked_rows += len(masks)
        picks = sample_rows(self._logits(start, tokens, rows), sampling, start, len(tokens), masks=masks)
        return Pending(SessionId(session), FrameId(start), epoch, 0.0, None, picks, 0.001)

    async def wait(self, pending: Pending) -> list[Sampled]:
        assert pending.local is not None
        return pending.local

    def void(self, pending: Pending) -> None:
        pass


class Guesser:
    """A proposer that ignores the grammar: letters (legal inside a string, mostly wrong),
    and every third guess a NUL byte, which no JSON allows."""

    names: tuple[str, ...] = ("draft",)

    async def proposal(self, lane: int, sequence: list[int], budget: Budget, guide: object = None,
                       sampling: object = None) -> Proposal:
        k = budget("draft")
        return Proposal([3 if i % 3 == 2 else ord("a") + (sequence[-1] + i) % 26 + 3 for i in range(k)], "draft", 0.0)

    def forget(self, lane: int) -> None:
        pass


@pytest.fixture(scope="module")
def constraint(byte_tokenizer) -> Constraint:
    # compact JSON: this SPM test vocabulary has no space token, and llama.cpp escapes a
    # space as U+2581, which its byte tokens spell differently from the space the grammar wants
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        SCHEMA, overrides={"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"})
    return build(byte_tokenizer, grammar, "json_schema", lambda e: ConstraintError(e, "s"))


def _request(constraint: Constraint, sampling: SamplingParams) -> GenerationRequest:
    return GenerationRequest(PROMPT, 60, sampling, frozenset({EOS}), constraint=constraint)


async def _run(live: Live, vocab: int, forced: bool, draft: Guesser | None, in_flight: int = 1,
               stop_after: int | None = None) -> list[int]:
    pipeline: Any = MaskingPipeline(vocab)
    window = Fixed(WindowPolicy(policy="fixed", initial=3, min=1, max=3)) if draft is not None else None
    out = []
    proposing = Proposing(draft, window, in_flight, forced=forced)
    gen: Any = generate(pipeline, Lease(SessionId(1), LaneId(0)), live, 512, proposing)
    async for sampled in gen:
        out.append(sampled.token)
        if stop_after is not None and len(out) == stop_after:
            break
    await gen.aclose()
    return out


def _text(tokens: list[int]) -> str:
    return bytes(t - 3 for t in tokens).decode()


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=1.0, seed=3)],
                         ids=["greedy", "seeded"])
def test_speculation_changes_no_constrained_token(byte_tokenizer, constraint, sampling):
    vocab = byte_tokenizer.n_vocab
    plain = asyncio.run(_run(Live(RequestState(_request(constraint, sampling))), vocab, False, None))
    json.loads(_text(plain))  # a whole object, within the budget
    for forced, draft, in_flight in [(True, None, 1), (False, Guesser(), 1), (True, Guesser(), 3)]:
        live = Live(RequestState(_request(constraint, sampling), speculative=True))
        assert asyncio.run(_run(live, vocab, forced, draft, in_flight)) == plain
        by = dict(live.state.acceptance.by)
        if forced:
            assert by["forced"].accepted > 0
        if draft is not None:  # legal guesses reached the pipeline, and were rolled back
            assert by["draft"].proposed > by["draft"].accepted


def test_a_resumed_request_replays_its_output_into_a_fresh_matcher(byte_tokenizer, constraint):
    vocab, sampling = byte_tokenizer.n_vocab, SamplingParams(temperature=1.0, seed=9)
    whole = asyncio.run(_run(Live(RequestState(_request(constraint, sampling))), vocab, True, None))
    live = Live(RequestState(_request(constraint, sampling), speculative=True))
    first = asyncio.run(_run(live, vocab, True, Guesser(), 2, stop_after=9))
    live.state = live.state.resume()  # the route broke: frames and drafts gone, the output kept
    rest = asyncio.run(_run(live, vocab, True, Guesser(), 2))
    assert [*live.state.output] == whole
    assert first + rest == whole[: len(first) + len(rest)]
