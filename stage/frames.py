"""What a frame says besides its tensor: how the final stage samples it, and what it replies.

Stage 0 builds a compute frame (`compute_frame`) with its sampling (`FrameSampling.to_wire`);
the final stage reads that back (`sampling_of`), checks it, and answers with the sampled
tokens (`reply_frame`) or an ERROR (`error_frame`), which stage 0 reads (`sampled_of`).
The final stage may be stage 0 itself: it answers the same frame the same way. DESIGN.md §4
lists the fields.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from common.ids import FrameId, LaneId, SessionId
from common.sampling import EXACT, REJECTION, Proposed, Sampled, SamplingParams
from proto import meshpipe_pb2 as pb
from stage.masks import masks_problem


@dataclass(frozen=True)
class FrameSampling:
    """What the final stage needs to sample a frame: the parameters and the penalty history."""

    params: SamplingParams
    history: tuple[int, ...] = ()  # row i of the logits counts history + drafts[:i]
    drafts: tuple[int, ...] = ()
    masks: tuple[bytes, ...] = ()  # per sampled row, a grammar's allowed tokens (stage/masks.py)
    proposed: tuple[Proposed, ...] = ()  # REJECTION: every draft fed, with its q
    checks_first: bool = False  # REJECTION: the first fed token is a draft the row before predicted
    targets: tuple[int, ...] = ()  # scored rows: the first len(targets) rows report these tokens' logprobs

    @property
    def scored(self) -> int:
        return len(self.targets)

    @classmethod
    def for_rows(cls, params: SamplingParams, history: Sequence[int], tokens: Sequence[int],
                 rows: int, masks: Sequence[bytes] = (), proposed: Sequence[Proposed] = ()) -> FrameSampling:
        """A frame feeding `tokens` whose last `rows` rows are sampled; `history` is the
        completion the penalties count at the first sampled row (fed tokens[-rows]), that
        row's token included. Each later row adds the token fed before it. `proposed`: the
        drafts fed, the last of `tokens`, with the q each came from (REJECTION only)."""
        drafted = tuple(proposed) if params.rejects else ()
        checks = bool(drafted) and len(drafted) == len(tokens)
        if not params.penalised:
            return cls(params, masks=tuple(masks), proposed=drafted, checks_first=checks)
        return cls(params, tuple(history), tuple(tokens[len(tokens) - rows + 1 :]), tuple(masks), drafted, checks)

    def to_wire(self) -> pb.Sampling:
        p = self.params
        wire = pb.Sampling(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, seed=p.seed,
                           presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                           logit_bias=[pb.LogitBias(token=t, bias=b) for t, b in p.logit_bias])
        if p.logprobs >= 0:
            wire.logprobs = p.logprobs
        if p.penalised:  # the history costs bytes on every frame: only when it counts
            wire.history.extend(self.history)
            wire.drafts.extend(self.drafts)
        wire.masks.extend(self.masks)
        wire.targets.extend(self.targets)
        if p.acceptance == REJECTION:
            wire.rejection = True
            wire.checks_first = self.checks_first
            wire.proposed.extend(pb.Proposed(token=d.token, ids=d.ids, weights=d.weights) for d in self.proposed)
        return wire

    def problem(self, vocab: int, ctx: int, rows: int) -> str | None:
        """None when a frame with `rows` logits rows can be sampled like this, else why not.
        Scored rows come first; the rows after them are sampled."""
        if (problem := self.params.problem(vocab)) is not None:
            return problem
        if (problem := self._targets_problem(vocab, rows)) is not None:
            return problem
        rows -= self.scored
        if len(self.history) + len(self.drafts) > ctx or len(self.drafts) >= max(rows, 1):
            return (f"penalty history of {len(self.history)} + {len(self.drafts)} drafts does not fit "
                    f"{rows} logits rows in a context of {ctx}")
        if any(not 0 <= t < vocab for t in (*self.history, *self.drafts)):
            return f"penalty history holds a token outside the vocabulary of {vocab}"
        return masks_problem(self.masks, vocab, rows) or self._proposed_problem(vocab, rows)

    def _targets_problem(self, vocab: int, rows: int) -> str | None:
        if not self.targets:
            return None
        if self.params.logprobs < 0:
            return "scored rows report logprobs: a frame with targets must ask for them"
        if self.scored > rows:
            return f"{self.scored} scored rows in a frame of {rows} logits rows"
        if self.drafts or self.proposed or self.checks_first:
            return "a frame that scores rows carries no drafts"  # only a prompt's rows are scored
        if any(not 0 <= t < vocab for t in self.targets):
            return f"a scored row's target is outside the vocabulary of {vocab}"
        return None

    def _proposed_problem(self, vocab: int, rows: int) -> str | None:
        if not self.params.rejects:
            return "drafts with their q come with rejection sampling only" if self.proposed else None
        if len(self.proposed) != rows - 1 + self.checks_first:
            return f"{len(self.proposed)} drafts with their q for {rows} logits rows"
        for d in self.proposed:
            ids = (d.token, *d.ids)
            if len(d.ids) != len(d.weights) or any(not 0 <= t < vocab for t in ids):
                return f"a draft's q names tokens outside the vocabulary of {vocab}, or unweighted"
            if d.weights and not (all(math.isfinite(w) and w >= 0 for w in d.weights) and sum(d.weights) > 0):
                return "a draft's q has a weight that is negative or not finite, or none above 0"
        return None


def sampling_of(header: pb.FrameHeader) -> FrameSampling:
    s = header.sampling
    params = SamplingParams(s.temperature, s.top_p or 1.0, s.top_k, s.seed, s.presence_penalty, s.frequency_penalty,
                            tuple((b.token, b.bias) for b in s.logit_bias),
                            s.logprobs if s.HasField("logprobs") else -1, REJECTION if s.rejection else EXACT)
    proposed = tuple(Proposed(d.token, tuple(d.ids), tuple(d.weights)) for d in s.proposed)
    return FrameSampling(params, tuple(s.history), tuple(s.drafts), tuple(s.masks), proposed, s.checks_first,
                         tuple(s.targets))


def input_rows(h: pb.FrameHeader) -> int:
    """Rows the frame feeds: hidden-state rows, or token ids at a first stage."""
    return int(h.shape[0]) if len(h.shape) else len(h.tokens)


@dataclass(frozen=True)
class Asks:
    """What a frame that wants a reply asks for: its kind, how its rows are sampled, and
    whether every row's logits are (a verify window's, a scored prompt's)."""

    kind: int
    sampling: FrameSampling
    all_logits: bool = False


