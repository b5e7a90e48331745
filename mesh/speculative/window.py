"""How many draft tokens to propose next: the speculative window controllers.

`fixed` always proposes the same number. `adaptive` grows by one after a full accept and
shrinks by one after an early reject, within [min, max]. `cost-aware` measures draft step
time, verify time and acceptance, and picks the window (0 = off) that maximizes expected
tokens per second; when it has turned speculation off it probes again every so often.
Each reads its bounds from the one `WindowPolicy` (packages/speculative.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from packages.speculative import WindowPolicy


class Controller(Protocol):
    """`record` is called once per verify reply (DESIGN.md §6): the drafts its rows checked,
    how many were accepted, their draft time, and the verify pass's time, or None when
    other frames were in flight with it, so that its round trip says nothing of one pass."""

    def next_window(self) -> int: ...

    def record(self, proposed: int, accepted: int, draft_s: float, verify_s: float | None) -> None: ...


@dataclass
class Fixed:
    policy: WindowPolicy

    def next_window(self) -> int:
        return self.policy.initial

    def record(self, proposed: int, accepted: int, draft_s: float, verify_s: float | None) -> None:
        pass


@dataclass
class Adaptive:
    policy: WindowPolicy
    window: int = 0

    def __post_init__(self) -> None:
        self.window = self.policy.initial

    def next_window(self) -> int:
        return self.window

    def record(self, proposed: int, accepted: int, draft_s: float, verify_s: float | None) -> None:
        if proposed == 0:
            return
        step = 1 if accepted == proposed else -1
        self.window = max(self.policy.min, min(self.policy.max, self.window + step))


def _ewma(old: float | None, new: float, weight: float = 0.2) -> float:
    return new if old is None else (1 - weight) * old + weight * new


@dataclass
class CostAware:
    """Maximizes E[tokens per window] / time per window from running measurements.

    With per-token acceptance a, a window of k yields (1 - a^(k+1)) / (1 - a) tokens and
    costs k draft steps plus one verify pass, modelled as verify(k) = base + per_row * k.
    """

    policy: WindowPolicy
    probe_every: int = 32  # rounds spent off before trying again; doubles while probes fail
    max_probe_every: int = 1024
    accept: float | None = None
    draft_step: float | None = None
    verify_base: float | None = None  # seconds for a window of 0 (a plain decode)
    verify_row: float = 0.0
    off_for: int = 0
    window: int = 0
    _verify: dict[int, float] = field(default_factory=dict)
    _probe_base: int = 0

    def __post_init__(self) -> None:
        self.window = self.policy.initial
        self._probe_base = self.probe_every

    def next_window(self) -> int:
        if self._verify and 0 not in self._verify:
            return 0  # one plain decode, to know what speculation must beat
        if self.window == 0:
            self.off_for += 1
            if self.off_for >= self.probe_every:
                self.off_for = 0
                return self.policy.min  # re-probe: conditions may have changed
        return self.window

    def record(self, proposed: int, accepted: int, draft_s: float, verify_s: float | None) -> None:
        if verify_s is not None:  # pipelined frames overlap: their round trips would skew the fit
            self._verify[proposed] = _ewma(self._verify.get(proposed), verify_s)
        if proposed:
            self.accept = _ewma(self.accept, min(accepted / proposed, 0.99))
            self.draft_step = _ewma(self.draft_step, draft_s / proposed)
        self._fit_verify()
        was_off, self.window = self.window == 0, self._best()
        if was_off and proposed and self.window == 0:
            self.probe_every = min(self.probe_every * 2, self.max_probe_every)
        elif self.window:
            self.probe_every = self._probe_base

    def _fit_verify(self) -> None:
        ks = sorted(self._verify)
        self.verify_base = self._verify.get(0, self.verify_base)
        if len(ks) >= 2:
            (k0, t0), (k1, t1) = (ks[0], self._verify[ks[0]]), (ks[-1], self._verify[ks[-1]])
            self.verify_row = max((t1 - t0) / (k1 - k0), 0.0)
            if self.verify_base is None:
                self.verify_base = max(t0 - self.verify_row * k0, 1e-6)

    def _best(self) -> int:
        if self.accept is None or self.draft_step is None or self.verify_base is None:
            return self.window  # not enough measurements yet: keep exploring
        a = self.accept
        best_k, best_rate = 0, 1.0 / self.verify_base
        for k in range(self.policy.min, self.policy.max + 1):
            tokens = (1 - a ** (k + 1)) / (1 - a)
            seconds = k * self.draft_step + self.verify_base + self.verify_row * k
            if tokens / seconds > best_rate:
                best_k, best_rate = k, tokens / seconds
        return best_k


def controller_for(policy: WindowPolicy) -> Controller:
    if policy.policy == "fixed":
        return Fixed(policy)
    if policy.policy == "adaptive":
        return Adaptive(policy)
    return CostAware(policy)
