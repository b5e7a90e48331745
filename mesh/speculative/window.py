"""How many draft tokens to propose next, and how many frames to keep in flight: the
speculative window controllers.

`fixed` always proposes the same number. `adaptive` doubles after a full accept and falls to
the accepted drafts and one more after a rejection, within [min, max], with frames ahead only
behind a full accept. `cost-aware` measures what a frame
costs at each stage, what a draft costs and how often each draft position is accepted,
prices every (window, frames in flight) with mesh/speculative/cost_model.py and keeps the
best; when speculation does not pay it stops proposing and probes only while an optimistic
reading of acceptance says it might. A round that proposed nothing (prompt lookup without a
match) is a plain decode to all three: it moves no window and counts as no probe. Each reads
its bounds from the one `WindowPolicy` (packages/speculative.py); the bound on frames in
flight is the loop's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

from mesh.backend import WindowChoice
from mesh.speculative.cost_model import Costs, Option, gap, options
from mesh.speculative.estimates import Hazards, Line, Median, Overhead
from packages.speculative import WindowPolicy


@dataclass(frozen=True, slots=True)
class Since:
    """A reply's time after the session's previous one, both answering decodes: a plain
    decode leaves with nothing else out, so its gap is its whole cost; a verify frame's is
    the steady state's after another (`in_step`), and after a plain decode it is what
    turning speculation on cost, the draft's catch-up included."""

    seconds: float
    in_step: bool  # the previous reply answered a frame of the same kind
    # sent with nothing ahead of it (one at a time, or after a rejection voided the rest): its
    # gap is a lone round trip whatever its own outcome
    alone: bool = True


@dataclass(frozen=True, slots=True)
class Observation:
    """What one settled frame tells a window controller (the loop's `_record` makes it)."""

    proposed: int  # drafts its rows checked
    accepted: int
    draft_s: float  # what proposing them cost
    rows: int  # rows it fed
    stage0_s: float | None = None  # stage 0's own time for it (`Pipeline.send`)
    later_s: tuple[float, ...] = ()  # each later stage's compute, codec and sampling for it
    links_s: float | None = None  # its round trip less every stage's queue and service time
    tokens: int = 0  # what its reply committed
    since: Since | None = None  # None after a prefill, or as a session's first
    pace: float | None = None  # after the frame before it left stage 0, both sent in one burst


class Controller(Protocol):
    """`record` hears of every settled verify frame and plain decode (DESIGN.md §6).
    `depth(limit)` is how many frames to keep in flight, 1..limit; `choice` says what a
    cost-aware controller chose and why (None for the others)."""

    @property
    def ledgered(self) -> bool:
        """Whether the request's ledger bounds its windows (mesh/speculative/ledger.py): all
        but a fixed window, which is the operator's choice."""

    def next_window(self) -> int: ...

    def depth(self, limit: int) -> int: ...

    def record(self, seen: Observation) -> None: ...

    @property
    def choice(self) -> WindowChoice | None: ...


@dataclass
class Fixed:
    policy: WindowPolicy
    ledgered: ClassVar[bool] = False

    def next_window(self) -> int:
        return self.policy.initial

    def depth(self, limit: int) -> int:
        return limit

    def record(self, seen: Observation) -> None:
        pass

    @property
    def choice(self) -> WindowChoice | None:
        return None


@dataclass
class Adaptive:
    """Slow start, as TCP's: a window all accepted doubles (within `max`), and keeps frames
    ahead of it up to the loop's bound; a rejection cuts the window to the drafts accepted and
    one more (within `min`), and holds one frame out until a window is accepted whole again.

    Prompt lookup, its default, is right whole or not at all: a copy reaches a long window in
    a few frames, and a match that stops copying costs one frame, not a run of frames voided
    behind it. Growing by one a frame and shrinking by one, with every frame ahead sent
    regardless, took 14 frames to reach 16 on a copy and lost 9% where the copy broke off
    (bench: --scenarios corpus, copy-heavy)."""

    policy: WindowPolicy
    window: int = 0
    ahead: bool = True  # the last window was accepted whole: frames may go out behind it
    ledgered: ClassVar[bool] = True

    def __post_init__(self) -> None:
        self.window = self.policy.initial

    def next_window(self) -> int:
        return self.window

    def depth(self, limit: int) -> int:
        return limit if self.ahead else 1

    def record(self, seen: Observation) -> None:
        if seen.proposed == 0:
            return
        self.ahead = seen.accepted == seen.proposed
        grown = self.window * 2 if self.ahead else seen.accepted + 1
        self.window = max(self.policy.min, min(self.policy.max, grown))

    @property
    def choice(self) -> WindowChoice | None:
        return None


