"""The KV tier through `mesh serve` (DESIGN.md §2, "KV tier"; issue 57): a conversation evicted
from its lane is kept by every stage and comes back from host memory, or from disk after a
restart of every process, with output equal to a server without any cache; a corrupt file is
dropped with a warning and prefilled again.

One lane and split-2, so every other conversation evicts the last; SmolLM2 Q4_1 with flash
attention, at the default thread count, whose rows are computed alike prefilled or decoded
(tests/test_prefix_cache.py), so any difference here is the tier's.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
from mesh_server import free_port, mesh_serve, metric, wait_for

from common.tokens import common_prefix
from mesh.model.source import EMBEDDED_ID
from mesh.model.tokenizer import Tokenizer

TOKENS = 12
NOTES = {
    "a": "The lighthouse keeper climbed the spiral stairs every evening at dusk. He polished the great lens, "
         "trimmed the wick, and wrote the weather in a leather logbook his grandmother had started.",
    "b": "The baker rose at four to fold the dough, shaped forty loaves before the sun came up, and sold the "
         "last of them to the schoolteacher who always asked for the darkest crust.",
}


@pytest.fixture(scope="module")
def turns(smollm2_gguf: Path) -> dict[str, list[int]]:
    """Two conversations of two turns each, as token prompts: the second turn extends the first."""
    tok = Tokenizer(smollm2_gguf, EMBEDDED_ID)
    out = {}
    for name, note in NOTES.items():
        first = f"{note * 4}\n\nQuestion: what happens first?\nAnswer:"
        out[f"{name}1"] = tok.tokenize(first, special=False)
        out[f"{name}2"] = tok.tokenize(f"{first} Something.\nQuestion: and then?\nAnswer:", special=False)
    return out


def _complete(url: str, prompt: list[int], seed: int | None = None) -> tuple[str, int]:
    """Greedy text (or seeded, at temperature 0.9) and the prompt tokens the server reused."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    r = client.completions.create(model=EMBEDDED_ID, prompt=prompt, temperature=0 if seed is None else 0.9,
                                  seed=seed, max_tokens=TOKENS)
    assert r.usage is not None
    assert r.usage.prompt_tokens_details is not None
    return r.choices[0].text, r.usage.prompt_tokens_details.cached_tokens or 0


@pytest.fixture(scope="module")
def plain(serve_cache: Path, turns: dict[str, list[int]]) -> dict[str, str]:
    """Every prompt's greedy text with no cache at all, on one stage."""
    with mesh_serve(serve_cache, "--local-stages", "1", "--no-prefix-cache", "--no-draft", threads=None) as (url, _):
        texts = {name: _complete(url, prompt)[0] for name, prompt in turns.items()}
        return texts | {"a2 seeded": _complete(url, turns["a2"], seed=3)[0]}


def _serve(cache: Path, port: int, *extra: str):  # -> context manager of (url, process)
    return mesh_serve(cache, "--local-stages", "2", "--lanes", "1", "--no-draft", "--cache-disk", "1GiB",
                      *extra, threads=None, port=port)


@pytest.mark.mesh
def test_an_evicted_conversation_comes_back_from_the_tier_and_from_disk_after_a_restart(serve_cache, turns, plain):
    cache = serve_cache
    port = free_port()
    with _serve(cache, port) as (url, _):
        assert _complete(url, turns["a1"]) == (plain["a1"], 0)
        # a is evicted to the tier on both stages (the two share their first token, reused)
        assert _complete(url, turns["b1"]) == (plain["b1"], common_prefix(turns["a1"], turns["b1"]))
        text, cached = _complete(url, turns["a2"])  # a comes back from host memory
        assert (text, cached) == (plain["a2"], len(turns["a1"]))
        wait_for(lambda: all(metric(url, f'meshpipe_kv_tier_hits_total{{stage="{i}",tier="ram"}}') == 1
                             for i in (0, 1)), 10)
        assert metric(url, "meshpipe_kv_tier_misses_total") == 0
        stages = httpx.get(f"{url}/health").json()["stages"]  # what the page shows each stage's card
        assert [(st["kv_tier"]["hits"], st["kv_tier"]["disk_limit"]) for st in stages] == [(1, 1 << 30)] * 2
    # stopped (SIGTERM, every process): b's lane and a's were filed, and written to disk
    with _serve(cache, port) as (url, _):
        text, cached = _complete(url, turns["b2"])
        assert (text, cached) == (plain["b2"], len(turns["b1"]))
        # both stages' shares came from disk (a later stage's figures arrive with its next Status)
        wait_for(lambda: all(metric(url, f'meshpipe_kv_tier_hits_total{{stage="{i}",tier="disk"}}') == 1
                             for i in (0, 1)), 10)
        assert metric(url, "meshpipe_kv_tier_refills_total") == 0
        # a's last turn was in its lane at the stop: filed then, and trimmed into now, seeded
        assert _complete(url, turns["a2"], seed=3) == (plain["a2 seeded"], len(turns["a2"]) - 1)


@pytest.mark.mesh
def test_a_corrupt_entry_is_dropped_with_a_warning_and_prefilled_again(serve_cache, turns, plain):
    port = free_port()
    with _serve(serve_cache, port) as (url, _):
        assert _complete(url, turns["a1"])[0] == plain["a1"]
    kv = serve_cache / "kv"
    files = sorted(kv.glob("*/*/*.kv"), key=lambda p: p.stat().st_mtime)
    assert files, "the stopped server wrote its lane's sequence to disk"
    for path in files:  # every stage's copy of a's sequence, one byte flipped past the header
        data = bytearray(path.read_bytes())
        data[-100] ^= 0xFF
        path.write_bytes(bytes(data))
    with _serve(serve_cache, port) as (url, _):
        assert _complete(url, turns["a2"]) == (plain["a2"], 0)  # not served from a bad file
        assert metric(url, "meshpipe_kv_tier_refills_total") == 1
    log = Path(serve_cache).glob(f"serve-{port}.log")
    assert any("is not a whole entry" in p.read_text() for p in log)
