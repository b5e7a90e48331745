"""Speculative decoding at stage 0, in-process over the real activation transport.

Stage 0 (with the draft) and a final stage run in one event loop, joined by a loopback
activation link, so every stage's KV position can be read directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
from chain import COPY_HEAVY, chat_prompt

from common.ids import SessionId
from common.sampling import Sampled, SamplingParams
from common.tokens import common_prefix
from mesh.backend import Acceptance, Account, GenerationRequest
from mesh.serving.generate import generate
from mesh.serving.pipeline import Pipeline, StageFailedError, round_trip
from mesh.serving.proposals import Proposing
from mesh.serving.request_state import Live, Outgoing, RequestState
from mesh.speculative.draft import Draft
from mesh.speculative.ngram import NGRAM, NgramProposer
from mesh.speculative.proposer import Combined
from mesh.speculative.window import Adaptive, Observation, controller_for
from packages.manifest import load_manifest
from packages.materialize import materialize_stage
from packages.requantize import requantize
from packages.speculative import WindowPolicy, ngram_window
from packages.writer import write_package
from stage.activations import ActivationStage
from stage.batcher import Batcher, _Job, close_engine
from stage.engine import Step
from stage.llama_engine import EngineConfig, LlamaRangeEngine
from stage.transport import connect, serve

# the proposers' and the loop's mechanics, not what a request's ledger allows (tests/test_ledger.py)
pytestmark = [pytest.mark.mesh, pytest.mark.usefixtures("unbounded_ledger")]

CUT = 15
GREEDY = SamplingParams()


@contextlib.asynccontextmanager
async def two_stages(package: Path, cache: Path, draft: Path | None, cut: int = CUT, lanes: int = 4
                     ) -> AsyncIterator[tuple[Pipeline, Draft | None, LlamaRangeEngine]]:
    m, sha = load_manifest(package)
    first = LlamaRangeEngine(materialize_stage(package, m, sha, 0, cut, cache),
                             EngineConfig(first=True, final=False, lanes=lanes, ctx_per_lane=512))
    last = LlamaRangeEngine(materialize_stage(package, m, sha, cut, m.layer_count, cache),
                            EngineConfig(first=False, final=True, lanes=lanes, ctx_per_lane=512))
    stage = ActivationStage(last, 1, 0, None)
    stage.start()
    server = await serve("127.0.0.1", 0, stage.handle_upstream, token="t")
    link = await connect("127.0.0.1", server.sockets[0].getsockname()[1], token="t")
    pipeline = Pipeline(first, link)
    pipeline.start()
    d = Draft(draft, lanes=lanes, ctx_per_lane=512, threads=2) if draft else None
    if d:
        d.start()
    try:
        yield pipeline, d, last
    finally:
        if d:
            await d.stop()
        await pipeline.stop()
        await stage.stop()
        server.close()
        for e in (first, last):  # on the engine thread, after any decode still running there
            await close_engine(e)


async def _generated(pipeline, lease, req, draft, window, in_flight=1) -> tuple[list[Sampled], Account]:
    """A whole generation on `lease`: its tokens and its record's account at the end."""
    live = Live(RequestState(req, speculative=draft is not None))
    proposing = Proposing(draft, window, in_flight)
    out = [s async for s in generate(pipeline, lease, live, 512, proposing) if isinstance(s, Sampled)]
    return out, live.state.account()


async def _sampled(pipeline, draft, prompt, n, sampling=GREEDY, window=None, session=1):
    req = GenerationRequest(prompt, n, sampling, ignore_eos=True)
    out, done = await _generated(pipeline, pipeline.lease(session), req, draft, window)
    assert done.finish_reason == "length"
    assert done.completion_tokens == n
    assert (done.speculative is None) == (draft is None)
    return out, done


async def _run(pipeline, draft, prompt, n, sampling=GREEDY, window=None, session=1):
    out, done = await _sampled(pipeline, draft, prompt, n, sampling, window, session)
    return [s.token for s in out], done


