"""`mesh serve --strategy mtp`: the model's own MTP layers draft at the final stage of a split (issue 56).

Real `mesh serve` processes on tiny models with a nextn layer (tests/tiny_models.py), packaged
from the GGUF as a user's would be, split in two with one `mesh stage` daemon that every test
shares (`--peer`), and in three with local stages; the real openai client asks. The output
must be plain decoding's, greedy and seeded, at the default thread count and past 512 KV
cells: the reference is the same model on one node with no speculation, through the request
path in-process (tests/inproc_requests.py). A random MTP layer is rejected nearly always (the
rollback path); an agreeing one (tests/mtp_models.py) is accepted whole, which shows its
drafts crossed the wire.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import inproc_requests
import openai
import pytest
from inproc_requests import served_tokens
from mesh_server import mesh_serve, running_stage
from mtp_models import agreeing
from tiny_models import write_tiny

from common.sampling import SamplingParams
from mesh.backend import GenerationRequest
from mesh.model.tokenizer import TextStream, Tokenizer

pytestmark = pytest.mark.mesh

TOKEN = "mtp-token"
PROMPT = "The quick brown fox jumps over the lazy dog, and then"
LONG = " ".join(["a fox and a dog ran by the river"] * 10)  # about 510 tokens: past 512 cells with its answer
CTX = 768
N = 24
SEED, TEMPERATURE = 5, 0.9


@pytest.fixture(autouse=True)
def long_lanes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inproc_requests, "CTX", CTX)


@pytest.fixture(scope="module")
def stage(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with running_stage(tmp_path_factory.mktemp("mtp-stage"), TOKEN, "--lanes", "4") as at:
        yield at


def _text(gguf: Path, tokens: list[int]) -> str:
    stream = TextStream(Tokenizer(gguf, gguf.stem))
    return "".join(stream.push(t) for t in tokens) + stream.flush()


def _plain(gguf: Path, cache: Path, prompt: str, sampling: SamplingParams) -> str:
    """What plain decoding on one node gives, through the request path in-process (its lanes
    as long as the server's)."""
    tok = Tokenizer(gguf, gguf.stem)
    req = GenerationRequest(tok.tokenize(prompt, special=False), N, sampling, stop_tokens=tok.eos_tokens())
    [tokens] = asyncio.run(served_tokens(gguf, None, cache, [req]))
    return _text(gguf, tokens)


def _serve_and_compare(gguf: Path, cache: Path, prompt: str, *args: str) -> list[dict[str, int]]:
    """Greedy and seeded completions through `mesh serve --strategy mtp ARGS`, each equal to plain
    decoding's; for each, the MTP proposer's windows, drafts and accepted drafts as usage counted them."""
    greedy = _plain(gguf, cache, prompt, SamplingParams())
    seeded = _plain(gguf, cache, prompt, SamplingParams(temperature=TEMPERATURE, seed=SEED))
    counted = []
    (cache / "serve").mkdir()
    with mesh_serve(cache / "serve", "--model", str(gguf), "--strategy", "mtp", "--lanes", "2", "--ctx-size", str(CTX),
                    *args, env={"MESHPIPE_TOKEN": TOKEN}, threads=None) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        for want, extra in ((greedy, {"temperature": 0}), (seeded, {"temperature": TEMPERATURE, "seed": SEED})):
            got = client.completions.create(model=gguf.stem, prompt=prompt, max_tokens=N, **extra)
            assert got.choices[0].text == want
            assert got.usage is not None
            assert got.usage.model_extra is not None
            counted.append(got.usage.model_extra["speculative"]["by_proposer"]["mtp"])
    log = next((cache / "serve").glob("serve-*.log")).read_text()
    assert "speculative: mtp (the model's 1 MTP layer(s) at the final stage)" in log
    return counted


@pytest.mark.parametrize("arch", ["deepseek2", "qwen35", "glm4moe"])
def test_mtp_drafts_at_the_final_stage_leave_output_as_plain_decoding_gives_it(
        arch: str, stage: str, tmp_path: Path) -> None:
    """Split in two for deepseek2 (MLA, MoE) and qwen35 (hybrid, recurrent); glm4moe runs MTP on one
    stage only (packages.architectures.MTP_FROM_LAYER_0), so it serves on one node."""
    gguf = write_tiny(tmp_path / f"{arch}.gguf", arch)
    peer = ("--peer", stage, "--advertise", "127.0.0.1", "--artifact-listen", "127.0.0.1:0")
    split = peer if arch != "glm4moe" else ()
    counted = _serve_and_compare(gguf, tmp_path, LONG, "--draft-window", "3", *split)
    assert all(c["windows"] > 0 for c in counted)  # the final stage drafted, and they were verified


def test_an_agreeing_mtp_layer_split_in_three_is_accepted_whole(tmp_path: Path) -> None:
    gguf = agreeing(write_tiny(tmp_path / "deepseek2.gguf", "deepseek2"), tmp_path / "deepseek2-agreeing.gguf")
    # a fixed window, as above: what a request's ledger would allow 24 tokens of a tiny model is
    # not what this test is about (mesh/speculative/ledger.py)
    greedy, _ = _serve_and_compare(gguf, tmp_path, PROMPT, "--local-stages", "3", "--draft-window", "3")
    assert greedy["accepted"] == greedy["proposed"] >= N // 2  # drafts crossed two links and stood
