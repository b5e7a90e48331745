"""The draft model: a whole small GGUF at stage 0 with a KV lane per session.

It proposes greedily, or, for a request accepted by rejection sampling, draws from its own
distribution and says what q each token came from (DESIGN.md §6). Proposals only decide
what gets verified; every emitted token follows the target's distribution, so a poor draft
costs speed, never correctness.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from llama_cpp import llama_cpp as L

from common.sampling import Proposed
from common.tokens import common_prefix
from mesh.speculative.plan import SpecPlan
from mesh.speculative.proposer import Budget, DraftSampling, Proposal
from packages.speculative import verify_draft
from stage.batcher import close_engine
from stage.checkpoints import DRAFT_DEPTH
from stage.core import StageCore
from stage.engine import EngineConfig, Step
from stage.engine_choice import open_engine
from stage.llama_engine import LlamaRangeEngine
from stage.masks import unpack
from stage.rejection import drawn
from stage.sampling import processed_rows

if TYPE_CHECKING:
    from mesh.constraints.guide import Guide
    from mesh.model.tokenizer import Tokenizer

DRAFT = "draft"  # its name in usage.speculative.by_proposer
CATCH_UP = 96  # tokens behind past which the draft starts over on the last CONTEXT
CONTEXT = 64


class Draft:
    """A draft model at stage 0; a `Proposer` (mesh/speculative/proposer.py).

    It opens its engine and runs it on a stage core as every stage does, so its decodes
    queue on the process's one engine thread beside stage 0's (stage/batcher.py says why
    there is one).
    """

    names: tuple[str, ...] = (DRAFT,)

    def __init__(self, gguf: Path, lanes: int, ctx_per_lane: int, threads: int,
                 cpu_lock: Path | None = None) -> None:
        cfg = EngineConfig(first=True, final=True, lanes=lanes, ctx_per_lane=ctx_per_lane, threads=threads,
                           cpu_lock=cpu_lock, checkpoints=DRAFT_DEPTH, checkpoint_every_row=True)
        engine = open_engine("llama", gguf, cfg)  # whatever stage 0 runs: `vocab_mismatch` reads llama.cpp's vocabulary
        assert isinstance(engine, LlamaRangeEngine)
        self.engine = engine
        self.core = StageCore(engine, 0)  # the lanes are stage 0's: a session's draft lane is its lane there
        # Each lane's KV holds `held` at positions 0.. : the tokens of the sequence that put them
        # there from `base` on, whose first `base` tokens were `before`. A lane serves request
        # after request (the prefix cache), so what it holds is re-derived from the sequence at
        # every proposal (`_view`), never assumed to be the same request's.
        self.held: list[list[int]] = [[] for _ in range(lanes)]
        self.base = [0] * lanes
        self.before: list[list[int]] = [[] for _ in range(lanes)]
        # one proposal at a time per lane: a request paused by a route break may still be in a
        # long catch-up when the rebuilt route gives its lane to a new request
        self.locks = [asyncio.Lock() for _ in range(lanes)]
        # what one proposal step costs, catch-ups left out: with frames ahead every step is
        # one row; one frame at a time, a window first feeds the token after the accepted
        # drafts, which the verify frame's measured overhead (estimates.Overhead) prices
        self.step_seconds = 0.0

    @property
    def busy_s(self) -> float:
        """Engine time spent on the draft's decodes since start."""
        return self.core.batcher.busy_s

    def start(self) -> None:
        self.core.start()

    async def stop(self) -> None:
        await self.core.stop()
        await close_engine(self.engine)

    async def propose(self, lane: int, sequence: list[int], k: int, guide: Guide | None = None) -> list[int]:
        """k greedy tokens to follow `sequence`; KV past what still matches is dropped. With a
        `guide`, each is the best the grammar allows, and the proposal ends at the grammar's end."""
        async with self.locks[lane]:
            return [d.token for d in await self._propose(lane, sequence, k, guide, None)]

    async def draw(self, lane: int, sequence: list[int], k: int, sampling: DraftSampling,
                   guide: Guide | None = None) -> list[Proposed]:
        """`propose`, but each token drawn as `sampling` says, with the q it came from."""
        async with self.locks[lane]:
            return await self._propose(lane, sequence, k, guide, sampling)

    async def _propose(self, lane: int, sequence: list[int], k: int, guide: Guide | None,
                       sampling: DraftSampling | None) -> list[Proposed]:
        view = self._view(lane, sequence)
        start = min(common_prefix(self.held[lane], view), len(view) - 1)
        if not self.engine.reachable(lane, start):
            # a hybrid draft's recurrent state keeps DRAFT_DEPTH checkpoints, one a step: a
            # rollback past them starts the lane over (what it proposes changes, not the output)
            start = 0
        held, feed = view[:start], view[start:]
        out: list[Proposed] = []
        timed: list[float] = []
        for _ in range(k):
            # A catch-up (the rows a verify accepted, or all the draft sat out) is one decode.
            step = Step(lane, start, tokens=np.asarray(feed, dtype=np.int32))
            began = time.perf_counter()
            logits = await self.core.submit(step).output
            if len(feed) == 1:  # a catch-up is not what a proposal costs
                timed.append(time.perf_counter() - began)
            start += len(feed)
            held += feed
            if sampling is None:
                out.append(Proposed(_pick(logits[-1], guide)))
            else:
                out.append(_draw(logits[-1], guide, sampling, sequence + [d.token for d in out]))
            feed = [out[-1].token]
            if guide is not None and guide.done:
                break
        if guide is not None:
            guide.pop(len(out))
        self.held[lane] = held  # the last proposal is not in the KV yet
        if timed:
            self.step_seconds = sum(timed) / len(timed)
        return out

    def _view(self, lane: int, sequence: list[int]) -> list[int]:
        """The part of `sequence` the lane's KV holds from position 0: never empty. A lane whose
        KV started past position 0 of another sequence (an earlier request on the lane, or this
        one before a rejection took back what its start was cut from) starts over from position
        0. A draft that sat out more than CATCH_UP tokens of its session (speculation was off)
        starts over on the last CONTEXT of them: a probe then costs a bounded catch-up, not one
        as long as the time off. A session's first proposal reads its whole prompt."""
        base, held = self._stands(lane, sequence)
        if base != self.base[lane]:
            self._start_over(lane, 0, sequence)
        if _behind(base, held, sequence) > CATCH_UP and held:
            base = max(len(sequence) - CONTEXT, 0)
            self._start_over(lane, base, sequence)
        return sequence[base:]

    def behind(self, lane: int, sequence: list[int]) -> int:
        """The rows the lane's next proposal feeds before it drafts (`_view`, which it leaves
        as it is): a fresh session's whole prompt, CONTEXT after sitting out CATCH_UP."""
        base, held = self._stands(lane, sequence)
        behind = _behind(base, held, sequence)
        return CONTEXT if behind > CATCH_UP and held else behind

    def _stands(self, lane: int, sequence: list[int]) -> tuple[int, list[int]]:
        """The lane's base and the tokens its KV holds past it, against `sequence`: (0, []) where
        its KV started past position 0 of another sequence."""
        base = self.base[lane]
        if base and (len(sequence) <= base or sequence[:base] != self.before[lane]):
            return 0, []
        return base, self.held[lane]

    def _start_over(self, lane: int, base: int, sequence: list[int]) -> None:
        """The lane's KV is to hold `sequence` from `base` on, from position 0 (a step's start
        is authoritative: the next decode replaces what was there)."""
        self.held[lane], self.base[lane], self.before[lane] = [], base, sequence[:base]

    async def proposal(self, lane: int, sequence: list[int], budget: Budget,
                       guide: Guide | None = None, sampling: DraftSampling | None = None) -> Proposal:
        k = budget(DRAFT, self.behind(lane, sequence))
        if k < 1:
            return Proposal([], DRAFT, 0.0)
        if sampling is None:
            tokens = await self.propose(lane, sequence, k, guide)
            return Proposal(tokens, DRAFT, self.step_seconds * len(tokens))
        drawn = await self.draw(lane, sequence, k, sampling, guide)
        return Proposal([d.token for d in drawn], DRAFT, self.step_seconds * len(drawn), tuple(drawn))

    def forget(self, lane: int) -> None:
        self._start_over(lane, 0, [])
        self.core.batcher.trim(lane, 0)