def test_speculative_greedy_equals_plain_and_every_stage_rolls_back(smollm2_package, smollm2_gguf,
                                                                  stage_cache, draft_gguf):
    prompt = chat_prompt(smollm2_gguf, "Tell me a story about a brave mouse.")

    async def scenario():
        async with two_stages(smollm2_package, stage_cache, draft_gguf) as (pipeline, draft, _):
            plain, _ = await _run(pipeline, None, prompt, 64)
            await pipeline.end(SessionId(1))
            fixed = WindowPolicy(policy="fixed", initial=6, min=1, max=6)
            spec, done = await _run(pipeline, draft, prompt, 64, window=controller_for(fixed))
            assert spec == plain
            s = done.speculative
            assert s.proposed > s.accepted > 0, "the Q4_0 draft must be both right and wrong sometimes"

    asyncio.run(scenario())


def test_every_stage_kv_equals_accepted_position_after_rejection(smollm2_package, smollm2_gguf, stage_cache,
                                                                 draft_gguf):
    """A draft that is always wrong: each window rejects at once, and both stages trim."""
    prompt = chat_prompt(smollm2_gguf, "List three colours.")

    class WrongDraft(Draft):
        async def propose(self, lane, sequence, k, guide=None):
            return [(t + 1) % 1000 for t in await super().propose(lane, sequence, k, guide)]

    async def scenario():
        async with two_stages(smollm2_package, stage_cache, None) as (pipeline, _, final):
            draft = WrongDraft(draft_gguf, lanes=4, ctx_per_lane=512, threads=2)
            draft.start()
            try:
                req = GenerationRequest(prompt, 40, SamplingParams(), ignore_eos=True)
                lease = pipeline.lease(SessionId(1))
                fixed = WindowPolicy(policy="fixed", initial=4, min=1, max=4)
                live = Live(RequestState(req, speculative=True))
                events = generate(pipeline, lease, live, 512, Proposing(draft, controller_for(fixed)))
                out: list[int] = []
                while len(out) < 6:  # 1 from prefill, then 5 windows
                    event = await anext(events)  # ignore_eos: nothing finishes this early
                    assert isinstance(event, Sampled)
                    out.append(event.token)
                acceptance = live.state.acceptance
                assert acceptance.accepted == 0
                assert acceptance.windows == 5
                accepted = len(prompt) + len(out) - 1  # the KV must keep all but the newest token
                # the fifth window fed 1 + 4 rows through both stages, and none was accepted; the
                # sixth left stage 0 before the fifth's token was handed over, so stage 0 has
                # already dropped those rows and fed the sixth's at the accepted position
                assert pipeline.core.engine.position(lease.lane) == accepted + 5
                assert final.position(lease.lane) in (accepted + 4, accepted + 5)  # it may not have run the sixth yet
                assert draft.held[lease.lane][:accepted] == (prompt + out)[:accepted]
                # the next frame starts at the accepted position: every stage drops the rest
                await anext(events)  # the token of the sixth window, verified
                # the final stage ran the sixth at the accepted position (without the trim it would
                # hold the fifth's rows too); the seventh has left stage 0 already
                assert final.position(lease.lane) in (accepted + 5, accepted + 6)
                assert pipeline.core.engine.position(lease.lane) == accepted + 6
                assert draft.held[lease.lane][: accepted + 1] == (prompt + out)[: accepted + 1]
                assert isinstance(events, AsyncGenerator)  # generate() is an async generator: closable
                await events.aclose()
            finally:
                await draft.stop()

    asyncio.run(scenario())


def test_draft_equal_to_target_accepts_everything_and_window_reaches_max(smollm2_package, smollm2_gguf,
                                                                       stage_cache):
    prompt = chat_prompt(smollm2_gguf, "Explain gravity in two sentences.")

    async def scenario():
        async with two_stages(smollm2_package, stage_cache, smollm2_gguf) as (pipeline, draft, _):
            window = Adaptive(WindowPolicy(policy="adaptive", initial=2, min=1, max=8))
            _, done = await _run(pipeline, draft, prompt, 96, window=window)
            assert done.speculative.accept_rate == 1.0
            assert window.window == 8

    asyncio.run(scenario())


