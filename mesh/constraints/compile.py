"""A grammar built and checked off the event loop, bounded in time and size.

A `Constraint` is what a request carries to stage 0: the compiled matcher, never advanced,
which every attempt at the request copies (a resumed request starts from a fresh copy and
replays its committed output, so the grammar state is a pure function of that output).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import anyio
import llguidance

from mesh.constraints.errors import ConstraintError
from mesh.constraints.vocab import grammar_tokenizer
from mesh.model.tokenizer import Tokenizer

COMPILE_S = 10.0  # a grammar that takes longer is refused; the limits below keep most far under
# llguidance's own limits, tighter than its defaults: a request's grammar shares stage 0's CPU
def _limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(max_grammar_size=200_000, max_lexer_states=100_000,
                                     initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000, step_max_items=50_000)


@dataclass(frozen=True)
class Constraint:
    """A compiled grammar for one request: `kind` says what it came from, for logs and usage."""

    matcher: llguidance.LLMatcher  # pristine: only ever copied
    vocab: int
    kind: str

    def fresh(self) -> llguidance.LLMatcher:
        return self.matcher.deep_copy()


def build(tok: Tokenizer, grammar: str, kind: str,
          explain: Callable[[str], ConstraintError]) -> Constraint:
    """Blocking: the matcher for `grammar` on `tok`'s vocabulary, or `explain`'s error."""
    lltok = grammar_tokenizer(tok)
    limits = _limits()
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, lltok, limits=limits)
    if is_error:
        raise explain(messages[0] if messages else "the grammar is invalid")
    matcher = llguidance.LLMatcher(lltok, grammar, log_level=0, limits=limits)
    if matcher.is_error():
        raise explain(matcher.get_error())
    return Constraint(matcher, tok.n_vocab, kind)


async def compile_grammar(tok: Tokenizer, grammar: str, kind: str,
                          explain: Callable[[str], ConstraintError], param: str) -> Constraint:
    """`build` in a worker thread, refused after COMPILE_S: the event loop never waits on it."""
    with anyio.move_on_after(COMPILE_S) as scope:
        return await anyio.to_thread.run_sync(build, tok, grammar, kind, explain, abandon_on_cancel=True)
    assert scope.cancelled_caught
    raise ConstraintError(f"{param} took over {COMPILE_S:.0f}s to compile; simplify it", param)