def _behind(base: int, held: list[int], sequence: list[int]) -> int:
    """Tokens of `sequence` past `base` that `held` does not already hold."""
    return len(sequence) - base - common_prefix(held, sequence[base:])


def _pick(logits: np.ndarray, guide: Guide | None) -> int:
    """The draft's greedy token, under the grammar's mask when there is one (which then
    consumes it: the next step's mask follows it)."""
    if guide is None:
        return int(np.argmax(logits))
    allowed = unpack(guide.mask(), len(logits))
    token = int(np.argmax(np.where(allowed, logits, -np.inf)))
    guide.push(token)
    return token


def _draw(logits: np.ndarray, guide: Guide | None, sampling: DraftSampling, sequence: list[int]) -> Proposed:
    """The draft's token at position len(sequence), drawn from its own row processed as the
    target's (bias, penalties, the grammar's mask, temperature, top-k, top-p) and cut to its
    TOP tokens: that cut distribution is the q the token travels with."""
    params = sampling.params
    masks = (guide.mask(),) if guide is not None else ()
    row = processed_rows(logits[None, :], params, sequence[sampling.prompt :], (), masks)[0]
    draft = drawn(row, params, len(sequence))
    if guide is not None:
        guide.push(draft.token)
    return draft


def draft_path(plan: SpecPlan, package_dir: Path) -> Path:
    """The draft GGUF on disk: verified from the package, or resolved like any draft ref."""
    assert plan.draft_model is not None, "a plan without a draft model loads none"
    s = plan.strategy
    if s is not None and s.draft_model == plan.draft_model and s.in_package:
        return verify_draft(package_dir, s)
    from packages.hub import resolve_draft  # the Hub client only when a draft is served

    return resolve_draft(plan.draft_model, package_dir)


def vocab_mismatch(target: Tokenizer, draft: LlamaRangeEngine) -> str | None:
    """Why the draft's tokenizer differs from the target's, or None when they agree. The
    target's is stage 0's tokenizer, whichever engine runs stage 0's layers."""
    if target.n_vocab != draft.n_vocab:
        return f"its vocabulary has {draft.n_vocab} tokens, the target's {target.n_vocab}"
    for token in range(target.n_vocab):
        if target.token_text(token) != L.llama_vocab_get_text(draft.vocab, token):
            return f"token {token} differs between the draft's and the target's tokenizer"
    return None
