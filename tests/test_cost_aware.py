"""The cost-aware window controller on simulated meshes: each scenario's costs are this VM's
measured ones (issue 26's table: a same-cost Q4_0 draft at 13 ms a token, SmolLM2 halves at
6.5 ms plus 3.2 ms a row), acceptance is drawn per position, and every time carries ±10%
noise. No model is loaded: what is tested is the choice, its stability across seeds, and
what it earns against the best fixed setting, priced by the same model with the true costs."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, replace
from typing import Any

import pytest
from test_generate_events import LONG, PROMPT, ScriptedDraft, ScriptedPipeline

from common.sampling import Sampled
from mesh.backend import GenerationRequest
from mesh.serving.generate import generate
from mesh.serving.pipeline import Lease, Pending
from mesh.serving.proposals import Proposing
from mesh.serving.request_state import Live, RequestState
from mesh.speculative.cost_model import Costs, Option, gap, options
from mesh.speculative.plan import FRAMES_IN_FLIGHT, PRICED_FRAMES_IN_FLIGHT
from mesh.speculative.window import Adaptive, CostAware, Fixed, Observation, Since
from packages.speculative import WindowPolicy

# the loop's and proposers' mechanics, not what a request's ledger allows (tests/test_ledger.py)
pytestmark = pytest.mark.usefixtures("unbounded_ledger")

POLICY = WindowPolicy(policy="cost-aware", initial=4, min=1, max=8)
MS = 1e-3


@dataclass(frozen=True)
class Mesh:
    draft_step: float
    stage0: tuple[float, float]  # base, per row past the first
    later: tuple[tuple[float, float], ...]
    links: float
    accept: float  # each draft, given the ones before it
    hidden: float = 0.0  # what a verify frame costs beyond its parts: the model cannot see it, the wall clock can
    catch_up: float = 0.0  # what the draft spends catching up on what it sat out, before a probe
    ahead: float = 1.0  # stage 0's pace with frames ahead over its parts as timed one frame at a time

    def costs(self) -> Costs:
        def line(b: tuple[float, float]):
            return lambda rows: b[0] + b[1] * (rows - 1)

        later = [line(b) for b in self.later]
        return Costs(self.draft_step, line(self.stage0), lambda r: max((f(r) for f in later), default=0.0),
                     lambda r: sum(f(r) for f in later), self.links)

    def true_costs(self) -> Costs:
        """The costs as they are: stage 0's pace with frames ahead, the hidden cost in it."""
        parts = self.costs()
        return replace(parts, pace=lambda rows: parts.own(rows - 1) * self.ahead + self.hidden)

    def true_options(self, limit: int) -> list[Option]:
        return options(self.true_costs(), [self.accept**j for j in range(1, POLICY.max + 1)],
                       range(POLICY.min, POLICY.max + 1), limit)

    def observe(self, k: int, rng: random.Random, noise: float = 0.1, depth: int = 1, before: int = 0,
                position: int = 1) -> Observation:
        """A frame of k drafts with `depth` out, the frame before it having had `before` drafts
        (-1: none, the session's first), the `position`-th of its cycle (1: sent alone, after a
        rejection or one at a time): its parts, and its reply's gap as the loop would see it,
        as the cost model has a cycle's replies come (cost_model.ahead)."""
        def jitter(t: float) -> float:
            return t * (1 + rng.uniform(-noise, noise))

        accepted = 0
        while accepted < k and rng.random() < self.accept:
            accepted += 1
        rows = k + 1
        later = tuple(jitter(b + p * k) for b, p in self.later)
        since = None
        if before >= 0:
            seconds = self.gap_at(k, depth, position) + (self.catch_up if k and not before else 0.0)
            since = Since(jitter(seconds), (k > 0) == (before > 0), position == 1)
        # with frames ahead, the target's token after a frame's drafts is the next frame's
        tokens = accepted + 1 if depth == 1 or accepted < k else accepted
        burst = k > 0 and 1 < position <= depth  # sent right behind the cycle's lone frame: stage 0's pace
        pace = jitter(self.costs().own(k) * self.ahead + self.hidden) if burst else None
        return Observation(k, accepted, jitter(self.draft_step * k), rows,
                           jitter(self.stage0[0] + self.stage0[1] * k), later, jitter(self.links), tokens, since, pace)

    def gap(self, k: int, depth: int) -> float:
        """A lone reply's time after the one before, as the cost model has it, plus the hidden cost."""
        return gap(self.costs(), k, depth) + (self.hidden if k else 0.0)

    def gap_at(self, k: int, depth: int, position: int) -> float:
        """The gap before the `position`-th reply of a cycle: the lone round trip first, then
        stage 0's pace, and the round trip's rest at each round's first (cost_model.ahead)."""
        if k == 0 or depth == 1 or position == 1:
            return self.gap(k, depth)
        c = self.true_costs()
        spacing = c.spacing(k)
        rounds = max(depth * spacing, c.alone(k))
        return spacing if (position - 1) % depth else rounds - (depth - 1) * spacing


