"""The prefix cache (DESIGN.md §2): lane choice, and greedy output through `mesh serve` that is
identical with and without it, with the reused tokens reported exactly.

The real-model tests compare against a `--no-prefix-cache --no-draft` server on one stage:
split output equals the unsplit model and speculative output equals no-draft output for
SmolLM2 Q4_1 with flash attention on, whose kernels are batch-invariant (tests/test_mesh_e2e.py,
tests/test_speculative.py), so any difference here is the cache's.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import anyio
import numpy as np
import openai
import pytest
from mesh_server import mesh_serve, metric
from openai.types.chat import ChatCompletionMessageParam
from toy_engine import ToyEngine

from common.ids import LaneId, SessionId
from common.tokens import common_prefix
from mesh.model.source import EMBEDDED_ID
from mesh.model.tokenizer import Tokenizer
from mesh.serving.pipeline import Pipeline
from mesh.serving.prefix_cache import PrefixCache
from stage.core import StageCore
from stage.engine import Step
from stage.lanes import LanePool, LanesExhaustedError
from stage.llama_engine import EngineConfig, LlamaRangeEngine

TOKENS = 16


def test_the_longest_match_wins_and_at_least_one_prompt_token_is_left_to_prefill():
    cache = PrefixCache()
    cache.keep(0, [1, 2, 3, 4, 5])
    cache.keep(1, [1, 2, 9])
    assert cache.choose([1, 2, 3, 7], free=[0, 1]) == 0
    assert cache.match(0, [1, 2, 3, 7]) == 3
    assert cache.match(0, [1, 2, 3]) == 2  # all cached: the last token is fed again for its logits
    assert cache.match(1, [1, 2, 9, 9, 9]) == 3
    assert cache.match(0, [8]) == 0


def test_an_exact_cache_matches_only_a_prompt_that_extends_all_the_lane_holds():
    """Recurrent state is held at the lane's own position only (stage/checkpoints.py)."""
    cache = PrefixCache(exact=True)
    cache.keep(0, [1, 2, 3, 4])
    assert cache.match(0, [1, 2, 3, 4, 5, 6]) == 4  # a chat's next turn: everything reused
    assert cache.match(0, [1, 2, 3, 9, 5, 6]) == 0  # parts at 3: a trim to 3 cannot be restored
    assert cache.match(0, [1, 2, 3, 4]) == 0  # the last prompt token must be fed again
    trimming = PrefixCache()
    trimming.keep(0, [1, 2, 3, 4])
    assert trimming.match(0, [1, 2, 3, 9, 5, 6]) == 3  # attention KV is trimmed to the match


def test_without_a_match_the_least_recently_used_lane_is_evicted():
    cache = PrefixCache()
    cache.keep(2, [5, 5])
    cache.keep(0, [6, 6])
    assert cache.choose([7, 7], free=[0, 1, 2]) == 1  # never used
    assert cache.choose([7, 7], free=[0, 2]) == 2  # used before lane 0
    assert cache.take([7, 7], free=[0, 2]).lane == 2
    assert cache.match(2, [5, 5, 5]) == 0  # taken: what it held is being replaced


def test_a_stage_takes_exactly_the_lane_a_frame_names_or_refuses():
    pool = LanePool(2)
    assert pool.take(SessionId(7), LaneId(1)) == 1
    assert pool.take(SessionId(7), LaneId(1)) == 1  # later frames of the session
    with pytest.raises(ValueError, match="holds lane 1"):
        pool.take(SessionId(7), LaneId(0))
    with pytest.raises(LanesExhaustedError, match="taken"):
        pool.take(SessionId(8), LaneId(1))
    with pytest.raises(ValueError, match="out of range"):
        pool.take(SessionId(8), LaneId(2))  # from the network: checked before use
    assert pool.release(SessionId(7)) == 1
    assert pool.take(SessionId(8), LaneId(1)) == 1


def test_an_end_cannot_keep_more_than_the_lane_holds():
    core = StageCore(ToyEngine(first=True, final=True), 0)
    with pytest.raises(ValueError, match="outside the lane's context"):
        core.release(SessionId(1), core.engine.ctx_per_lane + 1)



class _StuckLink:
    """An activation link whose every send is queued and never drains: a backed-up link."""

    async def send(self, header: object, payload: object = None) -> None:
        await asyncio.Event().wait()


