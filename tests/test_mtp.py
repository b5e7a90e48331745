"""The model's own MTP layers drafting at the final stage (issue 56), in-process on one node.

Tiny random models with a nextn layer (tests/tiny_models.py) draft almost never right, so
every window is rejected and rolled back; the same models made to agree (tests/mtp_models.py)
have every draft accepted, so frames go out ahead of their replies. Either way the output
must be plain decoding's. Split routes are served in tests/test_mtp_served.py.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from mtp_models import agreeing
from tiny_models import write_tiny

from common.ids import SessionId
from common.sampling import REJECTION, Proposed, Sampled, SamplingParams
from mesh.backend import Account, GenerationRequest
from mesh.routing.planner import StageRange
from mesh.routing.stage_fit import footprint, package_sizes
from mesh.serving.generate import generate
from mesh.serving.pipeline import Pending, Pipeline, PipelineOptions
from mesh.serving.proposals import NO_PROPOSER, Proposing
from mesh.serving.request_state import Live, Outgoing, RequestState
from mesh.speculative.mtp import MTP, MtpProposer
from mesh.speculative.window import Fixed
from packages.speculative import WindowPolicy
from packages.writer import write_package
from stage.engine import Step
from stage.engine_choice import LLAMA
from stage.llama_engine import EngineConfig, LlamaRangeEngine
from stage.mtp_drafts import committed_last

# the loop's and proposers' mechanics, not what a request's ledger allows (tests/test_ledger.py)
pytestmark = pytest.mark.usefixtures("unbounded_ledger")

# deepseek2 and glm4moe: MoE with leading dense blocks (MLA in the first); hy_v3: dense first,
# then MoE. Each has one nextn layer past its main stack.
FAMILIES = ("deepseek2", "glm4moe", "hy_v3")
PROMPT = [1, *range(40, 80)]
N, CTX = 24, 256
WINDOW = {MTP: Fixed(WindowPolicy(policy="fixed", initial=3, min=1, max=3))}
GREEDY, SEEDED = SamplingParams(), SamplingParams(temperature=0.9, seed=7, logprobs=2)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("mtp")
    out = {}
    for arch in FAMILIES:
        gguf = write_tiny(root / f"{arch}.gguf", arch)
        out[arch] = gguf, agreeing(gguf, root / f"{arch}-agreeing.gguf")
    return out


@dataclass
class Run:
    tokens: list[Sampled]
    account: Account
    sent: list[Outgoing]


async def _generate(gguf: Path, mtp: bool, sampling: SamplingParams, depth: int = 1) -> Run:
    engine = LlamaRangeEngine(gguf, EngineConfig(first=True, final=True, lanes=2, ctx_per_lane=CTX, mtp=mtp))
    pipeline = Pipeline(engine, None, options=PipelineOptions(mtp=mtp))
    sent: list[Outgoing] = []
    send = pipeline.send

    async def recorded(session: int, lane: int, out: Outgoing) -> Pending:
        sent.append(out)
        return await send(session, lane, out)  # type: ignore[arg-type]

    pipeline.send = recorded  # type: ignore[method-assign]
    pipeline.start()
    try:
        req = GenerationRequest(PROMPT, N, sampling)
        live = Live(RequestState(req, speculative=mtp))
        proposing = Proposing(MtpProposer(), WINDOW, depth) if mtp else NO_PROPOSER
        tokens = [s async for s in generate(pipeline, pipeline.lease(SessionId(1), PROMPT), live, CTX, proposing)
                  if isinstance(s, Sampled)]
        return Run(tokens, live.state.account(), sent)
    finally:
        await pipeline.stop()
        engine.close()


def _run(gguf: Path, mtp: bool, sampling: SamplingParams, depth: int = 1) -> Run:
    return asyncio.run(_generate(gguf, mtp, sampling, depth))


@pytest.mark.parametrize("arch", FAMILIES)
def test_rejected_mtp_drafts_leave_greedy_and_seeded_output_as_plain_decoding_gives_it(
        arch: str, models: dict[str, tuple[Path, Path]]) -> None:
    # Tokens, as every family's speculation is held to (tests/test_architectures.py): these MoE
    # routers' F32 matmuls are not row-invariant, so a verify row's logprobs part from a plain
    # decode's in the last digits (1e-3 on deepseek2) whoever drafts; a dense family's do not.
    gguf = models[arch][0]
    for sampling, depth in ((GREEDY, 3), (SEEDED, 1)):
        plain, drafted = _run(gguf, False, sampling), _run(gguf, True, sampling, depth)
        assert [s.token for s in drafted.tokens] == [s.token for s in plain.tokens]
        spec = drafted.account.speculative
        assert spec is not None
        assert dict(spec.by)[MTP].windows > N // 2


@pytest.mark.parametrize("depth", [1, 3])
def test_an_agreeing_mtp_layer_is_accepted_whole_and_frames_go_out_ahead(
        depth: int, models: dict[str, tuple[Path, Path]]) -> None:
    gguf = models["glm4moe"][1]
    plain, drafted = _run(gguf, False, GREEDY), _run(gguf, True, GREEDY, depth)
    assert [s.token for s in drafted.tokens] == [s.token for s in plain.tokens] == [0] * N
    spec = drafted.account.speculative
    assert spec is not None
    assert spec.accepted == spec.proposed >= N * 2 // 3
    verify = [o for o in drafted.sent if o.drafts]
    assert all(o.drafts == 3 for o in verify[:-1])
    if depth > 1:  # a frame that feeds only drafts left before the reply ahead of it
        assert any(o.drafts == len(o.tokens) for o in verify)


def test_rejection_sampled_mtp_drafts_travel_with_their_q(models: dict[str, tuple[Path, Path]]) -> None:
    run = _run(models["deepseek2"][0], True, SamplingParams(temperature=1.0, acceptance=REJECTION))
    assert len(run.tokens) == N
    proposed = [d for o in run.sent for d in o.proposed]
    assert proposed
    assert all(d.ids and d.token in d.ids and abs(sum(d.probs()) - 1) < 1e-6 for d in proposed)


def test_the_target_computes_every_decode_row_as_without_the_mtp_context(models: dict[str, tuple[Path, Path]]) -> None:
    gguf = models["deepseek2"][0]

    def rows(mtp: bool) -> list[np.ndarray]:
        engine = LlamaRangeEngine(gguf, EngineConfig(first=True, final=True, lanes=1, ctx_per_lane=CTX, mtp=mtp))
        try:
            engine.step([Step(0, 0, tokens=np.asarray(PROMPT, dtype=np.int32))])
            one = engine.step([Step(0, len(PROMPT), tokens=np.asarray([5], dtype=np.int32))])[0]
            window = engine.step([Step(0, len(PROMPT) + 1, tokens=np.asarray([6, 7, 8], dtype=np.int32),
                                       all_logits=True)])[0]
            return [one, window]
        finally:
            engine.close()

    for with_mtp, without in zip(rows(True), rows(False), strict=True):
        assert np.array_equal(with_mtp, without)


def test_the_mtp_kv_follows_the_frames_start_and_drafts_need_the_row_before(
        models: dict[str, tuple[Path, Path]]) -> None:
    """After a window whose first draft was rejected, the next frame's start trims the MTP KV
    as it trims the target's; a draft from a position whose hidden row was never kept gives none."""
    gguf = models["glm4moe"][0]
    engine = LlamaRangeEngine(gguf, EngineConfig(first=True, final=True, lanes=1, ctx_per_lane=CTX, mtp=True))
    head = engine.mtp
    assert head is not None
    assert head.layers == 1
    try:
        engine.step([Step(0, 0, tokens=np.asarray(PROMPT, dtype=np.int32))])
        p = len(PROMPT)
        engine.step([Step(0, p, tokens=np.asarray([5, 6, 7, 8], dtype=np.int32), all_logits=True)])
        assert head._end(0) == p + 4
        drafts = engine.mtp_draft(0, p + 1, 9, 3, lambda lg, _: Proposed(int(np.argmax(lg))))
        assert len(drafts) == 3
        assert head._end(0) == p + 4
        engine.step([Step(0, p + 1, tokens=np.asarray([9], dtype=np.int32))])  # 6 was rejected: 9 at p + 1
        assert head._end(0) == p + 2
        assert engine.mtp_draft(0, p + 40, 1, 3, lambda lg, _: Proposed(0)) == []
        # a frame sent ahead ran before the reply ahead of it drafted: its rows are fed again after
        engine.step([Step(0, p + 2, tokens=np.asarray([10, 11], dtype=np.int32), all_logits=True)])
        assert head._end(0) == p + 4
        assert len(engine.mtp_draft(0, p + 2, 10, 3, lambda lg, _: Proposed(int(np.argmax(lg))))) == 3
        assert head._end(0) == p + 4  # 10 and 11, fed again over the drafts' rows
        # with frames in flight, each reply drafts one window more: the chain's drafts are kept
        pick = lambda lg, _: Proposed(int(np.argmax(lg)))  # noqa: E731
        engine.step([Step(0, p + 4, tokens=np.asarray([12], dtype=np.int32))])
        first = engine.mtp_draft(0, p + 5, 13, 3, pick)
        assert head._end(0) == p + 8
        again = engine.mtp_draft(0, p + 6, first[0].token, 3, pick)
        assert again[:2] == first[1:]
        assert head._end(0) == p + 9  # one step more, not three
        # a frame fed since cut the chain's steps off: they are made again, then one step more
        engine.step([Step(0, p + 5, tokens=np.asarray([13, first[0].token], dtype=np.int32), all_logits=True)])
        assert head._end(0) == p + 7
        third = engine.mtp_draft(0, p + 7, again[0].token, 3, pick)
        assert third[:2] == again[1:]
        assert head._end(0) == p + 10
        assert engine.mtp_draft(0, p + 5, 14, 1, pick) != []  # another token there: drafted afresh
        assert head._end(0) == p + 6
    finally:
        engine.close()


