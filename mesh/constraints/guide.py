"""One request's grammar state at stage 0: the matcher, kept equal to a completion prefix.

The state is a pure function of the tokens consumed, so the guide is moved by naming the
completion it should stand at (`sync`): it rolls back to what that shares with what it has
consumed and consumes the rest. A rejected window, a void frame in flight and a resume are
all one `sync` to the committed output; windows still in flight need nothing, their masks
left with them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import llguidance

from mesh.constraints.compile import Constraint


class GrammarViolationError(RuntimeError):
    """A token the grammar refuses reached the committed output: a bug, never the model's doing."""


class Guide:
    def __init__(self, constraint: Constraint) -> None:
        self.matcher: llguidance.LLMatcher = constraint.fresh()
        self.vocab = constraint.vocab
        self.words = (constraint.vocab + 31) // 32  # the mask's 32-bit words on the wire
        self.consumed: list[int] = []
        self.mask_s = 0.0  # time spent computing masks: the bench's cost per token

    def sync(self, completion: Sequence[int]) -> None:
        """Stand at `completion`: roll back past where it differs, consume what is new."""
        keep = _shared(self.consumed, completion)
        if keep < len(self.consumed):
            self.matcher.rollback(len(self.consumed) - keep)
            del self.consumed[keep:]
        for token in completion[keep:]:
            self.push(token)

    def push(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise GrammarViolationError(f"token {token} after {len(self.consumed)} tokens: "
                                        f"{self.matcher.get_error()}")
        self.consumed.append(token)

    def pop(self, n: int) -> None:
        if n:
            self.matcher.rollback(n)
            del self.consumed[-n:]

    def mask(self) -> bytes:
        """The allowed next tokens: one bit per token of the vocabulary, little-endian 32-bit words."""
        began = time.perf_counter()
        bits = self.matcher.compute_bitmask()[: self.words * 4]
        self.mask_s += time.perf_counter() - began
        return bits

    def row_masks(self, completion: Sequence[int], later: Sequence[int]) -> list[bytes]:
        """The masks of a frame's sampled rows: the first row follows `completion`, each later
        row the token before it in `later` too. The guide is left after all of `later`."""
        self.sync(completion)
        masks = [self.mask()]
        for token in later:
            self.push(token)
            masks.append(self.mask())
        return masks

    def legal(self, tokens: Sequence[int]) -> int:
        """How many leading `tokens` the grammar allows from here (a lookup is cut there)."""
        return int(self.matcher.validate_tokens(list(tokens)))

    @property
    def done(self) -> bool:
        """The grammar is complete: only an end token may follow."""
        return bool(self.matcher.is_stopped())

    def forced(self, limit: int) -> list[int]:
        """Up to `limit` tokens the grammar allows as the only continuation from here."""
        if limit < 1 or self.matcher.is_stopped():
            return []
        return list(self.matcher.compute_ff_tokens())[:limit]


def _shared(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def frame_masks(guide: Guide, sequence: Sequence[int], prompt: int, start: int, tokens: Sequence[int],
                drafts: int) -> list[bytes]:
    """The masks of a frame feeding `tokens` at `start` of `sequence` (the prompt's `prompt`
    tokens, then the completion): every row when it carries drafts (row j predicts position
    start + j + 1), else its last row only."""
    if drafts:
        return guide.row_masks(sequence[prompt : start + 1], tokens[1:])
    return guide.row_masks(sequence[prompt : start + len(tokens)], ())