@dataclass
class Measured:
    """What the cost-aware controller has measured (mesh/speculative/estimates.py)."""

    draft: Median = field(default_factory=Median)  # seconds per draft token
    stage0: Line = field(default_factory=Line)
    slowest: Line = field(default_factory=Line)  # the slowest later stage
    later: Line = field(default_factory=Line)  # every later stage together
    links: Median = field(default_factory=Median)
    hazards: Hazards = field(default_factory=Hazards)
    plain: Median = field(default_factory=Median)  # seconds between plain decodes' replies, as the loop saw them
    overhead: Overhead = field(default_factory=Overhead)  # a lone verify frame's time beyond its parts
    probe: Median = field(default_factory=Median)  # what a probe cost beyond plain decodes of its tokens
    # stage 0's pace with frames ahead (`Observation.pace`) over its parts, as timed one frame at a time
    pace: Median = field(default_factory=Median)

    def add(self, seen: Observation) -> None:
        if seen.proposed:
            self.draft.add(seen.draft_s / seen.proposed)
            self.hazards.add(seen.proposed, seen.accepted)
        if seen.stage0_s is not None:
            self.stage0.add(seen.rows, seen.stage0_s)
        if seen.later_s:
            self.slowest.add(seen.rows, max(seen.later_s))
            self.later.add(seen.rows, sum(seen.later_s))
        if seen.links_s is not None:
            self.links.add(seen.links_s)
        if seen.since is not None and seen.proposed == 0:
            self.plain.add(seen.since.seconds)
        if seen.pace is not None and self.ready:
            self.pace.add(seen.pace / max(self.costs(overhead=False).own(seen.proposed), 1e-6))

    @property
    def ready(self) -> bool:
        """A draft step and a plain decode are timed: enough to price every setting."""
        return self.draft.known and 1 in self.stage0.samples

    def costs(self, overhead: bool = True) -> Costs:
        """The parts as timed, and with `overhead` what a verify frame took beyond them."""
        return Costs(self.draft.value, self.stage0.at, self.slowest.at, self.later.at, self.links.value,
                     self.overhead.value if overhead else 0.0, self._pace() if self.pace.known else None)

    def _pace(self) -> Callable[[int], float]:
        """Stage 0's pace with frames ahead by rows: its parts scaled as the pace timed them."""
        own, share = Costs(self.draft.value, self.stage0.at, self.slowest.at, self.later.at, 0.0).own, self.pace.value
        return lambda rows: own(rows - 1) * share

    def corrected(self, modelled: list[Option]) -> list[Option]:
        """A plain decode at its measured rate, once one is measured: its gap holds all it costs."""
        if not self.plain.known:
            return modelled
        return [Option(0, 1, 1 / max(self.plain.value, 1e-6)), *modelled[1:]]