def half(scale: float = 1.0) -> tuple[float, float]:
    return 6.5 * MS * scale, 3.2 * MS * scale


# a probe's draft catches up on at most 64 tokens: about 0.25 s for the same-cost draft on one core
SAME_COST_0MS = Mesh(13 * MS, half(), (half(),), 1.5 * MS, 0.68, catch_up=0.25)
SAME_COST_20MS = Mesh(13 * MS, half(), (half(),), 41.5 * MS, 0.68)
SAME_COST_50MS = Mesh(13 * MS, half(), (half(),), 101.5 * MS, 0.68)
ONE_NODE = Mesh(13 * MS, (13 * MS, 6.4 * MS), (), 0.0, 0.68)
REALISTIC_20MS = Mesh(13 * MS, half(4), (half(4),), 41.5 * MS, 0.68)  # an F32 target, four times the draft
LOOKUP_0MS = Mesh(0.02 * MS, half(), (half(),), 1.5 * MS, 0.9)  # prompt lookup on copied text


def run(mesh: Mesh, seed: int, rounds: int = 400, limit: int = 3, w: CostAware | None = None
        ) -> tuple[CostAware, list[int]]:
    rng = random.Random(seed)
    w = w or CostAware(POLICY)
    windows: list[int] = []
    position = 1
    for _ in range(rounds):
        k = w.next_window()
        depth = w.depth(limit)
        seen = mesh.observe(k, rng, depth=depth, before=windows[-1] if windows else -1, position=position)
        w.record(seen)
        # a rejection voids the frames behind: the next leaves alone and starts a cycle
        position = 1 if seen.accepted < k or k == 0 or depth == 1 else position + 1
        windows.append(k)
    return w, windows


def earned(mesh: Mesh, w: CostAware, limit: int = 3) -> float:
    """The true rate of the controller's choice over the best setting's."""
    priced = mesh.true_options(limit)
    chosen = next(o for o in priced if (o.window, o.depth) == (w.window, w.depth(limit)))
    return chosen.tok_s / max(o.tok_s for o in priced)


@pytest.mark.parametrize("limit", [FRAMES_IN_FLIGHT, PRICED_FRAMES_IN_FLIGHT])
@pytest.mark.parametrize("mesh", [SAME_COST_0MS, SAME_COST_20MS, SAME_COST_50MS, ONE_NODE, REALISTIC_20MS,
                                  LOOKUP_0MS], ids=["0ms", "20ms", "50ms", "one-node", "realistic-20ms", "lookup"])
def test_every_seed_earns_at_least_95_percent_of_the_best_setting(mesh, limit):
    # prompt lookup's windows 2 and 3 lie 7% apart, and acceptance at 0.9 read from a few
    # hundred windows swings between them: there a seed may keep the lesser (measured 0.926)
    least = 0.92 if mesh is LOOKUP_0MS else 0.95
    for seed in range(8):
        w, _ = run(mesh, seed, limit=limit)
        assert earned(mesh, w, limit) >= least, (seed, w.choice)


def test_frames_ahead_that_run_faster_than_their_parts_timed_alone_are_tried_and_kept():
    """As on the 20 ms split-2 mesh: stage 0's draft and layers, timed one frame at a time,
    took 29 ms for a window of 1; with frames ahead its pace was about 0.6 of that. Priced
    from the parts, three frames out look no better than one; tried, their pace is timed,
    and the controller keeps the best setting."""
    mesh = replace(SAME_COST_20MS, stage0=half(2), ahead=0.5)
    parts = options(mesh.costs(), [mesh.accept**j for j in range(1, 4)], range(1, 4), 3)
    by_parts = {(o.window, o.depth): o.tok_s for o in parts}
    assert by_parts[(1, 3)] < 1.05 * by_parts[(1, 1)]  # the parts alone do not show the gain
    for seed in range(8):
        w, _ = run(mesh, seed)
        assert w.depth(3) > 1, (seed, w.choice)
        assert earned(mesh, w) >= 0.95, (seed, w.choice)
        assert w.seen.pace.known


