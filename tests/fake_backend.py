"""A Backend for API-level unit tests: the tiny byte-vocabulary GGUF's tokenizer, scripted tokens.

Token b + 3 is the byte b (tests/models.py `write_tiny_llama(byte_vocab=True)`), so a script
is just text. Nothing is loaded beyond the vocabulary, which takes milliseconds.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from mesh.backend import GenerationRequest, GenerationStats, Sampled
from mesh.health import Health
from mesh.tokenizer import Tokenizer

BYTE0 = 3  # the first byte token
EOS = 2


def byte_tokens(text: str | bytes) -> list[int]:
    data = text.encode() if isinstance(text, str) else text
    return [b + BYTE0 for b in data]


class FakeBackend:
    model_id = "tiny"
    ctx_per_session = 256

    def __init__(self, tok: Tokenizer, script: str | bytes = "Hello world", eos: bool = True,
                 fail: Callable[[], BaseException] | None = None, fail_after: int = 0) -> None:
        self._tok, self.eos = tok, eos
        self.script = byte_tokens(script)
        self.fail, self.fail_after = fail, fail_after
        self.requests: list[GenerationRequest] = []
        self.closed = 0  # generators closed (finished or abandoned)
        self.healthy = Health(ok=True, model=self.model_id, route="none", stages=(), error=None,
                              speculative="off")

    def tok(self) -> Tokenizer:
        return self._tok

    async def health(self) -> Health:
        return self.healthy

    async def generate(self, req: GenerationRequest, stats: GenerationStats) -> AsyncIterator[Sampled]:
        self.requests.append(req)
        stats.prompt_tokens = len(req.prompt)
        tokens = [*self.script, *([EOS] if self.eos else [])]
        try:
            for i, token in enumerate(tokens):
                if self.fail is not None and i == self.fail_after:
                    raise self.fail()
                if stats.completion_tokens >= req.max_tokens:
                    return
                if token in req.stop_tokens and not req.ignore_eos:
                    stats.finish_reason = "stop"
                    return
                stats.completion_tokens += 1
                if req.sampling.logprobs >= 0:
                    top = tuple((token + j, -0.5 - j) for j in range(req.sampling.logprobs))
                    yield Sampled(token, -0.5, top)
                else:
                    yield Sampled(token)
        finally:
            self.closed += 1
