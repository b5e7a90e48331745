"""One generation at start-up, before the API answers, when a cost-aware window will choose.

The controller learns what a draft step, a plain decode and a verify frame cost on this
mesh only by timing them, and it is shared by every request (mesh/serving/requests.py). Without a
warm-up the first users pay for that exploration: a window at the initial size, a plain
decode, a first verdict, perhaps a wrong one: the first request ran slower than no-draft,
later ones did not (BENCHMARKS.md, "Figures behind the code's choices").
After the warm-up the first request starts from a measured choice, as every later one does.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from mesh.backend import GenerationRequest

if TYPE_CHECKING:
    from mesh.model.tokenizer import Tokenizer
    from mesh.serving.requests import Requests
    from mesh.speculative.plan import SpecPlan
    from mesh.speculative.proposer import Proposer

log = logging.getLogger("meshpipe.warm_up")

TOKENS = 48  # enough for a window, a plain decode, and a few frames of whatever it then chose
PROMPT = "Describe, step by step, how a lighthouse keeper prepares the lamp for a stormy night."


def chooses(spec: SpecPlan | None, proposer: Proposer | None) -> bool:
    """Whether a cost-aware window chooses for some proposer that was loaded."""
    if spec is None or proposer is None:
        return False
    return "cost-aware" in {spec.window.policy, spec.ngram.window.policy if spec.ngram else ""}


async def warm_up(requests: Requests, tokenizer: Tokenizer, say: Callable[[str], None]) -> None:
    """Generate TOKENS greedily and say what the controllers chose. A failure here is the
    first request's to report, not start-up's: serving goes on."""
    text = tokenizer.render_chat([{"role": "user", "content": PROMPT}])
    began = time.perf_counter()
    # its lane keeps nothing: a client's first request would find the warm-up's prompt in the
    # prefix cache and report cached tokens it never sent
    generation = requests.generate(GenerationRequest(tokenizer.tokenize(text), TOKENS, ignore_eos=True, keep=False,
                                                     explore=True))
    try:
        async for _ in generation:
            pass
    except Exception as exc:  # noqa: BLE001 -- whatever broke it, requests will meet the cause
        log.warning("warm-up failed: %s", exc)
        say(f"WARNING: warm-up failed: {exc}")
        return
    finally:
        await generation.aclose()
    chose = "; ".join(f"{name}: {choice.why}" for name, choice in requests.choices()) or "no choice yet"
    say(f"speculative: warmed up in {time.perf_counter() - began:.1f}s ({TOKENS} tokens): {chose}")
