"""Requests against a real `mesh serve`, and what the same request gives on a reference server.

The reference is one node, no draft, no prefix cache: every request starts from an empty
lane, so its answer depends on nothing but the request. Its answers are kept by request,
so a test asks it once per distinct request however often the mesh is asked.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import httpx

from mesh.model.source import EMBEDDED_ID

# Run at mesh serve's default thread count (every core), as the meshes they are held to: with
# llama.cpp's f16 KV cache a one-row decode on 2 threads summed attention in another order than
# a verify window, and a reference parted from every mesh at a near tie on a 2,000-character
# prompt (issue 52); the project's cache computes every row alike at any thread count.
REFERENCE_ARGS = ("--no-draft", "--no-prefix-cache", "--lanes", "2")
THREADS = None  # mesh_serve's threads: the default
TIMEOUT = httpx.Timeout(300.0, connect=10.0)


@dataclass(frozen=True)
class Answer:
    """What a request came back with: its status, and for a 200 its text, finish reason,
    completion tokens (equal text and token count: the same tokens, as a client sees them) and
    each token's logprob, bit for bit."""

    status: int
    text: str = ""
    finish: str = ""
    tokens: int = 0
    error: str = ""
    logprobs: tuple[float, ...] = ()


def ask(url: str, path: str, body: dict[str, Any]) -> Answer:
    """The answer to `body`, with its tokens' logprobs asked for unless it says otherwise."""
    chat = path.endswith("chat/completions")
    body = {"logprobs": True if chat else 1, **body}
    r = httpx.post(f"{url}{path}", json={"model": EMBEDDED_ID, **body}, timeout=TIMEOUT)
    if r.status_code != 200:
        return Answer(r.status_code, error=r.text[:2000])
    return answer_of(path, r.json())


def answer_of(path: str, body: dict[str, Any]) -> Answer:
    choice = body["choices"][0]
    chat = path.endswith("chat/completions")
    text = (choice["message"]["content"] or "") if chat else choice["text"]
    logprobs = choice.get("logprobs") or {}
    values = [e["logprob"] for e in logprobs.get("content") or []] if chat else logprobs.get("token_logprobs") or []
    return Answer(200, text, choice["finish_reason"], body["usage"]["completion_tokens"], logprobs=tuple(values))


class Reference:
    """The reference server's answers, asked once per distinct request."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.known: dict[str, Answer] = {}

    def __call__(self, path: str, body: dict[str, Any]) -> Answer:
        key = path + json.dumps(body, sort_keys=True)
        if key not in self.known:
            self.known[key] = ask(self.url, path, body)
        return self.known[key]
