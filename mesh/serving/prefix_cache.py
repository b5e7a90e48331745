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
KV is new. With a KV tier (`index`, mesh/serving/kv_index.py) a lane's sequence is not lost
when another request takes the lane: the stages file it, and a later request that extends it
more than any free lane does has it loaded into a lane (`take`'s `Begin`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from mesh.serving.kv_index import TierIndex, key_of
from stage.lane_tier import Begin

# A lane's sequence is filed in the tier when the request taking the lane would overwrite at
# least this many of its tokens: a chat's next turn, which keeps all but a few, is not a copy
# worth keeping.
EVICT_MIN = 32
# An entry is loaded only when it holds at least this many prompt tokens more than the best
# free lane: loading it files that lane's sequence, which costs about as much as prefilling
# a few tokens (SmolLM2, 1 core: 16 ms to file 700 positions, 10 ms a prompt token).
RESTORE_MIN = 8


@dataclass(frozen=True)
class Taken:
    """A lane chosen for a prompt: the prompt tokens it holds once `begin` has run on every stage."""

    lane: int
    cached: int
    begin: Begin = field(default_factory=Begin)


class PrefixCache:
    def __init__(self, exact: bool = False, index: TierIndex | None = None) -> None:
        self.exact = exact  # recurrent state: all the lane holds, or nothing
        self.held: dict[int, tuple[int, ...]] = {}  # free lane -> the tokens its KV holds everywhere
        self.used: dict[int, int] = {}  # lane -> when a request last ended on it
        self.clock = itertools.count()
        self.index = index  # what the stages' KV tiers keep, when they keep anything

    def take(self, prompt: Sequence[int], free: Sequence[int], prefer: int | None = None) -> Taken:
        """The lane to serve `prompt` on (`prefer`, when given: a resumed request's own), and
        what to do to it first: a free lane's own prefix, or, when the tier keeps more of the
        prompt, its entry loaded into the least recently used lane. Either way a lane's
        sequence that would be overwritten is filed in the tier. An entry the prompt reuses
        only part of stays in the tier too: past the match it is another conversation (two
        ledgers whose first word starts alike), which would otherwise be lost to it."""
        lane = self.choose(prompt, free) if prefer is None else prefer
        cached = self.match(lane, prompt)
        key, restored = ("", 0)
        if self.index is not None and prefer is None:
            key, restored = self.index.best(prompt, self._matched)
        begin = Begin()
        if self.index is not None and restored - cached >= RESTORE_MIN:
            lane, cached = self.choose((), free), restored
            positions = len(self.index.entries[key])
            begin = Begin(restore=key, positions=positions, keep=restored < positions)
            if not begin.keep:
                self.index.remove(key)  # it goes back into a lane, which files it again when taken
        held = self.held.pop(lane, ())
        if self.index is not None and len(held) - (0 if begin.restore else cached) >= EVICT_MIN:
            self.index.add(held)
            begin = dataclasses.replace(begin, evict=True)
        return Taken(lane, cached, begin)

    def stash_key(self, tokens: Sequence[int]) -> str:
        """The key a lane's kept tokens are filed under, should the lane be taken ("": no tier)."""
        return key_of(tokens) if self.index is not None and tokens else ""

    def close(self) -> None:
        """The route stops, and its stages file what their free lanes hold: so does the index."""
        if self.index is not None:
            for tokens in self.held.values():
                if tokens:
                    self.index.add(tokens)
            self.held.clear()
            self.index.save()

    def choose(self, prompt: Sequence[int], free: Sequence[int]) -> int:
        """The free lane to serve `prompt` on: the longest match, then the least recently used."""
        return max(free, key=lambda lane: (self.match(lane, prompt), -self.used.get(lane, -1)))

    def match(self, lane: int, prompt: Sequence[int]) -> int:
        """The prompt tokens the lane holds already, leaving at least one to prefill: the first
        token comes from the logits of the prompt's last row, which must be computed."""
        return matched(self.held.get(lane, ()), prompt, self.exact)

    @functools.cached_property
    def _matched(self) -> functools.partial[int]:
        return functools.partial(matched, exact=self.exact)

    def keep(self, lane: int, tokens: Sequence[int]) -> None:
        """A request ended on the lane, whose KV holds `tokens` on every stage."""
        self.held[lane] = tuple(tokens)
        self.used[lane] = next(self.clock)


def matched(held: Sequence[int], prompt: Sequence[int], exact: bool) -> int:
    """The prompt tokens a sequence holding `held` can reuse, leaving at least one to prefill;
    `exact` (recurrent state): all of `held`, or none."""
    n = min(len(held), len(prompt) - 1)
    if n <= 0:
        return 0
    differ = np.flatnonzero(np.asarray(held[:n]) != np.asarray(prompt[:n]))
    if exact:
        return n if n == len(held) and not len(differ) else 0
    return int(differ[0]) if len(differ) else n
