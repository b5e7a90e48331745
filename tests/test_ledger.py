"""The request's ledger (mesh/speculative/ledger.py): speculation never loses more than its
share of a request, whatever its proposals do (issue 58)."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from mesh.speculative.ledger import SHARE, Ledger
from mesh.speculative.window import Adaptive, Observation, Since
from packages.speculative import WindowPolicy

PLAIN = 0.020  # a plain decode, reply to reply
PER_ROW = 0.007  # what each row more of a frame costs (this VM: 8 rows 52 ms against 12 for one)
PREFILL = 1.0


def _plain(ledger: Ledger, in_step: bool = True) -> None:
    ledger.heard(Observation(0, 0, 0.0, 1, 0.012, (0.006,), tokens=1, since=Since(PLAIN, in_step)))


def _priced() -> Ledger:
    ledger = Ledger(started=0.0)
    _plain(ledger)
    return ledger


def simulate(accepts: Callable[[int, int], int], tokens: int = 128, depth: int = 1) -> float:
    """A request decoded with prompt lookup's controller under the ledger, one frame at a time:
    its whole time over plain decoding's. `accepts(position, window)` is what the target
    accepts of a window proposed at `position`."""
    ledger, window = Ledger(started=0.0), Adaptive(WindowPolicy(policy="adaptive", initial=2, min=1, max=16))
    now, done, last = PREFILL, 0, ""
    while done < tokens:
        ledger.allowed_depth(depth, now)
        k = min(ledger.allowed_window(window.next_window(), now), tokens - done - 1)
        accepted = accepts(done, k) if k else 0
        gap = PLAIN + PER_ROW * k
        kind = "verify" if k else "plain"
        seen = Observation(k, accepted, 0.0, k + 1, 0.012, (0.006,), tokens=accepted + 1,
                           since=Since(gap, last == kind) if last else None)
        ledger.heard(seen)
        window.record(seen)
        now, done, last = now + gap, done + accepted + 1, kind
    return now / (PREFILL + tokens * PLAIN)


def test_an_unpriced_request_decodes_plainly_until_a_plain_decode_is_timed():
    ledger = Ledger(started=0.0)
    assert ledger.allowed_window(8, now=5.0) == 0
    _plain(ledger, in_step=False)  # after a prefill or a verify frame: its gap is not a plain decode's
    assert ledger.allowed_window(8, now=5.0) == 0
    _plain(ledger)
    assert ledger.allowed_window(8, now=5.0) > 0


def test_a_plain_decode_is_timed_again_after_retime_every_replies():
    ledger = _priced()
    for _ in range(ledger.retime_every):
        assert ledger.priced
        ledger.heard(Observation(4, 4, 0.0, 5, tokens=5, since=Since(0.03, True)))
    assert not ledger.priced
    assert ledger.allowed_window(4, now=1.0) == 0
    _plain(ledger)
    assert ledger.priced


def test_losing_frames_spend_the_credit_then_the_request_decodes_plainly():
    ledger = _priced()
    assert ledger.allowed_window(16, now=PREFILL) >= 1
    for _ in range(3):  # windows rejected whole: a frame's time for one token
        ledger.heard(Observation(8, 0, 0.0, 9, tokens=1, since=Since(PLAIN + 8 * PER_ROW, True)))
    assert ledger.balance < 0
    assert ledger.allowed_window(16, now=PREFILL) == 0
    assert ledger.allowed_depth(3, now=PREFILL) == 1


def test_windows_that_pay_earn_longer_windows_and_frames_ahead():
    ledger = _priced()
    first = ledger.allowed_window(16, now=PREFILL)
    for k in (1, 2, 4, 8):
        ledger.heard(Observation(k, k, 0.0, k + 1, tokens=k + 1, since=Since(PLAIN + k * PER_ROW, True)))
    assert ledger.balance > 0
    assert ledger.allowed_window(16, now=PREFILL) > first
    assert ledger.allowed_depth(3, now=PREFILL) == 3


@pytest.mark.parametrize("depth", [1, 3])
def test_proposals_never_accepted_lose_at_most_the_share_and_a_frame(depth):
    ratio = simulate(lambda at, k: 0, depth=depth)
    assert ratio <= 1 + SHARE + (PER_ROW * 2) / (PREFILL + 128 * PLAIN)


def test_a_copy_that_breaks_off_keeps_what_it_saved():
    """Accepted whole for 60 tokens, then never: the shape of a rewrite whose model wandered
    off the source (copy-heavy/01-rename in the corpus)."""
    assert simulate(lambda at, k: k if at < 60 else 0) < 0.85


@pytest.mark.parametrize("seed", range(20))
def test_any_acceptance_stays_within_the_share(seed):
    """Random runs of copies and misses: never more than 1% slower than plain decoding."""
    rng = random.Random(seed)
    spans = [(rng.randrange(128), rng.random()) for _ in range(6)]

    def accepts(at: int, k: int) -> int:
        rate = next((p for start, p in sorted(spans, reverse=True) if at >= start), 0.0)
        return next((i for i in range(k) if rng.random() > rate), k)

    assert simulate(accepts) <= 1 + SHARE + 1e-9


def test_a_copy_accepted_whole_pays():
    assert simulate(lambda at, k: k) < 0.6


def test_a_draft_catching_up_on_a_long_prompt_waits_until_the_request_can_pay_for_it():
    """A fresh session's draft reads its whole prompt first: 200 rows cost more than a prefill
    of the target's half (copy-heavy with the defaults lost 28% on it, whatever it proposed)."""
    ledger = _priced()
    assert ledger.allowed_window(4, now=PREFILL) >= 1
    assert ledger.allowed_window(4, now=PREFILL, catch_up=200) == 0
    assert ledger.allowed_window(4, now=PREFILL, catch_up=1) >= 1  # a step feeds its last token anyway
    for _ in range(12):  # forced tokens or a copy saved this much
        ledger.heard(Observation(16, 16, 0.0, 17, tokens=17, since=Since(PLAIN + 16 * PER_ROW, True)))
    assert ledger.allowed_window(4, now=PREFILL, catch_up=200) >= 1


