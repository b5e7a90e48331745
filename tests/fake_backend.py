"""A Backend for API-level unit tests: the tiny byte-vocabulary GGUF's tokenizer, scripted tokens.

Token b + 3 is the byte b (tests/models.py `write_tiny_llama(byte_vocab=True)`), so a script
is just text. Nothing is loaded beyond the vocabulary, which takes milliseconds.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from dataclasses import replace

from common.sampling import Sampled
from mesh.backend import Acceptance, Account, Generation, GenerationEvent, GenerationRequest
from mesh.model.tokenizer import Tokenizer
from mesh.reports.health import Health

BYTE0 = 3  # the first byte token
EOS = 2


def byte_tokens(text: str | bytes) -> list[int]:
    data = text.encode() if isinstance(text, str) else text
    return [b + BYTE0 for b in data]


class FakeBackend:
    model_id = "tiny"
    ctx_per_session = 256
    speculative_acceptance = "auto"

    def __init__(self, tok: Tokenizer, script: str | bytes = "Hello world", eos: bool = True,
                 fail: Callable[[], BaseException] | None = None, fail_after: int = 0, window: int = 0) -> None:
        self._tok, self.eos = tok, eos
        self.window = window  # > 0: a draft proposes this many before each token and one is accepted
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

    def generate(self, req: GenerationRequest) -> Generation:
        self.requests.append(req)
        account = [Account(len(req.prompt), 0, speculative=Acceptance() if self.window else None)]
        return Generation(self._events(req, account), lambda: account[0])

    async def _events(self, req: GenerationRequest, account: list[Account]) -> AsyncGenerator[GenerationEvent, None]:
        """The script's tokens; `account[0]` is the record a real backend keeps at stage 0."""
        tokens = [*self.script, *([EOS] if self.eos else [])]
        try:
            for i, token in enumerate(tokens):
                if self.fail is not None and i == self.fail_after:
                    raise self.fail()
                a = account[0]
                if a.completion_tokens >= req.max_tokens:
                    break
                if token in req.stop_tokens and not req.ignore_eos:
                    account[0] = replace(a, finish_reason="stop")
                    return
                spec = a.speculative.add(self.window, 1, "draft") if a.speculative is not None else None
                account[0] = replace(a, completion_tokens=a.completion_tokens + 1, speculative=spec)
                yield self._sampled(token, req)
            account[0] = replace(account[0], finish_reason="length")
        finally:
            self.closed += 1

    @staticmethod
    def _sampled(token: int, req: GenerationRequest) -> Sampled:
        if req.sampling.logprobs < 0:
            return Sampled(token)
        return Sampled(token, -0.5, tuple((token + j, -0.5 - j) for j in range(req.sampling.logprobs)))
