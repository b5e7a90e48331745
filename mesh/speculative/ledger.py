"""What speculation has saved one request, and what it may still risk (issue 58).

The window controllers (window.py) choose a window from what they expect; expectations come
from other requests (the cost-aware one is shared by every session) or from a rule of thumb
(adaptive grows on every full accept), and a request whose text stops being foreseeable can
keep paying for windows that are rejected: prompt lookup lost 9% on a rewrite whose model
wandered off the source. The ledger holds each request to what its own frames did instead:

- a plain decode's price is this request's: the median gap between two plain decodes in a
  row. Until one is timed, and again every `retime_every` replies, the request decodes plainly;
- every other reply is charged: its gap since the reply before, against its committed tokens
  at that price. The balance is what speculation saved so far (negative: what it lost);
- a frame may be sent only if its worst case, every frame of the burst voided but one token,
  fits the balance plus `share` of the time since the request began. The window and the
  frames in flight shrink to what fits, to nothing when nothing does;
- savings are not there to be spent: when the last few speculative replies lost (a decayed
  account, `RECENT`), the request decodes plainly for `PAUSE` decodes, twice as many each
  time it loses again, and tries again.

So a request never loses more than `share` of its time plus what one frame overruns its
price by, whatever proposes: a request whose proposals pay earns room for larger windows and
more frames ahead, one whose proposals stop paying falls back to plain decoding within a
few frames and keeps what it saved (tests/test_ledger.py simulates both).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mesh.speculative.estimates import ROW_SHARE, Line, Median
from mesh.speculative.window import Observation

SHARE = 0.01  # of the request's time speculation may lose, beside one frame's misjudgement
RETIME_EVERY = 64  # replies between two timings of a plain decode
RECENT = 0.5  # what a reply's saving weighs in the recent account after the next one
PAUSE = 4  # plain decodes a request waits after its recent replies lost, doubling while they do


@dataclass
class Ledger:
    """One request's account (the module docstring): `started` on the loop's clock."""

    started: float
    share: float = SHARE
    retime_every: int = RETIME_EVERY
    balance: float = 0.0  # seconds speculation saved against plain decoding
    plain: Median = field(default_factory=Median)  # this request's plain decode, reply to reply
    compute: Median = field(default_factory=Median)  # every stage's service time for a plain decode
    lone: Line = field(default_factory=Line)  # a lone frame's reply gap by rows, plain decodes as 1
    depth: int = 1  # the frames in flight `allowed_depth` last allowed
    replies: int = 0  # since a plain decode was last timed
    recent: float = 0.0  # the last few replies' savings, the latest weighing most
    pause: int = 0  # plain decodes left before proposing again
    wait: int = PAUSE  # the next pause's length
    advanced: float = 0.0  # a catch-up's credit, for the next speculative reply (`_advance`)

    @property
    def priced(self) -> bool:
        """A plain decode is timed and not due again, and no pause is on."""
        return self.plain.known and self.replies < self.retime_every and self.pause <= 0

    def heard(self, seen: Observation) -> None:
        """A settled decode frame, when it is the first its reply settled (`seen.since`): a
        plain decode after another prices the next ones; any other reply is charged to the
        balance, and one sent alone after another of its kind times a lone frame of its rows."""
        since = seen.since
        if seen.proposed == 0:
            self.pause -= 1
        if since is None:
            return
        if seen.proposed == 0 and seen.rows == 1 and since.in_step:
            self.plain.add(since.seconds)
            self.lone.add(1, since.seconds)
            if seen.stage0_s is not None:
                self.compute.add(seen.stage0_s + sum(seen.later_s))
            self.replies = 0
            return
        self.replies += 1
        if since.in_step and since.alone:
            self.lone.add(seen.rows, since.seconds)
        if self.plain.known:
            self._charge(seen.tokens * self.plain.value - since.seconds, speculative=seen.proposed > 0)

    def _charge(self, saved: float, speculative: bool) -> None:
        """A reply's saving. The balance bounds the loss; the recent account stops a request
        from spending what it saved where its proposals stopped paying: when the last few
        speculative replies lost, it decodes plainly for a pause that doubles each time."""
        if speculative:
            saved, self.advanced = saved + self.advanced, 0.0
        self.balance += saved
        if not speculative:
            return
        self.recent = self.recent * RECENT + saved
        if self.recent >= 0:
            self.wait = PAUSE
        elif self.pause <= 0:
            self.pause, self.wait, self.recent = self.wait, self.wait * 2, 0.0

    def budget(self, now: float) -> float:
        """What the next burst may lose: the savings so far and `share` of the request's time."""
        return self.balance + self.share * max(now - self.started, 0.0)

    def risk(self, window: int, depth: int) -> float:
        """A burst's worst case: `depth` frames of `window` drafts, all but one token voided.
        The first costs its round trip; each voided behind it the stages' compute for its
        rows, which the next frame waits out (its time on the links overlapped the first's)."""
        return self._frame(window + 1) + (depth - 1) * self._compute(window + 1) - self.plain.value

    def allowed_depth(self, asked: int, now: float) -> int:
        """The frames in flight, up to `asked`, whose burst of one-draft frames fits the budget."""
        budget = self.budget(now)
        self.depth = max([d for d in range(1, asked + 1) if self.risk(1, d) <= budget], default=1)
        return self.depth

    def allowed_window(self, asked: int, now: float, catch_up: int = 0, prospect: float = 0.0) -> int:
        """The largest window up to `asked` whose burst, and the `catch_up` rows its proposer
        feeds first less the seconds it is expected to earn back (`prospect`), fit the
        budget; 0 until priced."""
        if not self.priced or asked < 1:
            return 0
        cost = self._catch_up(catch_up)
        budget = self.budget(now) - max(cost - prospect, 0.0)
        window = max([k for k in range(1, asked + 1) if self.risk(k, self.depth) <= budget], default=0)
        if window:
            self._advance(min(cost, prospect))
        return window

    def _advance(self, seconds: float) -> None:
        """Credit a catch-up with what it was allowed to count on earning back, against the
        next speculative reply, which it delays and which is charged in full: without it a
        catch-up worth making would spend the request's credit and pause it at once. What
        the proposals then fail to earn back stays lost, at most the advance."""
        self.advanced += seconds

    def _frame(self, rows: int) -> float:
        """A lone frame of `rows`, never below a plain decode: the line through this request's
        lone frames once two row counts are timed; before, a plain decode and ROW_SHARE of its
        compute for each row more (the links and the loop do not grow with rows)."""
        if len(self.lone.samples) > 1:
            return max(self.lone.at(rows), self.plain.value)
        return self.plain.value + self._compute(rows) - self._compute(1)

    def _catch_up(self, rows: int) -> float:
        """What feeding `rows` before the first proposal step costs beyond the one row a step
        feeds, priced as the target's rows: a draft is rarely dearer than the model it drafts for."""
        return self._compute(rows) - self._compute(1) if rows > 1 else 0.0

    def _compute(self, rows: int) -> float:
        """Every stage's service time for a frame of `rows`: a plain decode's as timed, each
        row more ROW_SHARE of it (a plain decode's whole gap until its compute is timed)."""
        one = self.compute.value if self.compute.known else self.plain.value
        return one * (1 + ROW_SHARE * (rows - 1))
