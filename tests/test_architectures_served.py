"""`mesh serve --model` serves every proven architecture split in two, with its draft (issue 40).

For each architecture of `packages.architectures.RULES`, a real `mesh serve` process on the
tiny model (Q4_0, tests/tiny_models.py), split in two with one `mesh stage` daemon that every
family's coordinator shares (`--peer`), and a Q8_0 draft of the same weights answers the real
openai client: a chat completion, and a text completion whose
greedy text equals the unsplit model's through llama-cpp-python, token for token. A
family whose graph cannot be cut serves on one node, and a split of it is refused with the reason.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from mesh_server import free_port, mesh_serve, running_stage
from tiny_models import write_tiny

from mesh.model.tokenizer import TextStream, Tokenizer
from packages.architectures import ONE_NODE_STATEFUL, RULES
from packages.requantize import requantize
from stage.llama_model import open_llama

pytestmark = pytest.mark.mesh

TOKEN = "architectures-token"
PROMPT = "The quick brown fox jumps over the lazy dog, and then"
N = 16


def _models(root: Path, arch: str) -> tuple[Path, Path]:
    gguf = write_tiny(root / f"{arch}.gguf", arch)
    return requantize(gguf, root / f"{arch}-q4_0.gguf", "Q4_0"), requantize(gguf, root / f"{arch}-q8_0.gguf", "Q8_0")


def _unsplit_text(gguf: Path) -> str:
    """The unsplit model's greedy text; random byte tokens make invalid UTF-8, which the
    server's text stream replaces as it goes, so it turns these tokens into text too."""
    llm = open_llama(gguf, n_ctx=256, n_threads=1)
    stream, text, n = TextStream(Tokenizer(gguf, gguf.stem)), "", 0
    for token in llm.generate(llm.tokenize(PROMPT.encode()), temp=0.0, top_k=1, reset=True):
        if llm.token_eos() == token or n == N:
            break
        text, n = text + stream.push(token), n + 1
    return text + stream.flush()


@pytest.fixture(scope="module")
def stage(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The `mesh stage` daemon every family's coordinator splits its model with (the
    coordinator runs stage 0): it holds the ranges of many models, so a family's test pays for
    its coordinator only, not for starting a stage."""
    with running_stage(tmp_path_factory.mktemp("architecture-stage"), TOKEN, "--lanes", "4") as at:
        yield at


@pytest.mark.parametrize("arch", sorted(RULES))
def test_served_split_in_two_with_a_draft(arch: str, stage: str, tmp_path: Path) -> None:
    target, draft = _models(tmp_path, arch)
    expected = _unsplit_text(target)
    args = ("--model", str(target), "--draft", str(draft), "--draft-window", "3", "--peer", stage, "--advertise",
            "127.0.0.1", "--artifact-listen", "127.0.0.1:0", "--lanes", "2", "--ctx-size", "256")
    (tmp_path / "cache").mkdir()
    with mesh_serve(tmp_path / "cache", *args, env={"MESHPIPE_TOKEN": TOKEN}) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        chat = client.chat.completions.create(model=target.stem, messages=[{"role": "user", "content": "Hello there"}],
                                              max_tokens=N, temperature=0)
        assert chat.choices[0].finish_reason in ("stop", "length")
        assert chat.usage is not None
        assert chat.usage.completion_tokens > 0
        text = client.completions.create(model=target.stem, prompt=PROMPT, max_tokens=N, temperature=0)
        assert text.choices[0].text == expected
    log = next((tmp_path / "cache").glob("serve-*.log")).read_text()
    assert f"model {target.stem}: {arch}: may be split at" in log


def test_a_family_that_cannot_be_cut_serves_on_one_node_and_refuses_two(tmp_path: Path) -> None:
    gguf = write_tiny(tmp_path / "talkie.gguf", "talkie")
    done = subprocess.run(
        [sys.executable, "-m", "mesh.cli", "serve", "--model", str(gguf), "--local-stages", "2", "--no-draft",
         "--threads", "1", "--listen", f"127.0.0.1:{free_port()}"],
        env={**os.environ, "MESHPIPE_CACHE": str(tmp_path / "refused")}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    error = done.stderr.strip().splitlines()[-1]
    assert error.startswith("mesh serve: error: cannot split talkie (talkie) across 2 stages: every layer adds "
                            "the normalized token embeddings"), error
    (tmp_path / "cache").mkdir()
    with mesh_serve(tmp_path / "cache", "--model", str(gguf), "--no-draft") as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        chat = client.chat.completions.create(model="talkie", messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=4, temperature=0)
        assert chat.choices[0].finish_reason in ("stop", "length")


def test_a_recurrent_family_that_cannot_be_cut_serves_on_one_node_with_a_draft(tmp_path: Path) -> None:
    """rwkv7 (architectures.ONE_NODE_STATEFUL): one stage, its recurrent state rolled back by checkpoint
    where the draft's windows are rejected, and the unsplit model's greedy text."""
    target, draft = _models(tmp_path, "rwkv7")
    expected = _unsplit_text(target)
    (tmp_path / "cache").mkdir()
    args = ("--model", str(target), "--draft", str(draft), "--draft-window", "3", "--lanes", "2", "--ctx-size", "256")
    with mesh_serve(tmp_path / "cache", *args) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        text = client.completions.create(model=target.stem, prompt=PROMPT, max_tokens=N, temperature=0)
        assert text.choices[0].text == expected
    log = next((tmp_path / "cache").glob("serve-*.log")).read_text()
    assert f"model {target.stem}: rwkv7: not split ({ONE_NODE_STATEFUL['rwkv7']})" in log
    assert "recurrent state rolls back by checkpoint" in log
