"""One streamed chat request, timed token by token, as an API client sees it."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx

from mesh.api.responses import ChatCompletionChunk, SpeculativeUsage, Usage


@dataclass(frozen=True)
class StreamTiming:
    ttft: float  # request sent -> first token chunk
    arrivals: tuple[float, ...]  # seconds since the request, one per content chunk
    completion_tokens: int
    speculative: SpeculativeUsage | None = field(default=None)

    @property
    def decode_tps(self) -> float:
        """Tokens after the first, over the time between first and last chunk."""
        span = self.arrivals[-1] - self.arrivals[0] if len(self.arrivals) > 1 else 0.0
        return (self.completion_tokens - 1) / span if span > 0 else 0.0

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False)]


def stream_chat(url: str, model: str, prompt: str, max_tokens: int) -> StreamTiming:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "stream": True,
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    arrivals: list[float] = []
    usage: Usage | None = None
    start = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = _chunk(line[6:])
            usage = chunk.usage or usage
            if any(c.delta.content for c in chunk.choices):
                arrivals.append(time.perf_counter() - start)
    if not arrivals:
        raise RuntimeError("the server streamed no tokens")
    return StreamTiming(arrivals[0], tuple(arrivals), usage.completion_tokens if usage else len(arrivals),
                        usage.speculative if usage else None)


def _chunk(data: str) -> ChatCompletionChunk:
    """One SSE chunk; an error event (OpenAI's error body, not a chunk) raises."""
    raw = json.loads(data)
    if "error" in raw:
        raise RuntimeError(f"server error mid-stream: {raw['error']['message']}")
    return ChatCompletionChunk.model_validate(raw)
