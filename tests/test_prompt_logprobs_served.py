"""Prompt logprobs through a real split (issue 53 item 5): `mesh serve` on two stages scores a
prompt's tokens as llama.cpp's own logits do (one unsplit context, all rows' logits, the same
KV cache type), and lm-eval's `local-completions` runs a small multiple-choice task against
it, tokenizing through the server (its `remote` backend), and scores every choice as those
logits do. The API's shape without a model: tests/test_prompt_logprobs.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import llama_cpp
import numpy as np
import pytest
from mesh_server import mesh_serve

from mesh.model.source import EMBEDDED_ID
from mesh.model.tokenizer import Tokenizer
from stage.llama_model import open_llama
from stage.sampling import log_softmax

pytestmark = pytest.mark.mesh

CTX = 512
# long enough for two of stage 0's 128-row chunks, each answered with its rows' logprobs
TEXT = " ".join(["The river rose through the night, and by morning the old bridge at the mill was gone."] * 9)
DOCS = [  # question, choices, the answer's index
    ("The capital of France is", ["Paris", "Berlin", "a sandwich"], 0),
    ("Two plus two equals", ["four", "seven", "blue"], 0),
    ("The sun rises in the", ["east", "west", "basement"], 0),
    ("Water freezes at zero degrees", ["Celsius", "Kelvin", "yesterday"], 0),
    ("A cat says", ["meow", "moo", "ribbit"], 0),
]


@pytest.fixture(scope="module")
def server(serve_cache: Path) -> Iterator[str]:
    with mesh_serve(serve_cache, "--local-stages", "2", "--no-draft", "--lanes", "2",
                    "--ctx-size", str(CTX)) as (url, _):
        yield url


@pytest.fixture(scope="module")
def tok(smollm2_gguf: Path) -> Tokenizer:
    return Tokenizer(smollm2_gguf, EMBEDDED_ID)


@pytest.fixture(scope="module")
def llama(smollm2_gguf: Path) -> Iterator[llama_cpp.Llama]:
    """The unsplit model, every row's logits kept: the reference."""
    llm = open_llama(smollm2_gguf, n_ctx=CTX, n_threads=1, logits_all=True)
    yield llm
    llm.close()


def _reference(llm: llama_cpp.Llama, tokens: list[int]) -> np.ndarray:
    """llama.cpp's log-probabilities at each row of `tokens`."""
    llm.reset()
    llm.eval(tokens)
    return log_softmax(np.asarray(llm.scores[: len(tokens)], dtype=np.float32))


def _score(url: str, prompt: list[int], logprobs: int, max_tokens: int = 0) -> dict[str, Any]:
    body = {"model": EMBEDDED_ID, "prompt": prompt, "echo": True, "logprobs": logprobs, "max_tokens": max_tokens,
            "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_a_split_scores_the_prompt_as_llama_cpp_does(server: str, llama: llama_cpp.Llama, tok: Tokenizer):
    prompt = tok.tokenize(TEXT, special=False)
    assert 128 < len(prompt) < CTX
    ref = _reference(llama, prompt)
    want = [float(ref[i, t]) for i, t in enumerate(prompt[1:])]
    httpx.post(f"{server}/v1/completions", json={"model": EMBEDDED_ID, "prompt": prompt, "max_tokens": 1},
               timeout=120).raise_for_status()  # the lane keeps the prompt now: the prefix cache holds it
    for _ in range(2):  # scored on a lane that holds it, then again
        choice = _score(server, prompt, 3)
        lp = choice["logprobs"]
        assert (choice["finish_reason"], choice["text"]) == ("length", tok.detokenize(prompt).decode())
        assert lp["token_logprobs"][0] is None
        assert lp["top_logprobs"][0] is None
        got = lp["token_logprobs"][1:]
        assert got == want, f"max difference {np.max(np.abs(np.subtract(got, want)))}"
        for i, top in enumerate(lp["top_logprobs"][1:]):
            for t in np.argpartition(-ref[i], 3)[:3]:
                assert top[tok.detokenize([int(t)]).decode(errors="replace")] == float(ref[i, t])


def test_the_completion_follows_the_scored_prompt(server: str, llama: llama_cpp.Llama, tok: Tokenizer):
    prompt = tok.tokenize("Once upon a time, in a land far away,", special=False)
    choice = _score(server, prompt, 1, max_tokens=3)
    lp = choice["logprobs"]
    ref = _reference(llama, prompt)
    assert lp["token_logprobs"][1 : len(prompt)] == [float(ref[i, t]) for i, t in enumerate(prompt[1:])]
    first = int(np.argmax(ref[-1]))  # greedy: llama.cpp's own next token
    assert lp["tokens"][len(prompt)] == tok.detokenize([first]).decode(errors="replace")
    assert lp["token_logprobs"][len(prompt)] == float(ref[-1, first])
    assert len(lp["tokens"]) == len(prompt) + 3
    assert choice["text"].startswith(tok.detokenize(prompt).decode())


def _task(tmp: Path) -> str:
    """A multiple-choice task of DOCS in lm-eval's YAML, on a local JSONL file."""
    data = tmp / "docs.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in DOCS))
    (tmp / "meshpipe_mc.yaml").write_text(
        "task: meshpipe_mc\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n")
    return "meshpipe_mc"


def test_lm_eval_scores_a_multiple_choice_task_as_llama_cpp_would(server: str, llama: llama_cpp.Llama,
                                                                   tok: Tokenizer, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    import lm_eval
    from lm_eval.tasks import TaskManager

    task = _task(tmp_path)
    out = lm_eval.simple_evaluate(
        model="local-completions", tasks=[task], task_manager=TaskManager(include_path=str(tmp_path)),
        model_args={"base_url": f"{server}/v1/completions", "model": EMBEDDED_ID, "tokenizer_backend": "remote",
                    "max_retries": 1, "max_length": CTX},
        log_samples=True)
    assert out is not None
    correct = 0
    for sample in sorted(out["samples"][task], key=lambda s: s["doc_id"]):
        question, choices, answer = DOCS[sample["doc_id"]]
        got = [float(r[0][0]) for r in sample["resps"]]
        want = [_loglikelihood(llama, tok, question, " " + c) for c in choices]
        assert got == want, f"max difference {np.max(np.abs(np.subtract(got, want)))}"
        correct += int(np.argmax(want)) == answer
    assert out["results"][task]["acc,none"] == correct / len(DOCS)


def _loglikelihood(llm: llama_cpp.Llama, tok: Tokenizer, context: str, continuation: str) -> float:
    """What a continuation scores on llama.cpp's own logits, tokenized as lm-eval does: the
    whole and the context apart (no BOS), the continuation the whole's tokens past the context's."""
    whole = tok.tokenize(context + continuation, special=True, add_bos=False)
    n = len(tok.tokenize(context, special=True, add_bos=False))
    ref = _reference(llm, whole)
    return sum(float(ref[i - 1, whole[i]]) for i in range(n, len(whole)))
