"""How many draft tokens to propose next, and how many frames to keep in flight: the
speculative window controllers.

`fixed` always proposes the same number. `adaptive` grows by one after a full accept and
shrinks by one after an early reject, within [min, max]. `cost-aware` measures draft step
time, verify time, stage 0's own time and acceptance, and picks the window (0 = off) and the
frames in flight that maximize expected tokens per second; when it has turned speculation
off it probes again every so often. A round that proposed nothing (prompt lookup without
a match) is a plain decode to all three: it moves no window and counts as no probe. Each
reads its bounds from the one `WindowPolicy` (packages/speculative.py); the bound on frames
in flight is the loop's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from packages.speculative import WindowPolicy


class Controller(Protocol):
    """`record` is called once per verify reply (DESIGN.md §6): the drafts its rows checked,
    how many were accepted, their draft time, and the verify pass's time, or None when
    other frames were in flight with it, so that its round trip says nothing of one pass,
    and stage 0's own compute for it (`Pipeline.send`), when measured. `depth(limit)` is
    how many frames to keep in flight, 1..limit."""

    def next_window(self) -> int: ...

    def depth(self, limit: int) -> int: ...

    def record(self, proposed: int, accepted: int, draft_s: float, verify_s: float | None,
               stage0_s: float | None = None) -> None: ...


@dataclass
class Fixed:
    policy: WindowPolicy

    def next_window(self) -> int:
        return self.policy.initial

    def depth(self, limit: int) -> int:
        return limit

    def record(self, proposed: int, accepted: int, draft_s: float, verify_s: float | None,
               stage0_s: float | None = None) -> None:
        pass


@dataclass
class Adaptive:
    policy: WindowPolicy
    window: int = 0

    def __post_init__(self) -> None:
        self.window = self.policy.initial

    def next_window(self) -> int:
        return self.window

    def depth(self, limit: int) -> int:
        return limit

    def record(self, proposed: int, accepted: int, draft_s: float, verify_s: float | None,
               stage0_s: float | None = None) -> None:
        if proposed == 0:
            return
        step = 1 if accepted == proposed else -1
        self.window = max(self.policy.min, min(self.policy.max, self.window + step))


def _ewma(old: float | None, new: float, weight: float = 0.2) -> float:
    return new if old is None else (1 - weight) * old + weight * new


def _fit(points: dict[int, float], base: float | None, row: float) -> tuple[float | None, float]:
    """(base, per row) of the line through the smallest and largest window timed; the base
    is a window of 0's own time once there is one."""
    ks = sorted(points)
    base = points.get(0, base)
    if len(ks) >= 2:
        (k0, t0), (k1, t1) = (ks[0], points[ks[0]]), (ks[-1], points[ks[-1]])
        row = max((t1 - t0) / (k1 - k0), 0.0)
        if base is None:
            base = max(t0 - row * k0, 1e-6)
    return base, row


