"""What the HTTP frontend needs from the mesh: tokens in, tokens out, and health.

The coordinator implements `Backend`; the OpenAI-compatible API depends on nothing else.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from config.errors import MeshpipeError
from mesh.health import Health
from mesh.tokenizer import Tokenizer

# both live with the sampler, which builds Sampled at the final stage or at stage 0 alone
from stage.sampling import Sampled, SamplingParams

__all__ = ["Backend", "GenerationRequest", "GenerationStats", "MeshUnavailableError", "RequestRejectedError", "Sampled",
           "SamplingParams"]


class MeshUnavailableError(MeshpipeError):
    """The pipeline route is broken (a stage died or refused); maps to HTTP 503."""


class RequestRejectedError(MeshpipeError):
    """The request cannot be served as asked (e.g. prompt longer than the context); HTTP 400."""


@dataclass(frozen=True)
class GenerationRequest:
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_tokens: frozenset[int] = frozenset()
    ignore_eos: bool = False


@dataclass
class GenerationStats:
    """Filled in by the backend while a generation runs; read after it ends."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str = "length"  # "stop" when a stop token ended it
    speculative: dict[str, Any] | None = None


class Backend(Protocol):
    model_id: str
    ctx_per_session: int

    def tok(self) -> Tokenizer:
        """The target's tokenizer and chat template."""
        ...

    async def health(self) -> Health: ...

    def generate(self, req: GenerationRequest, stats: GenerationStats) -> AsyncIterator[Sampled]:
        """Yield generated tokens. Closing the iterator early frees the session on every stage."""
        ...