def test_a_same_cost_draft_over_a_fast_link_is_off_and_costs_next_to_nothing():
    """At 0 ms the draft costs as much as the target: every seed turns it off, and the probes
    after that cost under 2% of the time plain decodes would take."""
    mesh = SAME_COST_0MS
    for seed in range(8):
        w, windows = run(mesh, seed, rounds=1000)
        assert w.window == 0
        assert w.choice is not None
        assert w.choice.window == 0
        late = windows[100:]
        probe_s = sum(mesh.catch_up + mesh.gap(k, 1) - mesh.gap(0, 1) for k in late if k)
        assert probe_s < 0.02 * len(late) * mesh.gap(0, 1), seed


def test_a_long_link_keeps_several_frames_in_flight_and_predicts_its_gain():
    for seed in range(8):
        w, _ = run(SAME_COST_50MS, seed)
        assert w.window >= 1
        assert w.depth(3) > 1
        choice = w.choice
        assert choice is not None
        assert choice.predicted_tok_s > 1.5 * choice.plain_tok_s  # the true best is 1.76x
        assert "predicted" in choice.why


def test_the_choice_is_the_same_run_after_run():
    """Eight seeds (acceptance and ±10% timing noise) choose settings whose true rates are
    within 5% of each other (prompt lookup's, 8%, as the test above says): where two
    settings nearly tie, either is the same choice within noise."""
    for mesh, spread in ((SAME_COST_20MS, 1.05), (REALISTIC_20MS, 1.05), (LOOKUP_0MS, 1.08)):
        true = {(o.window, o.depth): o.tok_s for o in mesh.true_options(3)}
        earns = [true[(w.window, w.depth(3))] for w, _ in (run(mesh, seed) for seed in range(8))]
        assert max(earns) <= spread * min(earns), earns


@pytest.mark.parametrize("mesh", [SAME_COST_20MS, SAME_COST_50MS], ids=["20ms", "50ms"])
def test_a_depth_that_pays_its_frames_is_kept_however_the_way_there_went(mesh):
    """With five frames allowed, four or five out run 8% or more faster than one (more than the
    2% a frame they must earn): every seed ends on the same depth. When the depth penalty was
    also weighed against every other setting, on top of the 3% a switch must promise, one
    out and four out lay within that margin, and seeds kept one, three or four."""
    chosen = {(w.window, w.depth(PRICED_FRAMES_IN_FLIGHT))
              for w, _ in (run(mesh, seed, limit=PRICED_FRAMES_IN_FLIGHT) for seed in range(16))}
    assert len(chosen) == 1, chosen
    assert next(iter(chosen))[1] >= 4, chosen


def test_a_fast_link_and_a_slow_draft_keep_one_frame_in_flight():
    # stage 0 is nearly the whole round trip and drafting costs nearly a verify pass
    mesh = Mesh(6 * MS, (9.5 * MS, 0.95 * MS), ((0.2 * MS, 0.02 * MS),), 0.05 * MS, 0.9)
    w, _ = run(mesh, 0)
    assert w.window >= 1  # speculation pays, frames ahead do not
    assert w.depth(3) == 1


def test_low_acceptance_speculates_over_a_long_link_and_predicts_little_gain():
    # a frame ahead pays only when every draft before it is accepted: here rarely
    mesh = Mesh(1 * MS, (2 * MS, 0.5 * MS), ((2 * MS, 0.5 * MS),), 41 * MS, 0.1)
    w, _ = run(mesh, 0)
    assert w.window >= 1  # a window still pays over a 20 ms hop
    assert w.choice is not None
    assert w.choice.predicted_tok_s < 1.2 * w.choice.plain_tok_s


CHEAP_DRAFT_0MS = Mesh(1 * MS, half(), (half(),), 1.5 * MS, 0.9)  # the model says a window pays 1.5x
MARGINAL_0MS = Mesh(2 * MS, half(), (half(),), 1.5 * MS, 0.6)  # pays 1%: off or on, an optimist probes