def test_a_catch_up_may_count_on_half_what_a_controller_that_speculates_predicts():
    from mesh.backend import WindowChoice
    from mesh.serving.proposals import prospect

    on = WindowChoice(4, 2, predicted_tok_s=100.0, plain_tok_s=50.0, why="")
    assert prospect(on, room=1000) == pytest.approx(0.5 * 64 * (1 / 50 - 1 / 100))
    assert prospect(on, room=10) == pytest.approx(0.5 * 10 * (1 / 50 - 1 / 100))
    assert prospect(WindowChoice(0, 1, 40.0, 50.0, ""), room=1000) == 0.0  # off: nothing to count on
    assert prospect(None, room=1000) == 0.0  # adaptive and fixed predict nothing
    ledger = _priced()
    assert ledger.allowed_window(4, now=PREFILL, catch_up=40) == 0
    assert ledger.allowed_window(4, now=PREFILL, catch_up=40, prospect=1.0) >= 1


def test_a_catch_up_allowed_on_its_prospect_is_credited_with_it_and_charged_in_full():
    """The reply a catch-up delays is charged whole; the advance keeps a catch-up worth making
    from pausing the request at once, and what is not earned back stays lost."""
    ledger = _priced()
    assert ledger.allowed_window(4, now=PREFILL, catch_up=40, prospect=1.0) >= 1
    cost = ledger._catch_up(40)
    assert ledger.advanced == pytest.approx(cost)  # the catch-up's cost, within the prospect
    ledger.heard(Observation(1, 1, 0.0, 2, tokens=2, since=Since(PLAIN + PER_ROW + cost, True)))
    assert ledger.balance == pytest.approx(PLAIN - PER_ROW)  # the window's own saving, not less the catch-up
    assert ledger.pause <= 0
    ledger.heard(Observation(1, 0, 0.0, 2, tokens=1, since=Since(PLAIN + PER_ROW + cost, True)))
    assert ledger.balance == pytest.approx(PLAIN - 2 * PER_ROW - cost)  # a second catch-up gets no advance
