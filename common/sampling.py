"""What a request asks of sampling, and what one sampled token carries back.

Both sides speak these: stage 0 (mesh/) builds the parameters from the HTTP request and reads
`Sampled` off the final stage's replies; the final stage (stage/) samples with them. So they
live here, owned by neither; the sampler itself is `stage.sampling`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_LOGPROBS = 20  # OpenAI's limit on top_logprobs; bounds the reply a stage builds
EXACT, REJECTION = "exact", "rejection"  # how a verify frame accepts drafts (DESIGN.md §6)
ACCEPTANCES = (EXACT, REJECTION)
AUTO = "auto"  # a server's default rule: EXACT for a seeded request, REJECTION for an unseeded one


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # <= 0 (or >= vocab) means no limit
    seed: int = 0  # any uint64
    presence_penalty: float = 0.0  # OpenAI semantics, over the tokens generated so far
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, bias) added to the logits
    logprobs: int = -1  # -1: none; n >= 0: the sampled token's logprob and the top n
    acceptance: str = EXACT  # EXACT: drafts that equal the (seed, position) draw; REJECTION: p/q

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1

    @property
    def rejects(self) -> bool:
        """Drafts are accepted by rejection sampling: asked for, and a draw to make (greedy
        rows have one token of probability 1, where both rules agree)."""
        return self.acceptance == REJECTION and not self.greedy

    @property
    def penalised(self) -> bool:
        """Whether rows need the completion history (only then does it travel)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def problem(self, vocab: int) -> str | None:
        """None when these can be sampled from a vocabulary of `vocab`, else why not."""
        numbers = (self.temperature, self.top_p, self.presence_penalty, self.frequency_penalty)
        if not all(math.isfinite(x) for x in numbers):
            return "temperature, top_p and penalties must be finite"
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            return f"temperature {self.temperature} must be >= 0 and top_p {self.top_p} in (0, 1]"
        if not 0 <= self.seed < 1 << 64:
            return f"seed {self.seed} does not fit in 64 unsigned bits"
        if self.acceptance not in ACCEPTANCES:
            return f"acceptance {self.acceptance!r} is none of {', '.join(ACCEPTANCES)}"
        if not -1 <= self.logprobs <= MAX_LOGPROBS:
            return f"logprobs {self.logprobs} outside [-1, {MAX_LOGPROBS}]"
        for token, bias in self.logit_bias:
            if not 0 <= token < vocab or not math.isfinite(bias):
                return f"logit_bias {token}: {bias} needs a token below {vocab} and a finite bias"
        return None


@dataclass(frozen=True)
class Sampled:
    """One generated token, with the target's log-probabilities when the request asked."""

    token: int
    logprob: float | None = None  # of `token`: log_softmax after logit_bias and penalties
    top: tuple[tuple[int, float], ...] = ()  # the most likely tokens, best first


@dataclass(frozen=True)
class Proposed:
    """A drafted token and the distribution q it was drawn from: `ids` with their `weights`
    (float32 values, as the wire carries them; q is them over their sum, and zero elsewhere),
    or none for a point mass (prompt lookup, a grammar's forced token). The final stage keeps
    it with probability min(1, p/q) under REJECTION (stage/rejection.py)."""

    token: int
    ids: tuple[int, ...] = ()
    weights: tuple[float, ...] = ()

    def probs(self) -> tuple[float, ...]:
        """q at `ids`, computed alike on both sides: the draft draws from exactly this."""
        total = math.fsum(self.weights)
        return tuple(w / total for w in self.weights)

    def q(self) -> float:
        """q of the drafted token itself."""
        if not self.ids:
            return 1.0
        return self.probs()[self.ids.index(self.token)] if self.token in self.ids else 0.0