@dataclass
class CostAware:
    """Maximizes E[tokens per window] / E[seconds per window] over the window k and the
    frames in flight D, from running measurements (ewma; times fitted as base + per_row·k).

    With per-token acceptance a, a window of k yields (1 - a^(k+1)) / (1 - a) tokens. Sent
    alone it costs RT(k) = k·draft_step + verify(k). With D frames in flight and all
    accepted it costs T(k, D) = max(k·draft_step + stage0(k), RT(k) / D): stage 0 drafts and
    computes the window's k+1 rows on its one engine thread, the rest of the round trip
    overlaps. It is fully accepted with p = a^k; after a rejection the next goes alone, so a
    window costs p·T + (1 - p)·RT on average. D = 1 is the one-at-a-time choice exactly.
    D ranges over 1..the loop's bound. Until stage0 has been measured, D = 1; D > 1 must
    promise `deeper_gain` times the tokens per second of one at a time, since void frames
    cost compute the model does not count.
    """

    policy: WindowPolicy
    probe_every: int = 32  # rounds spent off before trying again; doubles while probes fail
    max_probe_every: int = 1024
    deeper_gain: float = 1.1
    accept: float | None = None
    draft_step: float | None = None
    verify_base: float | None = None  # seconds for a window of 0 (a plain decode)
    verify_row: float = 0.0
    stage0_base: float | None = None  # stage 0's own compute for a window of 0
    stage0_row: float = 0.0
    off_for: int = 0
    window: int = 0
    frames: int = 1  # the chosen depth
    limit: int = 1  # the loop's bound on depth, as `depth` last heard it
    _verify: dict[int, float] = field(default_factory=dict)
    _stage0: dict[int, float] = field(default_factory=dict)
    _probe_base: int = 0
    _probing: bool = False  # a probe was asked for and nothing proposed yet (prompt lookup found no match)

    def __post_init__(self) -> None:
        self.window = self.policy.initial
        self._probe_base = self.probe_every

    def next_window(self) -> int:
        if self._verify and 0 not in self._verify:
            return 0  # one plain decode, to know what speculation must beat
        if self.window == 0:
            if self._probing:
                return self.policy.min  # the last probe's proposer had nothing to propose: still due
            self.off_for += 1
            if self.off_for >= self.probe_every:
                self.off_for = 0
                self._probing = True
                return self.policy.min  # re-probe: conditions may have changed
        return self.window

    def depth(self, limit: int) -> int:
        self.limit = limit  # the depths the next `record` weighs
        return max(1, min(self.frames, limit))

    def record(self, proposed: int, accepted: int, draft_s: float, verify_s: float | None,
               stage0_s: float | None = None) -> None:
        if verify_s is not None:  # pipelined frames overlap: their round trips would skew the fit
            self._verify[proposed] = _ewma(self._verify.get(proposed), verify_s)
        if stage0_s is not None:
            self._stage0[proposed] = _ewma(self._stage0.get(proposed), stage0_s)
        if proposed:
            self._probing = False
            self.accept = _ewma(self.accept, min(accepted / proposed, 0.99))
            self.draft_step = _ewma(self.draft_step, draft_s / proposed)
        self.verify_base, self.verify_row = _fit(self._verify, self.verify_base, self.verify_row)
        self.stage0_base, self.stage0_row = _fit(self._stage0, self.stage0_base, self.stage0_row)
        was_off = self.window == 0
        self.window, self.frames = self._best()
        if was_off and proposed and self.window == 0:
            self.probe_every = min(self.probe_every * 2, self.max_probe_every)
        elif self.window:
            self.probe_every = self._probe_base

    def _best(self) -> tuple[int, int]:
        """(k, D): the best pair, if it beats one at a time by `deeper_gain`, else D = 1."""
        if self.accept is None or self.draft_step is None or self.verify_base is None:
            return self.window, 1  # not enough measurements yet: keep exploring
        costs = _Costs(self.accept, self.draft_step, self.verify_base, self.verify_row,
                       self.stage0_base or 0.0, self.stage0_row)
        (best_k, best_rate), best_d = costs.best_window(1, self.policy), 1
        bar = best_rate * self.deeper_gain
        # stage 0's compute unmeasured, frames ahead might only queue behind it: stay at 1
        for d in range(2, self.limit + 1) if self.stage0_base is not None else ():
            k, rate = costs.best_window(d, self.policy)
            if rate > max(bar, best_rate):
                best_k, best_d, best_rate = k, d, rate
        return best_k, best_d


@dataclass(frozen=True)
class _Costs:
    """What `CostAware` has measured, to price windows with (its docstring has the model)."""

    accept: float
    draft_step: float
    verify_base: float
    verify_row: float
    stage0_base: float
    stage0_row: float

    def best_window(self, d: int, policy: WindowPolicy) -> tuple[int, float]:
        """(k, tokens per second) of the best window with d frames in flight; 0 is a plain decode."""
        best_k, best_rate = 0, 1.0 / self.verify_base
        for k in range(policy.min, policy.max + 1):
            rate = self.rate(k, d)
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k, best_rate

    def rate(self, k: int, d: int) -> float:
        a, drafting = self.accept, k * self.draft_step
        tokens = (1 - a ** (k + 1)) / (1 - a)
        alone = drafting + self.verify_base + self.verify_row * k
        if d == 1:
            return tokens / alone
        stage0 = self.stage0_base + self.stage0_row * k
        ahead = min(alone, max(drafting + stage0, alone / d))  # never worse than waiting
        return tokens / (a**k * ahead + (1 - a**k) * alone)


def controller_for(policy: WindowPolicy) -> Controller:
    if policy.policy == "fixed":
        return Fixed(policy)
    if policy.policy == "adaptive":
        return Adaptive(policy)
    return CostAware(policy)