@pytest.fixture(scope="module")
def tiny_q4(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tiny random model in Q4_0 (GGUF, package): batch-invariant with flash attention on,
    like the embedded model, where its F32 matmuls take another kernel for several rows."""
    gguf = requantize(tiny_gguf, tmp_path_factory.mktemp("tiny-q4") / "tiny-q4_0.gguf", "Q4_0")
    package = tmp_path_factory.mktemp("tiny-q4-pkg") / "pkg"
    write_package(gguf, package, model_id="tiny-q4", progress=lambda _: None)
    return gguf, package


def test_tokens_sampled_inside_verify_windows_follow_the_target_distribution(tiny_q4, stage_cache):
    """Temperature 1 through a real 2-stage pipeline. 16 sessions verify one fixed window of 4
    rows in one pass each, under 2000 seeds: every row's samples fit the target's own
    single-row distribution at that position (chi-square). Then speculative generation at
    temperature 1, the target as its own draft, equals plain generation seed by seed."""
    context, window = [1, 5, 9, 17, 33, 12, 40], [7, 21, 3, 50]  # window: the last token + 3 drafts
    tiny_gguf, tiny_package = tiny_q4

    async def scenario() -> tuple[list[list[int]], int]:
        async with two_stages(tiny_package, stage_cache, tiny_gguf, cut=2, lanes=16) as (pipeline, draft, _):
            sessions = [SessionId(s) for s in range(1, 17)]
            lanes = {s: pipeline.open(s) for s in sessions}
            await asyncio.gather(*(round_trip(pipeline, s, lanes[s], Outgoing(0, context, GREEDY))
                                   for s in sessions))
            samples: list[list[int]] = []
            for first in range(0, 2000, 16):
                replies = await asyncio.gather(*(
                    round_trip(pipeline, s, lanes[s], Outgoing(len(context), window,
                                                               SamplingParams(temperature=1.0, seed=first + s),
                                                               drafts=len(window) - 1)) for s in sessions))
                samples += [[r.token for r in reply] for reply in replies]
            for s in sessions:
                await pipeline.end(s)
            windows = 0
            for seed in range(20):
                sp = SamplingParams(temperature=1.0, seed=seed)
                policy = controller_for(WindowPolicy(policy="fixed", initial=3, min=1, max=3))
                spec, done = await _run(pipeline, draft, context, 24, sp, policy, session=100 + seed)
                plain, _ = await _run(pipeline, None, context, 24, sp, session=200 + seed)
                await pipeline.end(SessionId(100 + seed))
                await pipeline.end(SessionId(200 + seed))
                assert spec == plain, seed
                windows += done.speculative.windows
            return samples, windows

    samples, windows = asyncio.run(scenario())
    assert windows >= 20 * 4  # the outputs above really came out of verify windows
    reference = _row_by_row_probs(tiny_gguf, context + window)
    for row in range(len(window)):
        _chi_square_fits(np.array([s[row] for s in samples]), reference[len(context) + row])


PENALISED = SamplingParams(temperature=1.0, presence_penalty=0.6, frequency_penalty=0.8,
                           logit_bias=((5, 1.5), (9, -100.0)), logprobs=4)


def test_speculative_equals_plain_in_tokens_and_logprobs_with_penalties_and_bias(tiny_q4, stage_cache):
    """Row i of a verify window is penalised for the drafts before it, so each accepted token
    and the target's token after them carry the numbers plain decoding computes."""
    tiny_gguf, tiny_package = tiny_q4

    async def scenario() -> None:
        async with two_stages(tiny_package, stage_cache, tiny_gguf, cut=2) as (pipeline, draft, _):
            accepted = 0
            for seed in range(6):
                sp = replace(PENALISED, seed=seed)
                policy = controller_for(WindowPolicy(policy="fixed", initial=3, min=1, max=3))
                spec, done = await _sampled(pipeline, draft, [1, 5, 9, 17], 24, sp, policy, session=10 + seed)
                plain, _ = await _sampled(pipeline, None, [1, 5, 9, 17], 24, sp, session=20 + seed)
                unpenalised, _ = await _sampled(pipeline, None, [1, 5, 9, 17], 24,
                                                replace(sp, presence_penalty=0.0, frequency_penalty=0.0), session=30)
                for s in (10 + seed, 20 + seed, 30):
                    await pipeline.end(SessionId(s))
                assert spec == plain, seed
                assert all(s.logprob is not None and len(s.top) == 4 for s in spec)
                assert 9 not in [s.token for s in spec]
                assert [s.token for s in unpenalised] != [s.token for s in plain]
                accepted += done.speculative.accepted
            assert accepted > 0

    asyncio.run(scenario())


def test_smollm2_speculative_equals_plain_when_sampling_with_penalties(smollm2_package, smollm2_gguf,
                                                                       stage_cache, draft_gguf):
    """The embedded model with its Q4_0 draft: batch-invariant kernels make it lossless in
    logprobs too, at temperature 1 with penalties and logit_bias."""
    prompt = chat_prompt(smollm2_gguf, "Write a limerick about a cat.")
    sp = replace(PENALISED, seed=2**64 - 1, logit_bias=((28, 2.0), (30, -100.0)))

    async def scenario() -> None:
        async with two_stages(smollm2_package, stage_cache, draft_gguf) as (pipeline, draft, _):
            plain, _ = await _sampled(pipeline, None, prompt, 40, sp)
            await pipeline.end(SessionId(1))
            window = controller_for(WindowPolicy(policy="fixed", initial=4, min=1, max=4))
            spec, done = await _sampled(pipeline, draft, prompt, 40, sp, window, session=2)
            assert spec == plain
            assert done.speculative.accepted > 0

    asyncio.run(scenario())


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the overflow that the last bad value provokes
def test_final_stage_refuses_sampling_it_cannot_use_with_an_error_frame(tiny_package, stage_cache):
    """Stage 0 is trusted to check, but the final stage reads these off the network."""
    bad = [(SamplingParams(logprobs=21), (), "logprobs"),
           (SamplingParams(logit_bias=((64, 1.0),)), (), "logit_bias"),
           (SamplingParams(logit_bias=((3, float("nan")),)), (), "logit_bias"),
           (SamplingParams(temperature=float("nan")), (), "finite"),
           (SamplingParams(presence_penalty=1.0), [7] * 600, "context"),
           (SamplingParams(frequency_penalty=1.0), [70], "vocabulary"),
           (SamplingParams(temperature=1e-30, logit_bias=((3, 1e300),)), (), "cannot sample")]

    async def scenario() -> None:
        async with two_stages(tiny_package, stage_cache, None, cut=2) as (pipeline, _, _):
            lane = pipeline.open(SessionId(1))
            await round_trip(pipeline, SessionId(1), lane, Outgoing(0, [1, 5, 9], GREEDY))
            for params, history, words in bad:
                with pytest.raises(StageFailedError, match=words):
                    await round_trip(pipeline, SessionId(1), lane, Outgoing(3, [7], params, history=tuple(history)))
            top2 = Outgoing(3, [7], SamplingParams(logprobs=2), history=(7,))
            ok = await round_trip(pipeline, SessionId(1), lane, top2)
            assert len(ok) == 1
            assert len(ok[0].top) == 2

    asyncio.run(scenario())


def _row_by_row_probs(gguf: Path, tokens: list[int]) -> list[np.ndarray]:
    """The target's distribution after each prefix, from single-row decodes at temperature 1."""
    engine = LlamaRangeEngine(gguf, EngineConfig(first=True, final=True, lanes=1, ctx_per_lane=64))
    probs = []
    for i, token in enumerate(tokens):
        logits = engine.step([Step(0, i, tokens=np.asarray([token], dtype=np.int32))])[0][-1].astype(np.float64)
        z = np.exp(logits - logits.max())
        probs.append(z / z.sum())
    engine.close()
    return probs


def _chi_square_fits(samples: np.ndarray, probs: np.ndarray) -> None:
    n = len(samples)
    big = np.flatnonzero(probs * n >= 5)  # bins with enough expected mass; the rest pooled
    observed = [np.sum(samples == t) for t in big] + [np.sum(~np.isin(samples, big))]
    expected = [probs[t] * n for t in big] + [n * (1 - probs[big].sum())]
    if expected[-1] < 5:
        observed[-2] += observed.pop()
        expected[-2] += expected.pop()
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected, strict=True))
    dof = len(observed) - 1
    # Wilson-Hilferty: the 0.999 quantile of chi-square(dof); a failure here is a real skew.
    crit = dof * (1 - 2 / (9 * dof) + 3.09 * (2 / (9 * dof)) ** 0.5) ** 3
    assert stat < crit, f"chi-square {stat:.1f} >= {crit:.1f} with {dof} dof"