def compute_frame(session: SessionId, frame: FrameId, lane: LaneId, start: int, epoch: int,
                  asks: Asks | None = None) -> pb.FrameHeader:
    """The header of a compute frame as stage 0 sends it. Only a frame that `asks` wants a
    reply: the earlier chunks of a long input go on as PREFILL, unanswered."""
    if asks is None:
        return pb.FrameHeader(session_id=session, frame_id=frame, kind=pb.PREFILL, start_pos=start, epoch=epoch,
                              lane=lane)
    return pb.FrameHeader(session_id=session, frame_id=frame, kind=asks.kind,  # type: ignore[arg-type]
                          start_pos=start, epoch=epoch, lane=lane, want_reply=True, all_logits=asks.all_logits,
                          sampling=asks.sampling.to_wire())


def reply_frame(h: pb.FrameHeader, picks: list[Sampled], hop: pb.Hop) -> pb.FrameHeader:
    """The final stage's answer to frame `h`: its tokens (a scored row's first, as its target
    with its logprob), and every hop's timings with its own last."""
    reply = pb.FrameHeader(session_id=h.session_id, frame_id=h.frame_id, kind=pb.REPLY,
                           start_pos=h.start_pos, epoch=h.epoch)
    add_sampled(reply, picks)
    reply.timings.CopyFrom(h.timings)
    reply.timings.hops.append(hop)
    return reply


def error_frame(h: pb.FrameHeader, message: str) -> pb.FrameHeader:
    """A stage's answer to frame `h` when it cannot run or sample it: the request fails, the route stays."""
    return pb.FrameHeader(session_id=h.session_id, frame_id=h.frame_id, kind=pb.ERROR, message=message,
                          epoch=h.epoch)


def add_sampled(reply: pb.FrameHeader, picks: list[Sampled]) -> None:
    reply.tokens.extend(p.token for p in picks)
    if picks and picks[0].logprob is not None:
        reply.logprobs.extend(p.logprob or 0.0 for p in picks)
        reply.top.extend(pb.TopLogprobs(tokens=[t for t, _ in p.top], logprobs=[lp for _, lp in p.top])
                         for p in picks)


@dataclass(frozen=True)
class Offered:
    """Drafts a final stage proposed with its reply (its MTP layer's, stage/mtp_drafts.py): the
    first for position `at`, each with its q under rejection sampling, and what drafting them
    took that stage."""

    at: int
    drafts: tuple[Proposed, ...]
    seconds: float


def offered_of(reply: pb.FrameHeader) -> Offered | None:
    """The drafts a reply carries, if any."""
    if not reply.proposals:
        return None
    drafts = tuple(Proposed(d.token, tuple(d.ids), tuple(d.weights)) for d in reply.proposals)
    return Offered(reply.proposed_at, drafts, reply.propose_us / 1e6)


def sampled_of(reply: pb.FrameHeader) -> list[Sampled]:
    """The reply's tokens with their logprobs, when the frame asked for them."""
    if not reply.logprobs:
        return [Sampled(t) for t in reply.tokens]
    if not len(reply.logprobs) == len(reply.top) == len(reply.tokens):
        raise ValueError("a reply's logprobs do not match its tokens")
    return [Sampled(t, lp, tuple(zip(top.tokens, top.logprobs, strict=True)))
            for t, lp, top in zip(reply.tokens, reply.logprobs, reply.top, strict=True)]
