"""A hybrid model served across real processes, speculating: lanes roll back by checkpoint (issue 43).

A tiny random-weight `qwen35` (gated delta-net layers, attention every 4th; 12 layers, so a
split in three is allowed) and a pure recurrent `mamba2`, each in Q4_0, whose k-row decode
equals k single-row decodes on every kind of layer (DESIGN.md §3, "Recurrent state"), served
by real `mesh serve` processes with
their `mesh stage` children and the real openai client. Every output is compared with the
same model on one node without a draft:

- split-3 with a Q8_0 draft of the same weights (rejected now and then, so every stage
  restores and replays) and 3 frames in flight, and with the target drafting for itself (never
  rejected) one frame at a time: greedy and seeded-sampled output, token for token;
- four sessions at once, each with its own rejections, as each alone;
- a stream whose middle stage is killed part way resumes on a rebuilt route, identically.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from mesh_server import mesh_serve
from tiny_models import write_tiny

from bench.harness.local_server import stage_pids
from packages.requantize import requantize

pytestmark = pytest.mark.mesh

PROMPTS = ["The quick brown fox", "Once upon a time", "In a hole in the ground", "It was a bright cold day"]
SEEDED = {"temperature": 0.9, "seed": 11}
TOKENS = 32
COMMON = ("--lanes", "4", "--ctx-size", "256")


@pytest.fixture(scope="module", params=["qwen35", "mamba2"])
def models(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(target, draft): the model in Q4_0, and the same weights in Q8_0, which part from it now and then."""
    root = tmp_path_factory.mktemp(request.param)
    gguf = write_tiny(root / f"{request.param}.gguf", request.param, layers=12)
    return requantize(gguf, root / "q4_0.gguf", "Q4_0"), requantize(gguf, root / "q8_0.gguf", "Q8_0")


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def _complete(url: str, model: str, prompt: str, sampling: dict | None = None) -> tuple[str, dict]:
    """The text of one completion, and its usage as the server sent it."""
    reply = _client(url).completions.create(model=model, prompt=prompt, max_tokens=TOKENS,
                                            extra_body={"ignore_eos": True}, **(sampling or {"temperature": 0}))
    assert reply.usage is not None
    return reply.choices[0].text, reply.usage.model_dump()


def _chat(url: str, model: str, prompt: str, **kwargs: Any) -> Any:
    return _client(url).chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                max_tokens=TOKENS, temperature=0, extra_body={"ignore_eos": True},
                                                **kwargs)


def _outputs(url: str, model: str) -> list[str]:
    return [_complete(url, model, p, s)[0] for p in PROMPTS[:2] for s in (None, SEEDED)]


@contextlib.contextmanager
def _serving(tmp: Path, target: Path, *args: str) -> Iterator[tuple[str, int]]:
    (tmp / "cache").mkdir(exist_ok=True)
    with mesh_serve(tmp / "cache", "--model", str(target), *COMMON, *args) as (url, proc):
        yield url, proc.pid


@pytest.fixture(scope="module")
def plain(models: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """One node, no draft: each prompt's greedy and seeded outputs, and each prompt's greedy alone."""
    target, _ = models
    with _serving(tmp_path_factory.mktemp("plain"), target, "--no-draft") as (url, _):
        out = dict(zip(("greedy-0", "seeded-0", "greedy-1", "seeded-1"), _outputs(url, target.stem), strict=True))
        out |= {f"prompt-{i}": _complete(url, target.stem, p)[0] for i, p in enumerate(PROMPTS)}
        out["chat"] = _chat(url, target.stem, PROMPTS[2]).choices[0].message.content
        return out


@pytest.fixture(scope="module")
def split3(models: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    """Split in three, the Q8_0 draft, 3 frames in flight: shared by the tests that need rejections."""
    target, draft = models
    with _serving(tmp_path_factory.mktemp("split3"), target, "--local-stages", "3", "--draft", str(draft),
                  "--draft-window", "3", "--frames-in-flight", "3") as served:
        yield served


def test_a_rejected_draft_with_frames_in_flight_gives_plain_output(split3: tuple[str, int], models, plain) -> None:
    url, _ = split3
    target = models[0].stem
    assert _outputs(url, target) == [plain[k] for k in ("greedy-0", "seeded-0", "greedy-1", "seeded-1")]
    spec = _complete(url, target, PROMPTS[0])[1]["speculative"]
    assert spec["accepted"] < spec["proposed"]  # rejected: every stage rolled back by checkpoint


def test_a_never_rejected_self_draft_one_frame_at_a_time_gives_plain_output(models, plain, tmp_path: Path) -> None:
    target, _ = models
    with _serving(tmp_path, target, "--local-stages", "3", "--draft", str(target), "--draft-window", "3",
                  "--frames-in-flight", "1") as (url, _):
        assert _outputs(url, target.stem) == [plain[k] for k in ("greedy-0", "seeded-0", "greedy-1", "seeded-1")]
        spec = _complete(url, target.stem, PROMPTS[1])[1]["speculative"]
        assert spec["accepted"] == spec["proposed"] > 0
    log = next((tmp_path / "cache").glob("serve-*.log")).read_text()
    assert "recurrent state rolls back by checkpoint (6 a lane): at most 5 frames in flight" in log


def test_four_sessions_at_once_complete_as_each_alone(split3: tuple[str, int], models, plain) -> None:
    url, _ = split3
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(lambda p: _complete(url, models[0].stem, p)[0], PROMPTS))
    assert texts == [plain[f"prompt-{i}"] for i in range(len(PROMPTS))]


def test_a_stream_resumes_identically_after_its_middle_stage_is_killed(split3: tuple[str, int], models, plain) -> None:
    """Last: it leaves the shared mesh on a rebuilt route."""
    url, pid = split3
    middle = stage_pids(pid)[0]
    stream = _chat(url, models[0].stem, PROMPTS[2], stream=True, stream_options={"include_usage": True})
    text, usage = "", dict[str, Any]()
    for n, chunk in enumerate(stream, 1):
        if n == 5:
            os.kill(middle, signal.SIGKILL)
        text += "".join(c.delta.content or "" for c in chunk.choices)
        usage = chunk.usage.model_dump() if chunk.usage is not None else usage
    assert usage["resumed"] == 1
    assert text == plain["chat"]
    assert middle not in stage_pids(pid)