def test_accepted_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4, 9]) == 2
    assert common_prefix([], [7]) == 0
    assert common_prefix([5], [5, 6]) == 1


def test_adaptive_window_doubles_on_a_full_accept_and_falls_to_what_was_accepted():
    w = Adaptive(WindowPolicy(policy="adaptive", initial=2, min=1, max=6))
    steps = [(2, 4, 3), (4, 6, 3), (6, 6, 3), (2, 3, 1), (0, 1, 1), (1, 2, 3)]
    for accepted, window, depth in steps:  # window and frames ahead after each
        w.record(Observation(w.next_window(), accepted, 0.0, 1))
        assert (w.window, w.depth(3)) == (window, depth)


# Measured by `mesh bench --scenarios numerics --numerics-gguf gemma-3-270m-q4_k_m.gguf`: a
# window's logits differ from row-by-row logits by at most 1.54 on Gemma-3 Q4_K_M at position
# 200 on an f16 cache, 1.61 at 700 on the project's q8_0/f16 one (the Q4_K matmuls take
# another kernel for several rows; DESIGN.md §9). An argmax can only flip where the top-2
# margin is below twice the largest difference.
GEMMA_WINDOW_DIFF = 1.7
NEAR_TIE = 2 * GEMMA_WINDOW_DIFF


