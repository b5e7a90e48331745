"""The model's own multi-token-prediction layer, drafting at the final stage (DESIGN.md §6, issue 56).

The final stage holds the trunk's last layers and the head, so it has what an MTP ("nextn")
layer reads: the trunk's last hidden state at position p - 1 and the token at p. llama.cpp
runs that layer in a second context on the same model (`LLAMA_CONTEXT_TYPE_MTP`), whose KV
holds only the MTP layer's attention. Two things happen here, both on the engine thread:

- **Feeding** (`feed`), after every decode of a session's rows: the MTP context sees the same
  positions as the target, each token paired with the target's hidden row one position before
  (the row before a step's first is kept from the step before; zeros at position 0, as
  llama.cpp's own MTP drafting does). Its KV is trimmed to the step's start first, as every
  stage's is: the frame's start is authoritative, so a rejection rolls it back too.
- **Drafting** (`draft`): from the token the target committed last at position P and its
  hidden row at P - 1, each step decodes one row and reads the MTP layer's logits and its own
  output row, which the next step pairs with the token just drafted.

Drafts only decide what gets verified; the target's own rows decide every token, so nothing
here can change the output, only how much of it a frame commits.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import llama_cpp.llama_cpp_ext as ext
import numpy as np
from llama_cpp import llama_cpp as L

from common.errors import EngineError
from common.sampling import Proposed
from stage.engine import Step

# Draws a draft token from the MTP layer's logits for a position, with the q it came from
# (a point mass for a greedy pick).
Choose = Callable[[np.ndarray, int], Proposed]


@dataclass
class _Rows:
    """A lane's last step: its tokens and the target's hidden rows at positions [start, start +
    len(rows)), and the row just before them (None where none was kept)."""

    start: int
    tokens: np.ndarray
    rows: np.ndarray
    before: np.ndarray | None

    def at(self, position: int) -> np.ndarray | None:
        if self.start <= position < self.start + len(self.rows):
            return self.rows[position - self.start]
        return self.before if position == self.start - 1 else None


@dataclass
class _Chain:
    """A lane's last drafts, made after `token` at `start` for positions start + 1 on: the step
    at start + j fed the token there with `rows[j]` (the target's row before `start`, then each
    step's own output) and drafted `drafts[j]`; `h` is the last step's output, what a step after
    it pairs with the last draft."""

    start: int
    token: int
    drafts: list[Proposed]
    rows: list[np.ndarray]
    h: np.ndarray

    @property
    def end(self) -> int:
        """The position a step after the chain feeds: its last draft's."""
        return self.start + len(self.drafts)

    def fed(self, j: int) -> int:
        """The token the chain's step j fed."""
        return self.token if j == 0 else self.drafts[j - 1].token

    def after(self, position: int, token: int) -> _Chain | None:
        """The chain from `position` on, if `token` there is the one it started from or drafted."""
        i = position - self.start
        if not 0 <= i <= len(self.drafts) or self.fed(i) != token:
            return None
        return _Chain(position, token, self.drafts[i:], self.rows[i:], self.h)


def _ahead(kept: _Rows, position: int, token: int) -> bool:
    """Whether the lane's last step is a frame sent ahead of drafts made after `token` at
    `position`: it starts there with that token, or past it (a void frame does not)."""
    return kept.start > position or (kept.start == position and int(kept.tokens[0]) == token)


def open_head(model: ctypes.c_void_p | None, target: ctypes.c_void_p, params: L.llama_context_params,
              n_vocab: int) -> MtpHead | None:
    """The MTP context beside the `target` context (made with `params`, which it copies but for
    its type), and the target's hidden rows kept for it: every row's, not only those with
    logits (llama.cpp's unmasked nextn embeddings). None for a model loaded without MTP layers
    (a stage GGUF prepared without them): the stage serves, drafting nothing."""
    assert model is not None
    if L.llama_model_n_layer_nextn(model) < 1:
        return None
    head = MtpHead(model, params, L.llama_model_n_embd(model), n_vocab)
    ext.llama_set_embeddings_nextn(target, True, False)
    return head


class MtpHead:
    """The MTP context of a final stage's model, one KV stream per lane."""

    def __init__(self, model: ctypes.c_void_p, params: L.llama_context_params, width: int, n_vocab: int) -> None:
        """`params`: the target context's, which the MTP context copies but for its type."""
        self.layers = int(L.llama_model_n_layer_nextn(model))
        self.width, self.n_vocab, self.lanes = width, n_vocab, int(params.n_seq_max)
        self.batch_rows = int(params.n_batch)
        params.ctx_type = L.LLAMA_CONTEXT_TYPE_MTP
        self.ctx: ctypes.c_void_p | None = L.llama_init_from_model(model, params)
        if not self.ctx:
            raise EngineError("llama.cpp could not create the MTP context")
        self.mem = L.llama_get_memory(self.ctx)
        ext.llama_set_embeddings_nextn(self.ctx, True, True)  # its own output row, for the next step
        self.held: list[_Rows | None] = [None] * self.lanes
        self.chains: list[_Chain | None] = [None] * self.lanes
        self.zeros = np.zeros(width, dtype=np.float32)

    def feed_steps(self, steps: Sequence[Step], hidden: Sequence[Sequence[np.ndarray]], first: bool) -> None:
        """The target ran `steps` (`first`: on token input), making `hidden`'s rows for each in
        pieces: every step whose tokens are known (its own, or a later stage's `fed`) is fed."""
        for s, rows in zip(steps, hidden, strict=True):
            tokens = s.tokens if first else s.fed
            if tokens is not None and len(tokens) == s.n:
                self.feed(s.lane, s.start, tokens, rows[0] if len(rows) == 1 else np.concatenate(rows))

    def feed(self, lane: int, start: int, tokens: np.ndarray, hidden: np.ndarray) -> None:
        """The target decoded `tokens` at `start` on `lane`, with `hidden` its rows' states: the
        MTP context takes the same positions. A lane whose MTP KV ends before `start` (its rows
        were never fed: a frame without tokens) cannot be fed past the gap; it drafts nothing
        until a frame reaches back to what it holds."""
        kept = self.held[lane]
        before = kept.at(start - 1) if kept is not None else None
        self.held[lane] = _Rows(start, tokens, hidden, before)
        if start > self._end(lane):
            return
        L.llama_memory_seq_rm(self.mem, lane, start, -1)
        pairs = [before if before is not None else self.zeros, *hidden[:-1]]
        for first in range(0, len(tokens), self.batch_rows):
            last = min(first + self.batch_rows, len(tokens))
            self._process(lane, start + first, tokens[first:last], pairs[first:last], output=False)

    def draft(self, lane: int, position: int, token: int, k: int, choose: Choose) -> list[Proposed]:
        """Up to `k` drafts for positions `position` + 1 on, after `token` at `position`; none
        where the lane has not been fed up to `position`. What the lane's last chain drafted past
        that point, where it had drafted `token` there, is kept rather than made again: with
        frames in flight each reply then drafts one window more, not every window out.
        A frame sent ahead may have been fed past the steps' positions already (its step ran
        before this reply's drafting): its rows are fed again after, which the steps overwrote."""
        kept, end, last = self.held[lane], self._end(lane), self.chains[lane]
        chain = last.after(position, token) if last is not None else None
        if chain is not None and position <= end:
            if len(chain.drafts) >= k:
                return chain.drafts[:k]
            self._restore(lane, chain, end)
        else:
            h = kept.at(position - 1) if kept is not None else None
            if h is None or k < 1 or position > end:
                return []
            chain = _Chain(position, token, [], [], h)
        more = self._chain(lane, chain, k - len(chain.drafts), choose)
        self.chains[lane] = chain
        if kept is not None and _ahead(kept, position, token) and kept.start >= more and end > kept.start:
            L.llama_memory_seq_rm(self.mem, lane, kept.start, -1)
            self.feed(lane, kept.start, kept.tokens, kept.rows)
        return chain.drafts

    def _restore(self, lane: int, chain: _Chain, end: int) -> None:
        """The chain's steps past `end` (a frame fed since cut them off), made again in one
        decode from what they fed: the drafts stand, and a step after them needs their KV."""
        first = max(end, chain.start) - chain.start
        if first < len(chain.drafts):
            tokens = np.asarray([chain.fed(j) for j in range(first, len(chain.drafts))])
            L.llama_memory_seq_rm(self.mem, lane, chain.start + first, -1)
            self._process(lane, chain.start + first, tokens, chain.rows[first:], output=False)

    def _chain(self, lane: int, chain: _Chain, k: int, choose: Choose) -> int:
        """`k` steps more on `chain`, each one row: the token drafted last with the layer's own
        output row. Returns the position of the first."""
        position = chain.end
        L.llama_memory_seq_rm(self.mem, lane, position, -1)  # rows fed past it were not committed
        for _ in range(k):
            token, h = chain.fed(len(chain.drafts)), chain.h
            self._process(lane, chain.end, np.asarray([token]), [h], output=True)
            logits = np.ctypeslib.as_array(L.llama_get_logits_ith(self.ctx, -1), shape=(self.n_vocab,)).copy()
            row = ext.llama_get_embeddings_nextn_ith(self.ctx, -1)
            chain.rows.append(h)
            chain.h = np.ctypeslib.as_array(row, shape=(self.width,)).copy()
            chain.drafts.append(choose(logits, chain.end + 1))
        return position

    def trim(self, lane: int, position: int) -> None:
        L.llama_memory_seq_rm(self.mem, lane, max(position, 0), -1)
        self.chains[lane] = None  # an END, or a lane emptied: the next request's drafts are its own
        if position <= 0:
            self.held[lane] = None

    def _end(self, lane: int) -> int:
        """The next position the lane's MTP KV can take: llama.cpp keeps a sequence's
        positions consecutive."""
        return int(L.llama_memory_seq_pos_max(self.mem, lane)) + 1

    def _process(self, lane: int, start: int, tokens: np.ndarray, rows: list[np.ndarray], output: bool) -> None:
        batch = L.llama_batch_ext_init(self.ctx)
        try:
            rows = [np.ascontiguousarray(r, dtype=np.float32) for r in rows]  # alive until processed
            for i, token in enumerate(tokens):
                idx = L.llama_batch_ext_add_token(batch, lane, int(token))
                if idx < 0:
                    raise EngineError(f"the MTP batch refused a token ({idx})")
                pos = ctypes.c_int32(start + i)
                L.llama_batch_ext_set_pos(batch, idx, ctypes.byref(pos))
                data = rows[i].ctypes.data_as(ctypes.POINTER(ctypes.c_float))
                if not L.llama_batch_ext_set_embd_token(batch, idx, L.llama_embd(data, 1, self.width)):
                    raise EngineError("the MTP batch refused a hidden row")
                L.llama_batch_ext_set_output_logits(batch, idx, output and i == len(tokens) - 1)
            rc = L.llama_process(self.ctx, L.LLAMA_PROCESS_TYPE_DECODE, batch)
        finally:
            L.llama_batch_ext_free(batch)
        if rc != 0:
            raise EngineError(f"the MTP layer's decode failed with code {rc}")

    def close(self) -> None:
        if self.ctx:
            L.llama_free(self.ctx)
            self.ctx = None
