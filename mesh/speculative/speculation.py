"""Speculation on stage 0: the plan `mesh serve` settled on, the draft it loads, and the
proposer requests read (mesh/serving/requests.py).

The plan changes at most once, at start: a draft that cannot be had (not found, unreadable,
another vocabulary) is dropped loudly, and the mesh serves on with prompt lookup alone where
the plan has it, else without speculation. Nothing else writes these fields.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from common.sampling import EXACT
from mesh.speculative.draft import Draft, draft_path, vocab_mismatch
from mesh.speculative.mtp import MtpProposer
from mesh.speculative.ngram import NgramProposer
from mesh.speculative.plan import SpecPlan
from mesh.speculative.proposer import Combined, Proposer

if TYPE_CHECKING:
    from mesh.model.tokenizer import Tokenizer

log = logging.getLogger("meshpipe.speculation")


@dataclass(frozen=True)
class DraftRoom:
    """What a draft is opened with on stage 0's machine: its lanes and context are the
    target's, its threads stage 0's."""

    lanes: int
    ctx_size: int
    threads: int
    cpu_lock: Path | None


class Speculation:
    """The plan (None: off, `note` says why; or served without its draft, `note` says why), the
    draft loaded for it, and the proposer."""

    def __init__(self, spec: SpecPlan | None, note: str, say: Callable[[str], None]) -> None:
        self.spec, self.note, self.say = spec, note, say
        self.draft: Draft | None = None
        self.proposer: Proposer | None = None  # the draft, prompt lookup, or both (DESIGN.md §6)

    def describe(self) -> str:
        if self.spec is None:
            return self.note
        return f"{self.note}; {self.spec.describe()}" if self.note else self.spec.describe()

    @property
    def acceptance(self) -> str:
        """The plan's rule; without speculation every draw is the exact-match one."""
        return self.spec.acceptance if self.spec is not None else EXACT

    @property
    def draft_busy_s(self) -> float:
        return self.draft.busy_s if self.draft is not None else 0.0

    async def load(self, package_dir: Path, tokenizer: Tokenizer, room: DraftRoom) -> None:
        """Load the planned draft; on any problem serve on without it, loudly: with prompt
        lookup alone where the plan has it, else without speculation."""
        if self.spec is None:
            self.say(f"speculative: {self.note}")
            return
        ngram = self.spec.ngram
        lookup = NgramProposer(ngram.ngram_min, ngram.ngram_max) if ngram else None
        if self.spec.mtp is not None:  # the final stage's MTP layers draft: nothing to load here
            self.proposer = Combined(lookup, MtpProposer()) if lookup else MtpProposer()
            self.say(f"speculative: {self.spec.describe()}")
            return
        if self.spec.draft_model is None:  # prompt lookup alone: no draft is loaded or downloaded
            self.proposer = lookup
            self.say(f"speculative: {self.spec.describe()}")
            return
        try:
            gguf = await asyncio.to_thread(draft_path, self.spec, package_dir)
            draft = await asyncio.to_thread(Draft, gguf, room.lanes, room.ctx_size, room.threads, room.cpu_lock)
        except Exception as exc:  # noqa: BLE001 -- whatever broke the draft, serve on without it
            return self._without_draft(f"draft {self.spec.draft_model} unavailable: {exc}")
        mismatch = vocab_mismatch(tokenizer, draft.engine)
        if mismatch:
            await draft.stop()
            return self._without_draft(f"draft {self.spec.draft_model} refused: {mismatch}")
        draft.start()
        self.draft = draft
        self.proposer = Combined(lookup, draft) if lookup else draft
        self.say(f"speculative: {self.spec.describe()}")

    def _without_draft(self, reason: str) -> None:
        if self.spec is not None and self.spec.ngram is not None:  # prompt lookup needs no draft
            ngram = self.spec.ngram
            self.spec = replace(self.spec, draft_model=None, strategy=None, window=ngram.window)
            self.proposer = NgramProposer(ngram.ngram_min, ngram.ngram_max)
            self.note = f"prompt lookup alone, {reason}"
            log.warning("draft disabled: %s; serving with prompt lookup alone", reason)
            self.say(f"WARNING: draft disabled: {reason}; speculative: {self.spec.describe()}")
            return
        self.spec, self.note = None, f"off: {reason}"
        log.warning("speculative decoding disabled: %s; serving without it", reason)
        self.say(f"WARNING: speculative decoding disabled: {reason}")

    async def stop(self) -> None:
        if self.draft is not None:
            await self.draft.stop()