def test_gemma_speculative_output_is_the_targets_up_to_near_ties(gemma3_gguf):
    """Gemma-3 is not batch-invariant, so greedy output with a draft may leave plain output,
    but only at a near tie of the plain run; with the target as its own draft nearly every
    proposal is accepted."""
    prompts = [chat_prompt(gemma3_gguf, t) for t in ("Write a poem about autumn.", "How do magnets work?",
                                                      "List five uses for a paperclip.")]

    async def scenario() -> tuple[list[tuple[list[int], list[int], list[int]]], dict]:
        engine = LlamaRangeEngine(gemma3_gguf, EngineConfig(first=True, final=True, lanes=2, ctx_per_lane=256))
        pipeline, draft = Pipeline(engine, None), Draft(gemma3_gguf, lanes=2, ctx_per_lane=256, threads=2)
        pipeline.start()
        draft.start()
        runs, totals = [], {"proposed": 0, "accepted": 0}
        try:
            for i, prompt in enumerate(prompts):
                plain, _ = await _run(pipeline, None, prompt, 64, session=2 * i)
                await pipeline.end(SessionId(2 * i))
                window = controller_for(WindowPolicy(policy="fixed", initial=4, min=1, max=4))
                spec, done = await _run(pipeline, draft, prompt, 64, window=window, session=2 * i + 1)
                await pipeline.end(SessionId(2 * i + 1))
                runs.append((prompt, plain, spec))
                for key in totals:
                    totals[key] += getattr(done.speculative, key)
        finally:
            await draft.stop()
            await pipeline.stop()
            await close_engine(engine)
        return runs, totals

    runs, totals = asyncio.run(scenario())
    # The share a K-quant window's argmax flips against the single row's depends on the near ties
    # the text meets: 147 of 161 (0.91) on the q8_0/f16 cache, 0.92 on bf16/f16, over 0.95 on
    # f16 and q8_0/q8_0, while a window's logits part from its rows' by as much on each cache
    # (max 0.8-1.6 at positions 40-200, issue 52). A draft equal to the target still keeps 0.9.
    assert totals["accepted"] >= 0.9 * totals["proposed"] > 0, totals
    for prompt, plain, spec in runs:
        diverged = common_prefix(plain, spec)
        if diverged < len(plain):
            margin = _top2_margin(gemma3_gguf, prompt, plain[:diverged])
            print(f"diverged at token {diverged}, plain top-2 margin {margin:.3f}")
            assert margin < NEAR_TIE, f"speculative output left the plain one at a margin of {margin:.2f}"