@pytest.mark.parametrize(("start", "fed", "picks", "all_logits", "checks", "at"), [
    (10, [4], [7], False, False, (11, 7)),  # a plain decode: the token after the row
    (10, [1, 2, 3], [9], False, False, (13, 9)),  # a prefill's last row
    (10, [4, 5, 6], [5, 6, 8], True, False, (13, 8)),  # every draft accepted: the target's token after
    (10, [4, 5, 6], [5, 9, 8], True, False, (12, 9)),  # the second draft rejected
    (10, [4, 5, 6], [3, 9, 8], True, False, (11, 3)),  # the first rejected
    (10, [4, 5], [2, 5, 7], True, True, (10, 2)),  # rejection sampling: the first fed draft rejected
    (10, [4, 5], [4, 5, 7], True, True, (12, 7)),  # ... and kept, with the rest
])
def test_a_reply_commits_its_last_token_where_stage_0_will_read_it(
        start: int, fed: list[int], picks: list[int], all_logits: bool, checks: bool, at: tuple[int, int]) -> None:
    assert committed_last(start, fed, picks, all_logits, checks) == at


def test_a_final_stage_that_drafts_with_mtp_is_planned_with_its_block_kv_and_embeddings(tmp_path: Path) -> None:
    package = tmp_path / "package"
    manifest = write_package(write_tiny(tmp_path / "deepseek2.gguf", "deepseek2"), package, progress=lambda _: None)
    plain, mtp = package_sizes(package, manifest), package_sizes(package, manifest, mtp=True)
    assert plain.mtp_weights == plain.mtp_kv == 0
    assert mtp.mtp_weights == sum(a.tensor_bytes for a in manifest.mtp_layers) > 0
    assert mtp.mtp_kv == plain.layer_kv[-1] > 0  # one more attention layer's keys and values
    layers, cut = manifest.layer_count, manifest.allowed_cuts[0]
    final, middle = StageRange(cut, layers), StageRange(0, cut)
    with_mtp, without = footprint(mtp, final, LLAMA, 2, 256), footprint(plain, final, LLAMA, 2, 256)
    embeddings = 0 if plain.tied else plain.embeddings
    assert with_mtp.weights - without.weights == mtp.mtp_weights + embeddings
    assert with_mtp.kv - without.kv == 2 * 256 * LLAMA.kv_bytes * mtp.mtp_kv
    assert footprint(mtp, middle, LLAMA, 2, 256) == footprint(plain, middle, LLAMA, 2, 256)
