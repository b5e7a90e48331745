"""The prefix cache: what each free KV lane still holds on every stage (DESIGN.md §2).

A request that ends leaves its tokens in its lane, on stage 0 and on every later stage,
instead of trimming them. The next request takes the free lane whose tokens share the
longest prefix with its prompt, or else the least recently used one, and every stage trims
that lane to the match when the first frame arrives (a frame's start position is
authoritative), so only the rest of the prompt is prefilled. A chat client's next turn
resends the conversation, which is then mostly cached.

A model with recurrent layers (Mamba-2, gated delta-net, short convolutions) holds a lane's
state at one position only, the lane's own: there the cache is `exact`, and a lane matches a
prompt only when the prompt extends everything it holds (a chat's next turn), else not at all.

The cache lives with a route's pipeline: a rebuilt route starts empty, since its stages'
KV is new.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np


class PrefixCache:
    def __init__(self, exact: bool = False) -> None:
        self.exact = exact  # recurrent state: all the lane holds, or nothing
        self.held: dict[int, tuple[int, ...]] = {}  # free lane -> the tokens its KV holds everywhere
        self.used: dict[int, int] = {}  # lane -> when a request last ended on it
        self.clock = itertools.count()

    def choose(self, prompt: Sequence[int], free: Sequence[int]) -> int:
        """The free lane to serve `prompt` on: the longest match, then the least recently used."""
        return max(free, key=lambda lane: (self.match(lane, prompt), -self.used.get(lane, -1)))

    def match(self, lane: int, prompt: Sequence[int]) -> int:
        """The prompt tokens the lane holds already, leaving at least one to prefill: the first
        token comes from the logits of the prompt's last row, which must be computed."""
        held = self.held.get(lane, ())
        n = min(len(held), len(prompt) - 1)
        if n <= 0:
            return 0
        differ = np.flatnonzero(np.asarray(held[:n]) != np.asarray(prompt[:n]))
        if self.exact:
            return n if n == len(held) and not len(differ) else 0
        return int(differ[0]) if len(differ) else n

    def take(self, lane: int) -> None:
        """A request has the lane now: what it held is being replaced."""
        self.held.pop(lane, None)

    def keep(self, lane: int, tokens: Sequence[int]) -> None:
        """A request ended on the lane, whose KV holds `tokens` on every stage."""
        self.held[lane] = tuple(tokens)
        self.used[lane] = next(self.clock)