def _top2_margin(gguf: Path, prompt: list[int], generated: list[int]) -> float:
    """The plain run's top-2 logit margin after `generated`, computed as it ran: the prompt
    in one decode, then a row per generated token."""
    engine = LlamaRangeEngine(gguf, EngineConfig(first=True, final=True, lanes=1, ctx_per_lane=256))
    logits = engine.step([Step(0, 0, tokens=np.asarray(prompt, dtype=np.int32))])[0][-1]
    for i, token in enumerate(generated):
        logits = engine.step([Step(0, len(prompt) + i, tokens=np.asarray([token], dtype=np.int32))])[0][-1]
    engine.close()
    top = np.sort(logits)[-2:]
    return float(top[1] - top[0])


class BusyBatcher(Batcher):
    """A stage on a slower machine: each decode waits `pause` first (off the shared engine
    thread), so frames queue behind it as they would at a bottleneck stage."""

    pause = 0.0

    async def _next(self) -> list[_Job]:
        await asyncio.sleep(self.pause)
        return await super()._next()


@contextlib.asynccontextmanager
async def chain_of_stages(package: Path, cache: Path, cuts: list[int], lanes: int = 4, busy_final: bool = False
                          ) -> AsyncIterator[tuple[Pipeline, list[ActivationStage]]]:
    """Stage 0 and a remote stage per cut, each linked to the next over loopback; with
    `busy_final`, the final stage is the slowest machine (BusyBatcher)."""
    m, sha = load_manifest(package)
    bounds = [0, *cuts, m.layer_count]
    engines = [LlamaRangeEngine(materialize_stage(package, m, sha, a, b, cache),
                                EngineConfig(first=a == 0, final=b == m.layer_count, lanes=lanes, ctx_per_lane=512))
               for a, b in itertools.pairwise(bounds)]
    stages: list[ActivationStage] = []
    servers, link = [], None
    for i in range(len(engines) - 1, 0, -1):  # the final stage first, so each can link downstream
        stage = ActivationStage(engines[i], i, 0, link)
        if busy_final and i == len(engines) - 1:
            stage.core.batcher = BusyBatcher(engines[i])
        stage.start()
        stages.insert(0, stage)
        servers.append(await serve("127.0.0.1", 0, stage.handle_upstream, token="t"))
        link = await connect("127.0.0.1", servers[-1].sockets[0].getsockname()[1], token="t")
    pipeline = Pipeline(engines[0], link)
    pipeline.start()
    try:
        yield pipeline, stages
    finally:
        await pipeline.stop()
        for stage in stages:
            await stage.stop()
        for server in servers:
            server.close()
        for e in engines:  # on the engine thread, after any decode still running there
            await close_engine(e)