@dataclass
class CostAware:
    """Keeps the (window, frames in flight) that mesh/speculative/cost_model.py prices best.

    The wall clock has the last word: every verify frame is priced with what such frames took
    beyond their timed parts (estimates.Overhead), and a plain decode at the rate the loop
    saw (Measured.corrected).

    Stable by construction: estimates are medians and pooled counts, and a new setting must
    promise `switch_gain` over the current one, so noise does not flip the choice. Each frame
    more in flight must earn `deeper_gain`: void frames cost compute other sessions could use.
    Off, it probes with the window an optimistic acceptance (two standard deviations up)
    would pick, every `probe_every` rounds, doubling after a probe with a rejection, never
    more often than keeps probes, as measured, under `probe_share` of the time, and only
    while that optimistic reading beats a plain decode; otherwise it re-checks every
    `max_probe_every`. Off, it turns on without a probe only if `payback_rounds` tokens
    at the new rate save more time than a probe, the draft's catch-up included, cost.
    A plain decode is re-timed every `replain_every` rounds, since it is what speculation
    must beat. On at one frame out, until stage 0's pace with frames ahead is timed, the best
    setting with frames ahead is tried if the model prices it within `trial_share` of the
    choice: priced from parts timed one frame at a time, it can look far dearer than it is.
    A trial holds for up to `trial_frames` frames, until the pace is timed.
    """

    policy: WindowPolicy
    ledgered: ClassVar[bool] = True
    probe_every: int = 16
    max_probe_every: int = 1024
    switch_gain: float = 1.03
    deeper_gain: float = 1.02
    replain_every: int = 256
    probe_share: float = 0.01
    payback_rounds: int = 128
    trial_share: float = 0.9
    trial_frames: int = 8
    # Off, prices are weighed again every this many plain decodes, not after each: pricing
    # every setting took 0.3-0.6 ms, 2-3% of a 20 ms decode, and off nothing moves fast.
    decide_every: int = 16
    seen: Measured = field(default_factory=Measured)
    window: int = 0
    frames: int = 1  # the chosen depth
    limit: int = 1  # the loop's bound on depth, as `depth` last heard it
    choice: WindowChoice | None = None  # the last decision, as usage and /metrics report it
    off_for: int = 0
    since_plain: int = 0
    _probe_base: int = 0
    _probe_window: int = 0
    _probing: bool = False  # a probe was asked for and nothing proposed yet (prompt lookup found no match)
    _plain_due: bool = True
    _undecided: int = 0  # frames recorded since prices were last weighed
    _trial_left: int = -1  # frames a trial of frames ahead still holds; -1: none since the pace was forgotten

    def __post_init__(self) -> None:
        self.window = self.policy.initial
        self._probe_base = self.probe_every
        self._probe_window = self.policy.min

    def next_window(self) -> int:
        self.since_plain += 1
        self._plain_due = self._plain_due or self.since_plain > self.replain_every
        if self._plain_due and self.seen.draft.known:
            return 0  # a plain decode, timed: what speculation must beat
        if self.window or self._probing:
            return self.window or self._probe_window
        self.off_for += 1
        if self.off_for >= self.probe_every:
            self.off_for, self._probing = 0, True
            return self._probe_window
        return 0

    def depth(self, limit: int) -> int:
        self.limit = limit  # the depths the next `record` weighs
        return max(1, min(self.frames, limit))

    def record(self, seen: Observation) -> None:
        self.seen.add(seen)
        self._realize(seen)
        if seen.proposed == 0 and seen.rows == 1:
            self._plain_due, self.since_plain = False, 0
        if not self.seen.ready:
            return  # keep exploring at the initial window
        probed = self.window == 0 and seen.proposed > 0
        if seen.proposed:
            self._probing = False
        self._undecided += 1
        if seen.proposed or self.window or self._undecided >= self.decide_every:
            self._undecided = 0
            self._decide(seen if probed else None)

    def _next_probe(self, probe: Observation) -> None:
        """After a probe: off, wait twice as long if it met a rejection (one all accepted is no
        reason to wait longer), and never less than probes can afford."""
        if self.window:
            self.probe_every = self._probe_base
            return
        wait = self.probe_every * (2 if probe.accepted < probe.proposed else 1)
        self.probe_every = min(max(wait, self._affordable()), self.max_probe_every)

    def _pays_back(self, option: Option, plain: Option) -> bool:
        """Turning on makes the draft catch up on all it sat out, as a probe does: worth it
        only if `payback_rounds` tokens at the option's rate save more than a probe costs."""
        saved = self.payback_rounds * (1 / plain.tok_s - 1 / option.tok_s)
        return not self.seen.probe.known or saved > self.seen.probe.value

    def _affordable(self) -> int:
        """The fewest rounds between probes for probes to cost at most `probe_share` of the
        time plain decodes take: a probe's draft first catches up on what it sat out."""
        if not (self.seen.probe.known and self.seen.plain.known):
            return 0
        return math.ceil(self.seen.probe.value / (self.probe_share * self.seen.plain.value))

    def _realize(self, seen: Observation) -> None:
        """A verify frame sent alone after another is held to the model's lone round trip; a
        probe costs what it took beyond the plain decodes its tokens would have; while off,
        what the wall clock showed fades."""
        since = seen.since
        if since is None or not self.seen.ready:
            return
        if seen.proposed == 0:
            self.seen.overhead.faded()
        elif since.in_step and since.alone:
            # a lone frame's gap is its round trip, which the model prices best; frames sent
            # ahead overlap in ways a period does not capture, and are not held to it
            depth = max(1, min(self.frames, self.limit))
            predicted = gap(self.seen.costs(overhead=False), seen.proposed, depth)
            self.seen.overhead.add(predicted, since.seconds)
        elif self.window == 0 and self.seen.plain.known:
            self.seen.probe.add(max(since.seconds - seen.tokens * self.seen.plain.value, 0.0))

    def _decide(self, probe: Observation | None = None) -> None:
        """`probe`: what a probe just saw; it brought the draft up to date, so turning on
        costs nothing more."""
        costs = self.seen.costs()
        windows = range(self.policy.min, self.policy.max + 1)
        modelled = options(costs, self.seen.hazards.chances(windows.stop), windows, self.limit)
        priced = self.seen.corrected(modelled)
        plain, best = priced[0], max(self._depths(priced), key=lambda o: o.tok_s)
        current = next((o for o in priced if (o.window, o.depth) == (self.window, self.frames)), plain)
        if self._better(best, current) and (
                current.window or probe is not None or self._pays_back(best, plain)):
            current = best
        current = self._trial(priced, current)
        if self.window and not current.window:
            self.seen.pace = Median()  # timed under what turned speculation off: the parts price it again
            self._trial_left = -1
        self.window, self.frames = current.window, current.depth
        if current.window == 0:
            hopeful = max(self.seen.corrected(options(costs, self.seen.hazards.chances(windows.stop, optimistic=True),
                                                      windows, self.limit)), key=self._score)
            self._probe_window = max(hopeful.window, self.policy.min)
            if hopeful.tok_s < plain.tok_s * self.switch_gain:
                self.probe_every = self.max_probe_every  # not even an optimistic reading pays
        if probe is not None:
            self._next_probe(probe)
        self.choice = _choice(current, plain, self.seen, self.probe_every)

    def _trial(self, priced: list[Option], current: Option) -> Option:
        """`current`, or while stage 0's pace with frames ahead is not timed, a trial of the
        best setting with frames ahead: begun on at one frame out if the model prices it
        within `trial_share` of `current`, held for `trial_frames` frames or until timed."""
        if self.seen.pace.known:
            self._trial_left = 0
        elif self._trial_left > 0:
            self._trial_left -= 1
            return next((o for o in priced if (o.window, o.depth) == (self.window, self.frames)), current)
        elif self._trial_left < 0 and current.window and current.depth == 1:
            ahead = max((o for o in priced if o.depth > 1), key=lambda o: o.tok_s, default=None)
            if ahead is not None and ahead.tok_s >= current.tok_s * self.trial_share:
                self._trial_left = self.trial_frames
                return ahead
        return current

    def _depths(self, priced: list[Option]) -> list[Option]:
        """Each window at its depth: the one whose rate, less `deeper_gain` for each frame past
        the first, is best. `_better` then weighs one setting against another."""
        chosen: dict[int, Option] = {}
        for option in priced:
            have = chosen.get(option.window)
            if have is None or self._score(option) > self._score(have):
                chosen[option.window] = option
        return list(chosen.values())

    def _better(self, new: Option, old: Option) -> bool:
        """Worth switching to: `switch_gain` more tokens a second, and `deeper_gain` for each
        frame more in flight, each on its own. Charged together, four out at 20 ms, 8% faster
        than one out, lay within their margin of it, so which of the two held was the noise's
        (tests/test_cost_aware.py). Turning speculation on must still clear both at once."""
        if old.window == 0:
            return self._score(new) > old.tok_s * self.switch_gain
        return new.tok_s > old.tok_s * self.switch_gain and self._score(new) > self._score(old)

    def _score(self, option: Option) -> float:
        return option.tok_s / self.deeper_gain ** (option.depth - 1)


def _choice(option: Option, plain: Option, seen: Measured, probe_every: int) -> WindowChoice:
    costs = (f"acceptance {seen.hazards.overall():.2f}, a draft token {seen.draft.value * 1e3:.1f} ms, "
             f"a plain decode {1e3 / plain.tok_s:.1f} ms, a verify frame {seen.overhead.value * 1e3:.1f} ms "
             "beyond its parts")
    if option.window == 0:
        why = f"off: no window beats a plain decode ({costs}); probing every {probe_every} rounds"
    else:
        why = (f"window {option.window}, {option.depth} in flight: {option.tok_s:.1f} tok/s predicted "
               f"against {plain.tok_s:.1f} without ({costs})")
    return WindowChoice(option.window, option.depth, round(option.tok_s, 2), round(plain.tok_s, 2), why)


def controller_for(policy: WindowPolicy) -> Controller:
    if policy.policy == "fixed":
        return Fixed(policy)
    if policy.policy == "adaptive":
        return Adaptive(policy)
    return CostAware(policy)
