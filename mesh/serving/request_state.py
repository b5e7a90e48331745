"""One request's record at stage 0, and the pure transitions that move it (DESIGN.md §2).

Everything stage 0 knows of a generation lives here: the prompt, the committed output, the
drafts sent and not yet verified, and `computed`, the positions every stage's KV surely
holds. One rule feeds the pipeline: a frame feeds the sequence from what is already fed
(`computed`, when nothing is in flight), plus new drafts once only the last committed token
is left to feed. A fresh prompt, a prefix-cache hit (computed starts at the cached tokens),
a verify window and a resume on a new route (computed falls to what the new route holds)
are that one rule.

Transitions return a new record; nothing here does I/O. The driver (mesh/serving/generate.py)
sends the frames and awaits the replies; usage, /metrics and the acceptance record are read
off the record (`account`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from common.ids import LaneId
from common.sampling import EXACT, REJECTION, Proposed, Sampled, SamplingParams
from common.tokens import common_prefix
from mesh.backend import Acceptance, Account, GenerationRequest
from proto import meshpipe_pb2 as pb

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True, slots=True)
class Frame:
    """A frame sent and not yet answered, as the record counts it: it fed `rows` tokens at
    `start`, of which the last `drafts` are drafts. Row j predicts position start + j + 1."""

    start: int
    rows: int
    drafts: int
    by: str = ""  # the proposer of its drafts ("" for none)
    seconds: float = 0.0  # what proposing them cost

    @property
    def first(self) -> int:
        """The position of its first draft."""
        return self.start + self.rows - self.drafts


@dataclass(frozen=True, slots=True)
class Outgoing:
    """The next frame, the one value the record hands the pipeline (mesh/serving/pipeline.py
    `send`): `tokens` at `start`, the last `drafts` of them drafts, sampled as `sampling`
    says, with the penalty history of its first sampled row (the completion up to and
    including that row's token), in the session's `epoch`. The generate loop adds what the
    record does not hold: a grammar's `masks`, one per sampled row (stage/masks.py), and under
    rejection sampling the drafts' q (`proposed`), and how many drafts the final stage is asked
    to propose with its reply (`propose`, a proposer that runs there)."""

    start: int
    tokens: list[int]
    sampling: SamplingParams
    drafts: int = 0
    history: tuple[int, ...] = ()
    epoch: int = 0
    masks: tuple[bytes, ...] = ()
    proposed: tuple[Proposed, ...] = ()
    propose: int = 0

    @property
    def all_logits(self) -> bool:
        """A window's every row is sampled: the drafts are checked against them."""
        return self.drafts > 0

    @property
    def kind(self) -> int:
        return pb.VERIFY if self.drafts else pb.DECODE if len(self.tokens) == 1 else pb.PREFILL


@dataclass(frozen=True, slots=True)
class Reply:
    """What applying a reply did: the tokens it committed (to hand to the caller), and each
    frame it settled with the drafts of it accepted (what the window controllers learn)."""

    committed: tuple[Sampled, ...]
    settled: tuple[tuple[Frame, int], ...]


@dataclass(frozen=True, slots=True)
class RequestState:
    req: GenerationRequest
    speculative: bool = False  # a proposer runs: the account carries the acceptance record
    output: tuple[int, ...] = ()  # committed completion tokens; the last is in no KV yet
    drafts: tuple[int, ...] = ()  # sent after the output, not yet verified
    computed: int = 0  # every stage's KV surely holds positions [0, computed)
    frames: tuple[Frame, ...] = ()  # in flight, in the order sent
    epoch: int = 0  # goes up at every rejection and resume; older replies never count
    lane: LaneId | None = None
    acceptance: Acceptance = field(default_factory=Acceptance)
    cached: int = 0  # prompt tokens the first lane held already (the prefix cache)
    resumed: int = 0  # times the route broke under it and it went on
    delivered: int = 0  # output tokens handed to the caller
    finish: FinishReason | None = None
    scored: bool = False  # the prompt's own logprobs came back (asked by `req.prompt_logprobs`)

    # -- derived -------------------------------------------------------------------------

    @property
    def tokens(self) -> tuple[int, ...]:
        """The prompt and the committed output."""
        return (*self.req.prompt, *self.output)

    @property
    def sequence(self) -> tuple[int, ...]:
        """The committed tokens, then every draft sent and not yet verified."""
        return (*self.tokens, *self.drafts)

    @property
    def fed(self) -> int:
        """Positions some frame has fed: all sent while frames are out, else `computed`."""
        last = self.frames[-1] if self.frames else None
        return last.start + last.rows if last else self.computed

    @property
    def can_draft(self) -> bool:
        """The next frame may carry drafts: the first token is drawn (a prefill's reply comes
        first), and only the last committed token is left to feed."""
        return bool(self.output) and self.fed >= len(self.req.prompt) + len(self.output) - 1

    @property
    def scoring(self) -> bool:
        """The next frame scores the prompt's rows: asked, and not come back yet (a route that
        broke before it did is asked again, from position 0)."""
        return self.req.prompt_logprobs and not self.scored

    def room(self, ctx: int) -> int:
        """Drafts the next frame may carry within the context and the token budget."""
        n = len(self.req.prompt) + len(self.output) + len(self.drafts)
        return min(ctx - n, self.req.max_tokens - (n - len(self.req.prompt))) - 1

    def account(self) -> Account:
        rule = (REJECTION if self.req.sampling.rejects else EXACT) if self.speculative else ""
        return Account(len(self.req.prompt), self.delivered, self.cached, self.resumed,
                       self.acceptance if self.speculative else None, self.finish, rule=rule)

    # -- transitions ---------------------------------------------------------------------

    def leased(self, lane: LaneId, cached: int) -> RequestState:
        """On a (new) lane whose KV holds the first `cached` tokens already. A prompt to score
        is fed whole: a cached row has no logits to score."""
        cached = 0 if self.scoring else cached
        first = self.resumed == 0
        return replace(self, lane=lane, computed=cached, cached=cached if first else self.cached)

    def resume(self, rebuilt: bool = True) -> RequestState:
        """The route broke: frames and drafts are lost, and the new route holds nothing yet. Not
        `rebuilt`: a stage lost the cached tokens the KV tier was to restore, and the request
        starts over on its lane from position 0: nothing cached, unless a route break resumed it
        before (usage counts its first lease's cache)."""
        if not rebuilt:
            cached = 0 if self.resumed == 0 else self.cached
            return replace(self, frames=(), drafts=(), computed=0, cached=cached, epoch=self.epoch + 1)
        return replace(self, frames=(), drafts=(), computed=0, epoch=self.epoch + 1, resumed=self.resumed + 1)

    def send(self, drafts: Sequence[int], by: str = "", seconds: float = 0.0) -> tuple[RequestState, Outgoing]:
        """The next frame: the sequence from `fed`, then `drafts`."""
        assert self.can_draft or not drafts, "drafts before the committed tokens are fed"
        seq, start = (*self.sequence, *drafts), self.fed
        rows = len(seq) - start
        first_row = start if drafts else start + rows - 1  # the first row sampled
        history = seq[len(self.req.prompt) : first_row + 1] if self.req.sampling.penalised else ()
        frame = Frame(start, rows, len(drafts), by, seconds)
        state = replace(self, drafts=(*self.drafts, *drafts), frames=(*self.frames, frame))
        return state, Outgoing(start, list(seq[start:]), self.req.sampling, len(drafts), tuple(history), self.epoch)

    def prompt_scored(self) -> RequestState:
        return replace(self, scored=True)

    def delivered_one(self) -> RequestState:
        return replace(self, delivered=self.delivered + 1)

    def apply(self, targets: Sequence[Sampled], epoch: int) -> tuple[RequestState, Reply]:
        """The reply to the oldest frame in flight, sent in `epoch`: the target's tokens for
        its sampled rows. A reply of an older epoch (or the route before a resume) is void
        and changes nothing.

        They commit while they equal the drafts sent after them. At the first difference the
        target's token commits, every later frame is void and the epoch goes up. Under rejection
        sampling a frame whose first token is a draft answers for it itself, one token more. A window
        is a frame: its drafts and those accepted; the next frame settles here too when its
        first draft, checked by this reply's last row, was rejected."""
        if epoch != self.epoch or not self.frames:
            return self, Reply((), ())
        answered, rest = self.frames[0], self.frames[1:]
        seq = self.sequence
        predicts = answered.start + answered.rows - len(targets) + 1  # the position row 0 of targets predicts
        if self.req.sampling.rejects and rest and rest[0].drafts == rest[0].rows:
            # the next frame's first token is a draft, which rejection sampling checks in that
            # frame's reply (stage/rejection.py): this reply's last row, drawn blind to it, is not its
            # verdict
            targets = targets[:-1]
        checked = max(0, min(len(targets), len(seq) - predicts))  # targets with a draft sent after them
        n = common_prefix(list(seq[predicts:]), [s.token for s in targets])
        miss = predicts + n if n < checked else None
        settled = [(answered, _accepted(answered, miss))]
        if miss is not None and rest and rest[0].first == miss:
            settled.append((rest[0], 0))
        acceptance = self.acceptance
        for frame, accepted in settled:
            acceptance = acceptance.add(frame.drafts, accepted, frame.by)
        state = replace(self, acceptance=acceptance, frames=rest)
        if miss is not None:
            targets = targets[: n + 1]
            state = replace(state, frames=(), epoch=self.epoch + 1)
        committed = state._committed(targets)
        return state._commit(committed, len(committed) < len(targets), seq, miss is None), \
            Reply(committed, tuple(settled))

    def _committed(self, targets: Sequence[Sampled]) -> tuple[Sampled, ...]:
        """The targets that commit: up to a stop token or the length limit."""
        stops = () if self.req.ignore_eos else self.req.stop_tokens
        out: list[Sampled] = []
        for sampled in targets:
            if sampled.token in stops or len(self.output) + len(out) >= self.req.max_tokens:
                break
            out.append(sampled)
        return tuple(out)

    def _commit(self, committed: tuple[Sampled, ...], cut: bool, seq: tuple[int, ...], matched: bool
                ) -> RequestState:
        """Append `committed`; `cut`: a stop token or the length limit came before the rest."""
        output = (*self.output, *(s.token for s in committed))
        n = len(self.req.prompt) + len(output)
        finish: FinishReason | None = None
        if cut:
            finish = "length" if len(output) >= self.req.max_tokens else "stop"
        elif len(output) >= self.req.max_tokens:
            finish = "length"
        drafts = seq[n:] if matched and finish is None else ()
        frames = self.frames if finish is None else ()
        return replace(self, output=output, drafts=drafts, frames=frames, computed=max(n - 1, 0), finish=finish)


def _accepted(frame: Frame, miss: int | None) -> int:
    return frame.drafts if miss is None else max(0, min(frame.drafts, miss - frame.first))


@dataclass
class Live:
    """A generation in progress: the driver replaces `state` at every transition, and the
    caller reads its account off it at any time."""

    state: RequestState
