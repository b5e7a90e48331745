"""A range engine over recurrent and hybrid layers rolls back by checkpoint (stage/checkpoints.py).

Tiny random-weight models (tests/tiny_models.py) in Q4_0, whose k-row decode equals k
single-row decodes on recurrent layers too, so every comparison is exact: a lane that verifies
windows and rolls back on every rejection gives plain decoding's tokens, its replayed rows
ride in the next step's decode, and a rollback past the checkpoints is refused by name.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from chain import build_chain, close
from inproc_requests import serving
from tiny_models import write_tiny

from common.sampling import Sampled, SamplingParams
from mesh.backend import GenerationRequest
from mesh.routing.planner import StageRange
from mesh.routing.stage_fit import StageNeed, footprint, misfits, package_sizes
from mesh.serving.pipeline import Pipeline, PipelineOptions
from mesh.speculative.draft import Draft
from packages.manifest import load_manifest
from packages.requantize import requantize
from packages.writer import write_package
from stage import llama_engine
from stage.checkpoints import DEPTH, DRAFT_DEPTH, CannotRollBackError
from stage.engine import EngineConfig, Step
from stage.engine_choice import LLAMA
from stage.kv_tier import KvTier, Shelf
from stage.lane_tier import Begin, LaneTier
from stage.llama_engine import LlamaRangeEngine

PROMPT = np.array([1, *range(40, 60), 7, 7, 9], dtype=np.int32)
N = 16


@pytest.fixture(scope="module", params=["qwen35", "mamba2"])
def engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaRangeEngine]:
    root = tmp_path_factory.mktemp(request.param)
    gguf = requantize(write_tiny(root / "f32.gguf", request.param), root / "q4_0.gguf", "Q4_0")
    e = LlamaRangeEngine(gguf, EngineConfig(first=True, final=True, lanes=2, ctx_per_lane=128, threads=1))
    yield e
    e.close()


def _plain(e: LlamaRangeEngine, lane: int) -> list[int]:
    e.trim(lane, 0)
    logits = e.step([Step(lane, 0, tokens=PROMPT)])[0]
    out = []
    for _ in range(N):
        out.append(int(logits[-1].argmax()))
        logits = e.step([Step(lane, len(PROMPT) + len(out) - 1, tokens=np.array(out[-1:], dtype=np.int32))])[0]
    return out


def test_windows_rejected_at_every_row_give_plain_decodings_tokens(engine: LlamaRangeEngine) -> None:
    plain = _plain(engine, 0)
    engine.trim(1, 0)
    got = [int(engine.step([Step(1, 0, tokens=PROMPT)])[0][-1].argmax())]
    rng = np.random.default_rng(0)
    rejected = 0
    while len(got) < N:
        # drafts right for a random number of rows, then wrong: every row gets rejected sometime
        right = int(rng.integers(0, 3))
        drafts = [*plain[len(got) : len(got) + right], 1]
        start = len(PROMPT) + len(got) - 1
        rows = engine.step([Step(1, start, tokens=np.array([got[-1], *drafts], dtype=np.int32), all_logits=True)])[0]
        assert len(rows) == len(drafts) + 1  # the replayed rows' logits are not the step's
        for draft, row in zip([*drafts, None], rows, strict=True):
            got.append(int(row.argmax()))
            if draft != got[-1]:
                rejected += draft is not None
                break
    assert got[:N] == plain
    assert rejected >= 4


def test_a_rollback_replays_before_the_next_step_and_is_refused_past_the_checkpoints(engine: LlamaRangeEngine) -> None:
    engine.trim(0, 0)
    engine.step([Step(0, 0, tokens=PROMPT)])
    engine.step([Step(0, len(PROMPT), tokens=np.array([5, 6, 7, 8], dtype=np.int32))])
    engine.trim(0, len(PROMPT) + 2)
    ring = engine.recurrent.rings[0] if engine.recurrent is not None else None
    assert ring is not None
    assert (ring.held, ring.pending) == (len(PROMPT), 2)  # restored before the frame: two rows to replay
    assert engine.position(0) == len(PROMPT) + 2
    for i in range(DEPTH):  # frames of two rows: each takes its checkpoint
        engine.step([Step(0, engine.position(0), tokens=np.array([9 + i, 9], dtype=np.int32))])
    assert ring.pending == 0
    assert ring.saved[0][0] == len(PROMPT) + 2  # the replay ended where the first frame's checkpoint was taken
    with pytest.raises(CannotRollBackError, match="oldest checkpoint"):
        engine.trim(0, len(PROMPT) + 1)
    assert not engine.reachable(0, len(PROMPT) + 1)
    assert engine.reachable(0, 0)


def test_single_rows_take_a_checkpoint_only_every_depth_rows(engine: LlamaRangeEngine) -> None:
    """A rollback lands past a frame's first row: a one-row frame's checkpoint would go unused."""
    engine.trim(0, 0)
    engine.step([Step(0, 0, tokens=PROMPT)])
    for token in range(3 * DEPTH):
        engine.step([Step(0, engine.position(0), tokens=np.array([token], dtype=np.int32))])
    ring = engine.recurrent.rings[0] if engine.recurrent is not None else None
    assert ring is not None
    assert [p for p, _ in ring.saved] == [0, *(len(PROMPT) + i * DEPTH for i in range(3))]  # 0: before the prompt
    assert ring.base == ring.saved[0][0]  # rows are kept from the oldest checkpoint on


def test_the_pipeline_keeps_frames_in_flight_within_the_checkpoints(engine: LlamaRangeEngine) -> None:
    assert Pipeline(engine, None).most_in_flight == DEPTH - 1
    assert Pipeline(engine, None, options=PipelineOptions(recurrent=False)).most_in_flight is None
    assert Pipeline(engine, None).cache.exact  # type: ignore[union-attr]


def test_a_hybrid_draft_starts_a_lane_over_where_its_checkpoints_do_not_reach(tmp_path: Path) -> None:
    gguf = requantize(write_tiny(tmp_path / "f32.gguf", "qwen35"), tmp_path / "q4_0.gguf", "Q4_0")
    first, second = [int(t) for t in PROMPT], [int(t) for t in PROMPT[:6]] + [3, 4, 5]

    async def proposals(sequences: list[list[int]]) -> list[int]:
        draft = Draft(gguf, lanes=1, ctx_per_lane=128, threads=1)
        draft.start()
        try:
            for sequence in sequences:
                out = await draft.propose(0, sequence, DRAFT_DEPTH + 2)  # a step each: past the checkpoints
            return out
        finally:
            await draft.stop()

    # parting at position 6, long before its oldest checkpoint: the lane is fed again from 0
    assert asyncio.run(proposals([first, second])) == asyncio.run(proposals([second]))


def test_lanes_rejected_every_frame_batched_at_a_split_equal_each_alone(tmp_path: Path) -> None:
    """Four lanes whose every verify frame keeps only its first row, decoded batched at each
    stage of a split-3, equal each lane decoded alone. (When the replay rode in the next frame's
    decode, no frame start got a checkpoint: the replay grew by a row a frame, and the batch
    outgrew one graph, whose hidden rows then came back out of order.)"""
    gguf = requantize(write_tiny(tmp_path / "f32.gguf", "qwen35", layers=12), tmp_path / "q4_0.gguf", "Q4_0")
    package = tmp_path / "pkg"
    write_package(gguf, package, progress=lambda _: None)
    batched, alone = (build_chain(package, [4, 8], tmp_path / name, lanes=4, ctx=128) for name in ("a", "b"))
    rng = np.random.default_rng(0)
    starts = [0] * 4
    try:
        for frame in range(24):
            steps = [Step(lane, starts[lane], tokens=rng.integers(3, 200, 4 if frame else 9).astype(np.int32),
                          all_logits=True) for lane in range(4)]
            assert [o.tolist() for o in _through(batched, steps, together=True)] == \
                [o.tolist() for o in _through(alone, steps, together=False)]
            starts = [s.start + (1 if frame else 9) for s in steps]  # the next frame starts after row 0
    finally:
        close(batched)
        close(alone)


def _through(chain: list, steps: list[Step], together: bool) -> list[np.ndarray]:
    for engine in chain:
        outs = engine.step(steps) if together else [engine.step([s])[0] for s in steps]
        if engine.final:
            return outs
        steps = [Step(s.lane, s.start, hidden=o, all_logits=s.all_logits) for s, o in zip(steps, outs, strict=True)]
    raise AssertionError("a chain ends with a final stage")


def test_a_hybrid_lane_is_reused_only_by_a_prompt_that_extends_all_it_holds(tmp_path: Path) -> None:
    """The prefix cache is exact on recurrent state: a chat's next turn reuses the whole lane,
    an edited prompt nothing, and both give what a server without the cache gives."""
    root = tmp_path / "models"
    root.mkdir()
    gguf = write_tiny(root / "f32.gguf", "qwen35")
    target, draft = requantize(gguf, root / "q4_0.gguf", "Q4_0"), requantize(gguf, root / "q8_0.gguf", "Q8_0")
    first = [int(t) for t in PROMPT]

    async def run(prefix_cache: bool, prompts: list[list[int]]) -> list[tuple[list[int], int]]:
        out = []
        async with serving(target, tmp_path / "cache", draft=True, prefix_cache=prefix_cache, draft_gguf=draft,
                           in_flight=3) as served:
            for prompt in prompts:
                gen = served.requests.generate(GenerationRequest(prompt, 8, SamplingParams(), ignore_eos=True))
                async with contextlib.aclosing(gen) as events:
                    tokens = [e.token async for e in events if isinstance(e, Sampled)]
                out.append((tokens, gen.account.cached_tokens))
        return out

    (answer, _), = asyncio.run(run(False, [first]))
    turn, edited = [*first, *answer, 5, 6], [*first[:4], 9, *first[5:]]
    cached = asyncio.run(run(True, [first, turn, edited]))
    assert [c for _, c in cached] == [0, len(first) + len(answer) - 1, 0]  # the last token sampled was never fed
    assert [t for t, _ in cached] == [t for t, _ in asyncio.run(run(False, [first, turn, edited]))]


def test_the_fit_check_counts_each_stages_recurrent_state_and_its_checkpoints(tmp_path: Path) -> None:
    gguf = requantize(write_tiny(tmp_path / "f32.gguf", "qwen35", layers=12), tmp_path / "q4_0.gguf", "Q4_0")
    package = tmp_path / "pkg"
    write_package(gguf, package, progress=lambda _: None)
    sizes = package_sizes(package, load_manifest(package)[0])
    assert [bool(n) for n in sizes.layer_state] == [(i + 1) % 4 != 0 for i in range(12)]  # attention every 4th
    engine = build_chain(package, [], tmp_path / "cache", lanes=1, ctx=64)[0]
    try:
        engine.step([Step(0, 0, tokens=PROMPT)])
        assert engine.recurrent is not None
        measured = len(engine.recurrent.save(0))  # llama.cpp's own: the F32 state and a small header
    finally:
        engine.close()
    counted = footprint(sizes, StageRange(0, 12), LLAMA, lanes=2, ctx=64).state
    assert 0 <= 2 * (1 + DEPTH) * measured - counted < 2 * (1 + DEPTH) * 256
    short = [StageNeed("stage 0", StageRange(0, 12), LLAMA, counted, "a")]
    assert f"recurrent state ({1 + DEPTH} copies a lane)" in misfits(sizes, short, lanes=2, ctx=64)[0]


def test_the_replay_runs_inside_the_step_that_follows_a_rollback(engine: LlamaRangeEngine,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """So the step's measured time, which the hop timings and the cost-aware window read, carries
    what the rejection cost: a restore and a decode of the accepted rows."""
    engine.trim(0, 0)
    engine.step([Step(0, 0, tokens=PROMPT)])
    engine.step([Step(0, len(PROMPT), tokens=np.array([5, 6, 7, 8], dtype=np.int32))])
    engine.trim(0, len(PROMPT) + 2)  # rows 0 and 1 of the frame accepted
    decodes: list[int] = []
    real = llama_engine.L.llama_decode

    def counted(ctx: object, batch: llama_engine.L.llama_batch) -> int:
        decodes.append(batch.n_tokens)
        return real(ctx, batch)

    monkeypatch.setattr(llama_engine.L, "llama_decode", counted)
    engine.step([Step(0, len(PROMPT) + 2, tokens=np.array([9, 9, 9], dtype=np.int32))])
    assert decodes == [2, 3]  # the replayed rows, then the step's own


def test_a_lane_filed_in_the_kv_tier_loads_into_another_with_its_recurrent_state(engine: LlamaRangeEngine,
                                                                                 tmp_path: Path) -> None:
    """The tier keeps a hybrid's whole sequence, attention KV and recurrent state (DESIGN.md §2,
    "KV tier"): loaded into the other lane, it decodes plain decoding's tokens from there, and
    takes its first checkpoint at the loaded position."""
    plain = _plain(engine, 0)
    tiers = LaneTier(engine, KvTier(ram=1 << 30, disk=0, root=tmp_path), Shelf("tiny", "c"))
    engine.trim(0, 0)
    engine.step([Step(0, 0, tokens=PROMPT)])
    tiers.ended(0, "prompt", len(PROMPT))
    tiers.begin(0, Begin(evict=True))
    engine.trim(0, 0)
    engine.trim(1, 0)
    tiers.begin(1, Begin(restore="prompt", positions=len(PROMPT)))
    assert engine.position(1) == len(PROMPT)
    # the prompt's first token came from its last row, which the entry holds: feed it on from there
    logits = engine.step([Step(1, len(PROMPT), tokens=np.array([plain[0]], dtype=np.int32))])[0]
    out = [plain[0]]
    for _ in range(N - 1):
        out.append(int(logits[-1].argmax()))
        logits = engine.step([Step(1, len(PROMPT) + len(out) - 1, tokens=np.array(out[-1:], dtype=np.int32))])[0]
    assert out == plain