def test_an_end_whose_drain_is_cut_short_still_frees_the_lane_here():
    """`Requests` bounds a session's end (END_S): a slow link's drain past it had left the
    lane taken at stage 0, and its tokens out of the prefix cache, for the route's life."""

    async def scenario() -> None:
        pipeline = Pipeline(ToyEngine(first=True, final=False), _StuckLink())  # type: ignore[arg-type]
        lease = pipeline.lease(SessionId(1), [5, 6, 7])
        async with asyncio.timeout(5):
            with anyio.move_on_after(0.2):
                await pipeline.end(SessionId(1), [5, 6])
        assert pipeline.core.lanes.by_session == {}
        assert pipeline.cache is not None
        assert pipeline.cache.held[lease.lane] == (5, 6)
        await pipeline.core.stop()

    asyncio.run(scenario())

# -- through mesh serve, SmolLM2 --------------------------------------------------------------

STORY = ("The lighthouse keeper climbed the spiral stairs every evening at dusk. He polished the great "
         "lens, trimmed the wick, and wrote the weather in a leather logbook that his grandmother had "
         "started sixty years before. Ships passed far out on the grey water, and none of them knew his name.")


@pytest.fixture(scope="module")
def prompts(smollm2_gguf: Path) -> dict[str, list[int]]:
    tok = Tokenizer(smollm2_gguf, EMBEDDED_ID)
    story = tok.tokenize(STORY, special=False)
    ask = {name: tok.tokenize(f"{STORY}\n\nQuestion: {q}\nAnswer:", special=False) for name, q in
           (("p", "What did the keeper write in the logbook?"), ("q", "Who started the logbook?"))}
    return {"p": ask["p"], "q": ask["q"], "head": story[: len(story) // 2],
            "x": tok.tokenize("A recipe for bread: flour, water, salt and", special=False),
            "y": tok.tokenize("def fibonacci(n):\n    if n < 2:\n        return", special=False)}


def _complete(url: str, prompt: list[int]) -> tuple[str, int]:
    """Greedy text for a token-id prompt, and the prompt tokens the server says it reused."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    r = client.completions.create(model=EMBEDDED_ID, prompt=prompt, temperature=0, max_tokens=TOKENS)
    assert r.usage is not None
    assert r.usage.prompt_tokens_details is not None
    return r.choices[0].text, r.usage.prompt_tokens_details.cached_tokens or 0


CHAT = [f"Here is a note from the keeper's log: {STORY} Summarize it in two sentences.",
        "Now say what the keeper might do tomorrow."]


def _chat(url: str) -> list[tuple[str, int, int]]:
    """Two turns of a chat, the second resending the first with its reply: (reply, cached,
    prompt tokens) per turn. The second turn's cached tokens were computed as the first turn's decode."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    messages: list[ChatCompletionMessageParam] = []
    turns = []
    for text in CHAT:
        messages.append({"role": "user", "content": text})
        r = client.chat.completions.create(model=EMBEDDED_ID, messages=messages, temperature=0, max_tokens=40)
        reply = r.choices[0].message.content or ""
        assert r.usage is not None
        assert r.usage.prompt_tokens_details is not None
        turns.append((reply, r.usage.prompt_tokens_details.cached_tokens or 0, r.usage.prompt_tokens))
        messages.append({"role": "assistant", "content": reply})
    return turns


@pytest.mark.mesh
def test_a_row_is_computed_alike_prefilled_in_any_pieces_or_decoded(smollm2_gguf):
    """What makes a reused prefix exact: llama.cpp's CPU kernels for graphs of 64 rows or
    more differ from a decode's, and the engine keeps every graph under that (INVARIANT_ROWS)."""
    engine = LlamaRangeEngine(smollm2_gguf, EngineConfig(first=True, final=True, lanes=1, ctx_per_lane=512,
                                                         batch=256, threads=1))
    tokens = np.random.default_rng(0).integers(100, 40000, 200).astype(np.int32)

    def last_logits(pieces: list[int]) -> np.ndarray:
        engine.trim(0, 0)
        pos, out = 0, np.zeros(0)
        for n in pieces:
            out = engine.step([Step(0, pos, tokens=tokens[pos : pos + n])])[0]
            pos += n
        return out[-1]

    try:
        whole = last_logits([200])
        for pieces in ([128, 72], [136, 64], [137, 63], [150] + [1] * 50, [100, 9, 9, 9, 73]):
            assert np.array_equal(last_logits(pieces), whole), pieces
    finally:
        engine.close()


@pytest.fixture(scope="module")
def uncached(serve_cache: Path, prompts: dict[str, list[int]]) -> dict[str, str]:
    """What every prompt gives without the cache (and without speculation), one stage."""
    with mesh_serve(serve_cache, "--local-stages", "1", "--no-prefix-cache", "--no-draft") as (url, _):
        texts = {}
        for name, prompt in prompts.items():
            texts[name], cached = _complete(url, prompt)
            assert cached == 0
        assert _complete(url, prompts["p"]) == (texts["p"], 0)  # off means off
        turns = _chat(url)
        assert [cached for _, cached, _ in turns] == [0, 0]
        texts |= {f"chat{i}": reply for i, (reply, _, _) in enumerate(turns)}
        return texts


def _cached_server(cache: Path, stages: int) -> contextlib.AbstractContextManager[tuple[str, object]]:
    # two lanes, so a third unrelated prompt evicts; the package's draft with windows in
    # flight, so its KV and frames sent ahead are reused and trimmed too; the lanes alone, no
    # KV tier to keep what they evict (tests/test_kv_tier_served.py)
    return mesh_serve(cache, "--local-stages", str(stages), "--lanes", "2", "--frames-in-flight", "3",
                      "--cache-ram", "0")


@pytest.mark.mesh
@pytest.mark.parametrize("stages", [1, 2, 3])
def test_cached_output_equals_uncached_and_the_reuse_is_reported(serve_cache, prompts, uncached, stages):
    p, q, head = prompts["p"], prompts["q"], prompts["head"]
    with _cached_server(serve_cache, stages) as (url, _):
        assert _complete(url, p) == (uncached["p"], 0)  # a fresh server holds nothing
        assert _complete(url, p) == (uncached["p"], len(p) - 1)  # all but the token whose logits start the reply
        # another session shares the story and diverges at the question
        assert _complete(url, q) == (uncached["q"], common_prefix(p, q))
        # the cached lane is longer than the prompt: every stage trims it in the middle
        assert _complete(url, head) == (uncached["head"], len(head) - 1)
        # eviction, two lanes: x takes the lane never used, y the one used longest ago (head's)
        assert _complete(url, prompts["x"]) == (uncached["x"], 0)
        assert _complete(url, prompts["y"]) == (uncached["y"], 0)
        assert _complete(url, p) == (uncached["p"], 0)  # p is gone; x's lane is evicted now
        cached = len(p) - 1 + common_prefix(p, q) + len(head) - 1
        assert metric(url, "meshpipe_prompt_tokens_cached_total") == cached
        sent = 3 * len(p) + len(q) + len(head) + len(prompts["x"]) + len(prompts["y"])
        assert metric(url, "meshpipe_prompt_tokens_prefilled_total") == sent - cached
        # a chat's next turn: its reused prefix runs through the last turn's reply, whose
        # KV was computed one token at a time, not prefilled
        (first, _, asked), (second, reused, _) = _chat(url)
        assert (first, second) == (uncached["chat0"], uncached["chat1"])
        assert reused > asked + 8  # more than the first turn's prompt: its reply too


@pytest.mark.mesh
def test_concurrent_sessions_sharing_a_prefix_each_get_their_own_lane(serve_cache, prompts, uncached):
    p = prompts["p"]
    with _cached_server(serve_cache, 3) as (url, _):
        _complete(url, p)  # a lane holds the story now
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        # p takes that lane again and holds it for seconds (no EOS, many tokens) ...
        stream = client.completions.create(model=EMBEDDED_ID, prompt=p, temperature=0, max_tokens=160, stream=True,
                                           stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        chunks = iter(stream)
        first = next(chunks)
        # ... while q, which shares the story, is served on the other lane, from scratch
        assert _complete(url, prompts["q"]) == (uncached["q"], 0)
        rest = list(chunks)
    assert "".join(c.choices[0].text for c in [first, *rest] if c.choices).startswith(uncached["p"])
    usage = rest[-1].usage
    assert usage is not None
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == len(p) - 1