@dataclass
class InFlight:
    """Counts a pipeline's frames sent and not yet waited for or voided."""

    out: int = 0
    most: int = 0
    voided: int = 0

    def watch(self, pipeline: Pipeline) -> None:
        send, wait, void = pipeline.send, pipeline.wait, pipeline.void

        async def sent(*args, **kwargs):
            pending = await send(*args, **kwargs)
            self.out += 1
            self.most = max(self.most, self.out)
            return pending

        async def waited(pending):
            self.out -= 1
            return await wait(pending)

        def voided(pending):
            self.out -= 1
            self.voided += 1
            void(pending)

        # a spy on purpose: the counts come from the real calls
        pipeline.send, pipeline.wait, pipeline.void = sent, waited, voided  # type: ignore[method-assign]


@pytest.mark.parametrize("cuts", [[], [CUT], [10, 20]], ids=["1-stage", "2-stage", "3-stage"])
def test_frames_in_flight_give_plain_greedy_output_on_every_split(smollm2_package, smollm2_gguf, stage_cache,
                                                                   draft_gguf, cuts):
    """Three verify frames in flight, the Q4_0 draft missing often: frames past a miss are void,
    the final stage (the slowest machine here) drops those queued there unrun, and every token
    is still the one plain decoding gives; on two stages, four sessions at once too."""
    prompts = [chat_prompt(smollm2_gguf, t) for t in ("Tell me a story about a brave mouse.",
                                                      "How do magnets work?", "List five uses for a paperclip.",
                                                      "Write a poem about autumn.")]

    async def scenario(draft: Draft) -> None:
        async with chain_of_stages(smollm2_package, stage_cache, cuts, busy_final=True) as (pipeline, stages):
            batched = len(cuts) == 1  # only two stages run all four prompts: elsewhere the first is enough
            plain = [(await _run(pipeline, None, p, 48, session=10 + i))[0]
                     for i, p in enumerate(prompts if batched else prompts[:1])]
            for i in range(len(plain)):
                await pipeline.end(SessionId(10 + i))
            seen = InFlight()
            seen.watch(pipeline)
            busy = stages[-1].core.batcher if stages else None
            assert busy is None or isinstance(busy, BusyBatcher)
            if busy is not None:  # long enough for stage 0 to draft and send the next epoch while frames wait there
                busy.pause = 0.3
            fixed = controller_for(WindowPolicy(policy="fixed", initial=4, min=1, max=4))
            req = GenerationRequest(prompts[0], 48, GREEDY, ignore_eos=True)
            events, done = await _generated(pipeline, pipeline.lease(SessionId(1)), req, draft, fixed, in_flight=3)
            assert [e.token for e in events] == plain[0]
            assert done.speculative is not None
            assert done.speculative.proposed > done.speculative.accepted > 0
            assert seen.most == 3
            assert seen.voided > 0
            await pipeline.end(SessionId(1))
            if busy is not None:  # void frames queued at the final stage were dropped unrun, and none was answered
                assert stages[-1].core.skipped > 0
                busy.pause = 0.0
            if batched:
                async def one(i: int) -> list[int]:
                    req = GenerationRequest(prompts[i], 48, GREEDY, ignore_eos=True)
                    window = controller_for(WindowPolicy(policy="adaptive", initial=4, min=1, max=8))
                    lease = pipeline.lease(SessionId(20 + i))
                    out, _ = await _generated(pipeline, lease, req, draft, window, in_flight=3)
                    return [e.token for e in out]
                assert await asyncio.gather(*(one(i) for i in range(4))) == plain
            assert seen.out == 0
            assert pipeline.waiters == {}

    async def with_draft() -> None:
        draft = Draft(draft_gguf, lanes=4, ctx_per_lane=512, threads=2)
        draft.start()
        try:
            await scenario(draft)
        finally:
            await draft.stop()

    asyncio.run(with_draft())