def test_frames_that_cost_more_than_their_parts_turn_speculation_off():
    """Each verify frame costs 25 ms that no timed part shows (the event loop, the engine
    thread switching): the model alone would speculate at 1.5x; the wall clock says no."""
    hidden = replace(CHEAP_DRAFT_0MS, hidden=25 * MS)
    for seed in range(8):
        w, windows = run(hidden, seed, rounds=600)
        assert w.choice is not None
        assert "beyond its parts" in w.choice.why
        assert w.seen.overhead.excess / w.seen.overhead.frames > 15 * MS  # as measured, before it fades
        # after the verdict, off but for an optimist's probes (at 0.9, wide) and brief re-trials:
        # a probe all accepted may turn on a wide window with frames ahead, priced near a plain
        # decode, for the few frames it takes the wall clock to show its cost again (up to 32
        # of the 500 rounds measured)
        late = windows[100:]
        assert sum(1 for k in late if k) <= 0.07 * len(late), (seed, w.choice)


def test_without_hidden_costs_the_cheap_draft_speculates():
    for seed in range(8):
        w, _ = run(CHEAP_DRAFT_0MS, seed)
        assert w.window >= 1, (seed, w.choice)
        assert w.seen.overhead.value < 2 * MS


def test_a_verdict_reached_under_a_busy_neighbour_is_tried_again():
    """Off while frames cost 25 ms more; once that cost is gone, what was measured fades and
    speculation comes back within a few thousand rounds."""
    w, _ = run(replace(CHEAP_DRAFT_0MS, hidden=25 * MS), 0, rounds=300)
    assert w.window == 0
    w, windows = run(CHEAP_DRAFT_0MS, 1, rounds=4000, w=w)
    assert w.window >= 1, w.choice
    assert windows[-200:].count(0) < 20


def test_depth_never_exceeds_the_limit():
    mesh = Mesh(0.5 * MS, (2 * MS, 0.5 * MS), ((2 * MS, 0.5 * MS),), 100 * MS, 0.95)
    for limit in range(1, 7):
        w, _ = run(mesh, 0, limit=limit)
        assert 1 <= w.depth(limit) <= limit
        assert w.depth(1) == 1
    w, _ = run(mesh, 0, limit=6)
    assert w.depth(6) > 3  # so the limit was what held it


def test_one_frame_in_flight_prices_windows_as_one_at_a_time():
    """With a bound of 1 the choice is the window that maximizes tokens over the lone round trip."""
    mesh = SAME_COST_20MS
    w, _ = run(mesh, 3, limit=1)
    best = max((o for o in mesh.true_options(1)), key=lambda o: o.tok_s)
    assert w.depth(1) == 1
    assert abs(w.window - best.window) <= 1


def test_a_plain_decode_is_timed_first_and_again_every_so_often():
    w = CostAware(POLICY, replain_every=50)
    rng = random.Random(0)
    windows: list[int] = []
    for _ in range(200):
        k = w.next_window()
        w.record(replace(SAME_COST_20MS, accept=0.9).observe(k, rng, before=windows[-1] if windows else -1))
        windows.append(k)
    assert windows[0] == POLICY.initial
    assert windows[1] == 0
    assert 3 <= windows[2:].count(0) <= 5  # and again every 50 rounds


def test_a_round_without_a_match_is_a_plain_decode_and_no_probe():
    w, _ = run(MARGINAL_0MS, 2, rounds=200)  # off, but an optimist would still probe
    assert w.window == 0
    w.probe_every, w.off_for = 3, 0
    assert [w.next_window() for _ in range(3)][-1] >= 1  # the probe is due
    w.record(Observation(0, 0, 0.0, 1, 20 * MS, (7 * MS,), 1.5 * MS))  # ...and prompt lookup found no match
    assert w.probe_every == 3  # not a failed probe
    assert w.next_window() >= 1  # still due, until something is proposed
    w.record(Observation(1, 0, 2 * MS, 2, 9.7 * MS, (9.7 * MS,), 1.5 * MS, 1, None))  # rejected, and nothing priced it
    assert w.next_window() == 0
    # the probe failed: the next waits twice as long, or as long as keeps probes under 1% of the time
    assert w.probe_every == max(6, w._affordable())
    assert w.choice is not None
    assert f"probing every {w.probe_every} rounds" in w.choice.why  # what it says is what it will do


