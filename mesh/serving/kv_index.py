"""The coordinator's index of the KV tier (DESIGN.md §2, "KV tier"; issue 57): which token
sequences the stages keep beyond their lanes, each under a key that every stage files it by.

The stages hold the bytes, each of its own layers; this holds the tokens, so a new request can
be matched against every kept sequence as it is against the free lanes (`PrefixCache`). A key
is a hash of the tokens, so one sequence is one entry wherever it was filed from.

The index is a hint, never trusted blindly: a stage may have dropped an entry (its own bounds,
a restart without its disk, a corrupt file), and then the request that asked for it is
prefilled again from position 0 (`Requests._attempt`). It keeps at most `most` entries,
dropping the least recently used; the stages' bounds usually drop entries first.

With a path it survives a restart: read when the server starts, written when it stops, in
one JSON file named for the package, beside the stages' own disk tier.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

log = logging.getLogger("meshpipe.kv_tier")

MOST = 4096  # entries; each costs its tokens here, a few KB
Match = Callable[[Sequence[int], Sequence[int]], int]  # tokens held, prompt -> tokens reused
# Entries are found by the chained hashes of their first tokens in blocks of BLOCK: an entry
# that shares less than a block with a prompt could not be worth loading (RESTORE_MIN, which
# equals it). Matching every entry instead took 0.17 s of the event loop a request at MOST.
BLOCK = 8
CANDIDATES = 32  # entries matched token by token at most, the most recently filed first


def chained(tokens: Sequence[int]) -> list[int]:
    """The hash of each whole block of `tokens` chained with every block before it."""
    hashes, h = [], 0
    for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
        h = hash((h, tuple(tokens[start : start + BLOCK])))
        hashes.append(h)
    return hashes


def key_of(tokens: Sequence[int]) -> str:
    """The key every stage files `tokens`' sequence under."""
    return hashlib.sha256(np.asarray(tokens, dtype=np.int32).tobytes()).hexdigest()[:32]


class TierIndex:
    def __init__(self, path: Path | None = None, most: int = MOST) -> None:
        self.path, self.most = path, most
        self.entries: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self.blocks: dict[int, dict[str, None]] = {}  # chained block hash -> entries holding it, in order filed
        if path is not None:
            self._read(path)

    def add(self, tokens: Sequence[int]) -> str:
        """A sequence the stages filed (or are filing) under its key."""
        key = key_of(tokens)
        self.remove(key)
        self.entries[key] = tuple(tokens)
        for h in chained(tokens):
            self.blocks.setdefault(h, {})[key] = None
        while len(self.entries) > self.most:
            self.remove(next(iter(self.entries)))
        return key

    def remove(self, key: str) -> None:
        tokens = self.entries.pop(key, None)
        for h in chained(tokens or ()):
            holders = self.blocks[h]
            del holders[key]
            if not holders:
                del self.blocks[h]

    def best(self, prompt: Sequence[int], match: Match) -> tuple[str, int]:
        """The entry holding most of `prompt` by `match` (key, tokens matched); ("", 0) if none.
        Those sharing the most blocks with it are matched first; an exact `match` (recurrent
        state: a whole entry or nothing) may find its entry among those sharing fewer."""
        levels = []
        for h in chained(prompt):
            if (holders := self.blocks.get(h)) is None:
                break
            levels.append(holders)
        best, tried = ("", 0), 0
        for depth in range(len(levels) - 1, -1, -1):
            deeper = levels[depth + 1] if depth + 1 < len(levels) else {}  # tried already
            for key in reversed([k for k in levels[depth] if k not in deeper][-CANDIDATES:]):
                n = match(self.entries[key], prompt)
                tried += 1
                if n > best[1]:
                    best = (key, n)
            if best[1] or tried >= CANDIDATES:
                return best
        return best

    def save(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps({"entries": [list(t) for t in self.entries.values()]}))
            os.replace(tmp, self.path)
        except OSError as exc:
            log.warning("kv tier: could not write its index %s (%s)", self.path, exc)

    def _read(self, path: Path) -> None:
        with contextlib.suppress(FileNotFoundError):
            try:
                entries = json.loads(path.read_text())["entries"]
                for tokens in entries:
                    self.add([int(t) for t in tokens])
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("kv tier: its index %s is unreadable (%s): starting empty", path, exc)
                self.entries.clear()
                return
            log.info("kv tier: %d kept sequences from %s", len(self.entries), path)
