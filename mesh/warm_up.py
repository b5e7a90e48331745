"""One generation at start-up, before the API answers, when a cost-aware window will choose.

The controller learns what a draft step, a plain decode and a verify frame cost on this
mesh only by timing them, and it is shared by every request (mesh/requests.py). Without a
warm-up the first users pay for that exploration: a window at the initial size, a plain
decode, a first verdict, perhaps a wrong one. Measured on SmolLM2 split-2 at 0 ms, the
first 64-token request with the draft ran at 0.80 of no-draft, later ones at 1.0. After
the warm-up the first request starts from a measured choice, as every later one does.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from mesh.backend import GenerationRequest

if TYPE_CHECKING:
    from mesh.requests import Requests
    from mesh.tokenizer import Tokenizer

TOKENS = 48  # enough for a window, a plain decode, and a few frames of whatever it then chose
PROMPT = "Describe, step by step, how a lighthouse keeper prepares the lamp for a stormy night."


async def warm_up(requests: Requests, tokenizer: Tokenizer) -> str:
    """Generate TOKENS greedily; what the controllers chose, to say at start-up."""
    text = tokenizer.render_chat([{"role": "user", "content": PROMPT}])
    began = time.perf_counter()
    generation = requests.generate(GenerationRequest(tokenizer.tokenize(text), TOKENS, ignore_eos=True))
    try:
        async for _ in generation:
            pass
    finally:
        await generation.aclose()
    chose = "; ".join(f"{name}: {choice.why}" for name, choice in requests.choices()) or "no choice yet"
    return f"warmed up in {time.perf_counter() - began:.1f}s ({TOKENS} tokens): {chose}"