def test_probes_whose_catch_up_is_dear_come_seldom():
    """A probe's draft first catches up (0.25 s here, 17 plain decodes): the controller measures
    that and spaces probes so they cost under 1% of decoding, where cheap ones come every 16."""
    # a seed whose controller stays off: at this near tie some seeds turn on, which is no probe
    for dear in (False, True):
        w, windows = run(replace(MARGINAL_0MS, catch_up=0.25 if dear else 0.0), 6, rounds=1000)
        probes = sum(1 for k in windows[100:] if k)
        assert (probes <= 2) if dear else (probes >= 4), (dear, probes, w.choice)


def test_fixed_and_adaptive_keep_the_limit():
    assert Fixed(POLICY).depth(4) == 4
    assert Adaptive(POLICY).depth(2) == 2


class TwoDeep(Fixed):
    def depth(self, limit: int) -> int:
        return min(2, limit)


def test_the_loop_keeps_no_more_frames_out_than_the_controller_asks():
    pipeline = ScriptedPipeline(LONG)
    req = GenerationRequest(PROMPT, 20)
    window = TwoDeep(WindowPolicy(policy="fixed", initial=2, min=1, max=2))

    async def go() -> list[int]:
        loop = generate(pipeline, Lease(1, 0), Live(RequestState(req)), 64, Proposing(ScriptedDraft(LONG), window, 4))  # type: ignore[arg-type]
        return [e.token async for e in loop if isinstance(e, Sampled)]

    assert asyncio.run(go()) == LONG[:20]
    assert pipeline.most == 2


class Clocked(ScriptedPipeline):
    """Stamps each frame as the real pipeline does: sent when `send` starts, answered when waited for."""

    async def send(self, *args: Any, **kwargs: Any) -> Pending:
        began = time.perf_counter()
        pending = await super().send(*args, **kwargs)
        pending.sent_at, pending.answered_at = began, 0.0
        return pending

    async def wait(self, pending: Pending) -> list[Sampled]:
        pending.answered_at = time.perf_counter()
        return await super().wait(pending)


class Heard(TwoDeep):
    def __init__(self, depth: int) -> None:
        super().__init__(WindowPolicy(policy="fixed", initial=2, min=1, max=2))
        self.most = depth
        self.heard: list[Observation] = []

    def depth(self, limit: int) -> int:
        return min(self.most, limit)

    def record(self, seen: Observation) -> None:
        self.heard.append(seen)


def _heard(depth: int, misses: frozenset[int] = frozenset()) -> list[Observation]:
    window = Heard(depth)
    req = GenerationRequest(PROMPT, 24)

    async def go() -> None:
        proposing = Proposing(ScriptedDraft(LONG, misses=misses), window, 4)
        loop = generate(Clocked(LONG), Lease(1, 0), Live(RequestState(req)), 64, proposing)  # type: ignore[arg-type]
        async for _ in loop:
            pass

    asyncio.run(go())
    return window.heard


def _sinces(depth: int, misses: frozenset[int] = frozenset()) -> list[Since]:
    return [s.since for s in _heard(depth, misses) if s.proposed and s.since is not None and s.since.in_step]


def test_the_loop_says_which_verify_frames_left_alone():
    """One frame at a time, every verify frame leaves alone; two out, only the first after a
    rejection does (the cost-aware window holds those, and only those, to a lone round trip)."""
    assert all(s.alone for s in _sinces(1))
    assert not any(s.alone for s in _sinces(2))
    after_misses = _sinces(2, misses=frozenset({7, 15}))
    assert 1 <= sum(s.alone for s in after_misses) <= 2


def test_the_loop_times_stage_0s_pace_on_frames_sent_right_behind_another():
    """One frame at a time, no frame is sent behind another; with frames ahead, those sent in
    one burst (at the start, and after a rejection) carry stage 0's pace, and only they."""
    assert not any(s.pace is not None for s in _heard(1))
    paced = [s.pace for s in _heard(3, misses=frozenset({7, 15})) if s.pace is not None]
    assert 2 <= len(paced) <= 6  # two behind the first frame, two behind each cycle's lone frame
    assert all(p > 0 for p in paced)
