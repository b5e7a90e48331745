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

# at the mesh's own --threads (mesh_serve's 1): llama.cpp's sums depend on the thread count,
# and a reference on 2 threads parted from every mesh at a near tie on a 2,000-character prompt
REFERENCE_ARGS = ("--no-draft", "--no-prefix-cache", "--lanes", "2")
TIMEOUT = httpx.Timeout(300.0, connect=10.0)


@dataclass(frozen=True)
class Answer:
    """What a request came back with: its status, and for a 200 its text, finish reason and
    completion tokens (equal text and token count: the same tokens, as a client sees them)."""

    status: int
    text: str = ""
    finish: str = ""
    tokens: int = 0
    error: str = ""


def ask(url: str, path: str, body: dict[str, Any]) -> Answer:
    r = httpx.post(f"{url}{path}", json={"model": EMBEDDED_ID, **body}, timeout=TIMEOUT)
    if r.status_code != 200:
        return Answer(r.status_code, error=r.text[:2000])
    return answer_of(path, r.json())


def answer_of(path: str, body: dict[str, Any]) -> Answer:
    choice = body["choices"][0]
    text = (choice["message"]["content"] or "") if path.endswith("chat/completions") else choice["text"]
    return Answer(200, text, choice["finish_reason"], body["usage"]["completion_tokens"])


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
