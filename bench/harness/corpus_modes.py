"""What the corpus scenario and the guard share (neither scenario imports the other): the
servers the corpus runs, each request's max_tokens, how the requests are measured, and what a
request's figure reads."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from bench.harness.client import StreamTiming, stream_messages
from bench.harness.corpus import CorpusRequest
from bench.harness.harness import Setup
from mesh.model.tokenizer import Tokenizer

# mode -> serve() keywords; "none" first: every other mode is measured against it. Forced
# tokens are on unless --no-forced-drafts: without it "none" would speculate on every schema.
MODES: dict[str, dict[str, Any]] = {"none": {"extra": ("--no-forced-drafts",)}, "ngram": {"strategy": "ngram"},
                                    "defaults": {"strategy": "auto"}, "draft": {"draft": True}}
Timings = dict[tuple[str, str], list[StreamTiming]]  # (mode, request name) -> one a repeat
REWRITE_MARGIN = 64  # a rewrite's reply: its source's tokens, and room for a fence and a sentence around them


def whole(t: StreamTiming) -> float:
    """The whole request as its client waited for it: sent to the last chunk."""
    return t.arrivals[-1]


def allowances(setup: Setup, requests: list[CorpusRequest]) -> dict[str, int]:
    """Each request's max_tokens: --tokens, or a rewrite's source and REWRITE_MARGIN where more."""
    tokenizer = Tokenizer(setup.gguf, setup.model_id)
    return {r.name: max(setup.tokens, len(tokenizer.tokenize(r.source, special=False, add_bos=False)) + REWRITE_MARGIN)
            if r.source else setup.tokens for r in requests}


def measure(setup: Setup, urls: dict[str, str], requests: list[CorpusRequest], repeats: int) -> Timings:
    """Every request on every server, request after request; which server goes first rotates
    with each request, so drift falls on every mode alike. A first short request to each server
    pays for its lazy loading."""
    for url in urls.values():
        stream_messages(url, setup.model_id, [{"role": "user", "content": "Hello"}], 2)
    limits = allowances(setup, requests)
    timings: Timings = defaultdict(list)
    modes = list(urls)
    for rep in range(repeats):
        for i, request in enumerate(requests):
            turn = (rep + i) % len(modes)  # a repeat moves each request's order on by one too
            for mode in modes[turn:] + modes[:turn]:
                timings[(mode, request.name)].append(stream_messages(
                    urls[mode], setup.model_id, request.messages, limits[request.name], ignore_eos=False,
                    sampling=request.body))
    return timings
