"""What the corpus scenario and the guard share (neither scenario imports the other): the
servers the corpus runs, each request's max_tokens, and what a request's figure reads."""

from __future__ import annotations

from typing import Any

from bench.harness.client import StreamTiming
from bench.harness.corpus import CorpusRequest
from bench.harness.harness import Setup
from mesh.model.tokenizer import Tokenizer

# mode -> serve() keywords; "none" first: every other mode is measured against it. Forced
# tokens are on unless --no-forced-drafts: without it "none" would speculate on every schema.
MODES: dict[str, dict[str, Any]] = {"none": {"extra": ("--no-forced-drafts",)}, "ngram": {"strategy": "ngram"},
                                    "defaults": {"strategy": "auto"}, "draft": {"draft": True}}
REWRITE_MARGIN = 64  # a rewrite's reply: its source's tokens, and room for a fence and a sentence around them


def whole(t: StreamTiming) -> float:
    """The whole request as its client waited for it: sent to the last chunk."""
    return t.arrivals[-1]


def allowances(setup: Setup, requests: list[CorpusRequest]) -> dict[str, int]:
    """Each request's max_tokens: --tokens, or a rewrite's source and REWRITE_MARGIN where more."""
    tokenizer = Tokenizer(setup.gguf, setup.model_id)
    return {r.name: max(setup.tokens, len(tokenizer.tokenize(r.source, special=False, add_bos=False)) + REWRITE_MARGIN)
            if r.source else setup.tokens for r in requests}