def test_frames_in_flight_sample_what_plain_decoding_samples_with_penalties(smollm2_package, smollm2_gguf,
                                                                           stage_cache, draft_gguf):
    """Temperature 1, penalties, logit_bias and logprobs: a frame sent ahead counts the drafts
    before it in its penalty history, so tokens and logprobs stay bit for bit."""
    prompt = chat_prompt(smollm2_gguf, "Write a limerick about a cat.")
    sp = replace(PENALISED, seed=7, logit_bias=((28, 2.0), (30, -100.0)))

    async def scenario() -> None:
        async with two_stages(smollm2_package, stage_cache, draft_gguf) as (pipeline, draft, _):
            plain, _ = await _sampled(pipeline, None, prompt, 40, sp)
            await pipeline.end(SessionId(1))
            seen = InFlight()
            seen.watch(pipeline)
            window = controller_for(WindowPolicy(policy="fixed", initial=3, min=1, max=3))
            req = GenerationRequest(prompt, 40, sp, ignore_eos=True)
            events, done = await _generated(pipeline, pipeline.lease(SessionId(2)), req, draft, window, in_flight=3)
            assert events == plain
            assert seen.most == 3
            assert done.speculative is not None
            assert done.speculative.accepted > 0

    asyncio.run(scenario())




@pytest.mark.parametrize("cuts", [[], [CUT]], ids=["1-stage", "2-stage"])
def test_prompt_lookup_gives_plain_greedy_output_and_is_accepted_on_copied_text(smollm2_package, smollm2_gguf,
                                                                               stage_cache, cuts):
    """Lossless because SmolLM2 Q4_1 with flash attention is batch-invariant (DESIGN.md
    §9): a verify window's logits are plain decoding's bit for bit."""
    prompt = chat_prompt(smollm2_gguf, COPY_HEAVY)

    async def scenario() -> None:
        async with chain_of_stages(smollm2_package, stage_cache, cuts) as (pipeline, _):
            plain, _ = await _run(pipeline, None, prompt, 96, session=1)
            await pipeline.end(SessionId(1))
            lookup = NgramProposer(3, 5)
            req = GenerationRequest(prompt, 96, GREEDY, ignore_eos=True)
            windows = {NGRAM: controller_for(ngram_window())}
            events, done = await _generated(pipeline, pipeline.lease(SessionId(2)), req, lookup, windows, in_flight=3)
            assert [e.token for e in events] == plain
            s = done.speculative
            assert s is not None
            assert s.accepted >= 24, s  # whole windows of copied code, not a lucky token
            assert [name for name, _ in s.by] == [NGRAM]

    asyncio.run(scenario())


def test_prompt_lookup_then_the_draft_gives_plain_greedy_output(smollm2_package, smollm2_gguf, stage_cache,
                                                                draft_gguf):
    """Both proposers in one generation: prompt lookup where the text copies, the Q4_0 draft
    elsewhere, each with its own window; the usage says which one proposed what."""
    prompts = [chat_prompt(smollm2_gguf, COPY_HEAVY), chat_prompt(smollm2_gguf, "Tell me a story about a mouse.")]

    async def scenario() -> None:
        async with two_stages(smollm2_package, stage_cache, draft_gguf) as (pipeline, draft, _):
            assert draft is not None
            both = Combined(NgramProposer(3, 5), draft)
            totals = Acceptance()
            for i, prompt in enumerate(prompts):
                plain, _ = await _run(pipeline, None, prompt, 64, session=10 + i)
                await pipeline.end(SessionId(10 + i))
                windows = {NGRAM: controller_for(ngram_window()),
                           "draft": controller_for(WindowPolicy(policy="fixed", initial=3, min=1, max=3))}
                spec, done = await _run(pipeline, both, prompt, 64, window=windows, session=20 + i)
                await pipeline.end(SessionId(20 + i))
                assert spec == plain, i
                assert done.speculative is not None
                totals = totals.plus(done.speculative)
            by = dict(totals.by)
            assert by[NGRAM].accepted > 0
            assert by["draft"].proposed > by["draft"].accepted > 0
            assert totals.proposed == by[NGRAM].proposed + by["draft"].proposed

    asyncio.run(scenario())
