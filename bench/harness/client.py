"""One streamed chat request, timed token by token, as an API client sees it."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from mesh.api.responses import ChatCompletionChunk, ChatDelta, SpeculativeUsage, Usage
from mesh.cli.bearer import auth_headers
from mesh.reports.health import Health


@dataclass(frozen=True)
class StreamTiming:
    ttft: float  # request sent -> first token chunk
    arrivals: tuple[float, ...]  # seconds since the request, one per content chunk
    completion_tokens: int
    speculative: SpeculativeUsage | None = field(default=None)
    text: str = ""  # the reply, as streamed (a tool call as its name and arguments)
    usage: dict[str, Any] = field(default_factory=dict)  # as sent: fields newer than this client's Usage too

    @property
    def decode_tps(self) -> float:
        """Tokens after the first, over the time between first and last chunk."""
        span = self.arrivals[-1] - self.arrivals[0] if len(self.arrivals) > 1 else 0.0
        return (self.completion_tokens - 1) / span if span > 0 else 0.0

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False)]

    @property
    def cached_tokens(self) -> int | None:
        """Prompt tokens the server reused (OpenAI's `prompt_tokens_details.cached_tokens`), when it says."""
        details = self.usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens")
        return int(cached) if cached is not None else None

    @property
    def by_proposer(self) -> dict[str, dict[str, float]]:
        """`usage.speculative.by_proposer` as sent: per proposer, its counters; {} when absent."""
        spec = self.usage.get("speculative") or {}
        return {name: {k: float(v) for k, v in counts.items() if isinstance(v, int | float)}
                for name, counts in (spec.get("by_proposer") or {}).items() if isinstance(counts, dict)}


def stream_chat(url: str, model: str, prompt: str, max_tokens: int) -> StreamTiming:
    return stream_messages(url, model, [{"role": "user", "content": prompt}], max_tokens)


def stream_messages(url: str, model: str, messages: list[dict[str, str]], max_tokens: int,
                    ignore_eos: bool = True, sampling: dict[str, Any] | None = None) -> StreamTiming:
    """Greedy unless `sampling` says otherwise (with a seed, every run draws the same tokens;
    it may hold any other body field, `response_format`, `tools`).
    EOS is ignored unless asked, so every run decodes the same number of tokens."""
    body = {"model": model, "messages": messages, "stream": True, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": ignore_eos, "stream_options": {"include_usage": True}, **(sampling or {})}
    arrivals: list[float] = []
    pieces: list[str] = []
    raw_usage: dict[str, Any] = {}
    start = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600,
                      headers=auth_headers()) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            raw = _event(line[6:])
            raw_usage = raw.get("usage") or raw_usage
            content = "".join(_delta_text(c.delta) for c in ChatCompletionChunk.model_validate(raw).choices)
            if content:
                arrivals.append(time.perf_counter() - start)
                pieces.append(content)
    if not arrivals:
        raise RuntimeError("the server streamed no tokens")
    usage = Usage.model_validate(raw_usage) if raw_usage else None
    return StreamTiming(arrivals[0], tuple(arrivals), usage.completion_tokens if usage else len(arrivals),
                        usage.speculative if usage else None, "".join(pieces), raw_usage)


def _delta_text(delta: ChatDelta) -> str:
    """A chunk's text: its content, and a tool call's name and arguments as they stream (not its
    id, which differs every time), so a reply that calls a tool is timed and compared as one
    that writes text is."""
    calls = "".join(str(fn.get("name") or "") + str(fn.get("arguments") or "")
                    for fn in ((call.get("function") or {}) for call in delta.tool_calls or []))
    return (delta.content or "") + calls


def _event(data: str) -> dict[str, Any]:
    """One SSE event as JSON; an error event (OpenAI's error body, not a chunk) raises."""
    raw = json.loads(data)
    if "error" in raw:
        raise RuntimeError(f"server error mid-stream: {raw['error']['message']}")
    return dict(raw)


def mesh_cuts(url: str) -> tuple[int, ...]:
    """Where meshpipe's split cut the layers, from /health: every stage's first layer after
    stage 0's, in stage order (one cut for split-2, two for split-3)."""
    health = Health.model_validate_json(httpx.get(f"{url}/health", timeout=10, headers=auth_headers()).content)
    return cuts_of(health)


def cuts_of(health: Health) -> tuple[int, ...]:
    stages = sorted(health.stages, key=lambda s: s.stage)[1:]
    if not stages or any(s.start is None for s in stages):
        raise RuntimeError(f"the mesh reports no layer range for a stage after stage 0: route {health.route}")
    return tuple(int(s.start) for s in stages if s.start is not None)
