"""The request record's transitions over random frames, replies, void replies and resumes
(hypothesis; no model, no process). The target is a function of position, so whatever
the record commits can be checked against it."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from common.ids import LaneId
from common.sampling import Sampled, SamplingParams
from mesh.backend import Account, GenerationRequest
from mesh.serving.request_state import Outgoing, RequestState

PROMPT = (5, 6, 7, 8)
VOCAB = 50
EOS = 1


def target(position: int) -> int:
    """The token the target samples at `position` (never EOS unless asked)."""
    return 2 + (position * 7 + 3) % (VOCAB - 2)


def reply(frame: Outgoing) -> list[Sampled]:
    """What the final stage sends back: one token per sampled row, row j predicting start + j + 1."""
    rows = range(len(frame.tokens)) if frame.drafts else [len(frame.tokens) - 1]
    return [Sampled(target(frame.start + j + 1)) for j in rows]


@dataclass
class Tally:
    """What the events said, added up independently of the record."""

    committed: list[int] = field(default_factory=list)
    windows: int = 0
    proposed: int = 0
    accepted: int = 0


actions = st.lists(st.one_of(
    st.tuples(st.just("send"), st.lists(st.booleans(), max_size=4)),  # drafts: right (True) or wrong
    st.just(("reply", [])), st.just(("void", [])), st.just(("resume", [])), st.just(("deliver", []))),
    max_size=60)


def _send(state: RequestState, rights: list[bool], sent: list[tuple[Outgoing, int]]) -> RequestState:
    if not state.can_draft:
        rights = []
    at = len(state.sequence)
    drafts = [target(at + i) if right else 0 for i, right in enumerate(rights[: max(state.room(64), 0)])]
    if sent and not drafts:
        return state
    state, frame = state.send(drafts, "draft" if drafts else "", 0.0)
    sent.append((frame, state.epoch))
    return state


@settings(max_examples=300, deadline=None)
@given(actions, st.integers(1, 20))
def test_the_record_only_commits_what_the_target_said_and_accounts_for_it(script, max_tokens):
    state = RequestState(GenerationRequest(PROMPT, max_tokens), speculative=True).leased(LaneId(0), 0)
    sent: list[tuple[Outgoing, int]] = []  # frames in flight, with the epoch they left in
    voided: list[tuple[Outgoing, int]] = []  # frames the record voided, whose replies may still come
    tally = Tally()
    for action, rights in script:
        before = state
        if state.finish is not None:
            break
        if action == "send":
            state = _send(state, rights, sent)
        elif action == "reply" and sent:
            frame, epoch = sent.pop(0)
            state, r = state.apply(reply(frame), epoch)
            tally.committed += [s.token for s in r.committed]
            for f, accepted in r.settled:
                tally.windows += bool(f.drafts)
                tally.proposed += f.drafts
                tally.accepted += accepted
            if state.epoch != before.epoch or state.finish is not None:
                voided += sent  # the driver voids every frame still out
                sent.clear()
        elif action == "void" and voided:
            frame, epoch = voided.pop()
            after, r = state.apply(reply(frame), epoch)
            assert after is state  # a reply of a void epoch changes nothing
            assert (r.committed, r.settled) == ((), ())
        elif action == "resume":
            voided += sent
            state, sent = state.resume().leased(LaneId(0), 0), []
        elif action == "deliver" and state.delivered < len(state.output):
            state = state.delivered_one()
        # committed tokens only grow, and are the target's own
        assert state.output[: len(before.output)] == before.output
        assert list(state.output) == [target(len(PROMPT) + i) for i in range(len(state.output))]
        # every stage's KV never holds more than what is committed
        assert state.computed <= len(state.tokens)
        assert state.fed <= len(state.sequence)
        assert len(state.output) <= max_tokens
    assert tally.committed == list(state.output)  # usage equals what the events reported
    assert (state.acceptance.windows, state.acceptance.proposed, state.acceptance.accepted) == \
        (tally.windows, tally.proposed, tally.accepted)
    assert state.account() == Account(len(PROMPT), state.delivered, 0, state.resumed, state.acceptance, state.finish,
                                      rule="exact")


def test_a_stop_token_finishes_and_is_not_committed():
    state = RequestState(GenerationRequest(PROMPT, 10, stop_tokens=frozenset({EOS})))
    state, frame = state.leased(LaneId(0), 2).send([])
    assert (frame.start, frame.tokens) == (2, [7, 8])  # a prefix-cache hit: only the rest is fed
    state, r = state.apply([Sampled(30)], 0)
    assert state.output == (30,)
    assert state.computed == len(PROMPT)
    state, frame = state.send([31, 32])
    assert (frame.start, frame.tokens, frame.drafts) == (4, [30, 31, 32], 2)
    state, r = state.apply([Sampled(31), Sampled(EOS), Sampled(40)], 0)
    assert [s.token for s in r.committed] == [31]
    assert state.finish == "stop"
    assert state.frames == ()
    assert state.acceptance.accepted == 1


def test_a_resume_feeds_the_prompt_and_the_output_again_and_keeps_the_record():
    penalised = SamplingParams(presence_penalty=0.5)
    state = RequestState(GenerationRequest(PROMPT, 10, penalised), speculative=True).leased(LaneId(3), 0)
    state, f = state.send([])
    state, _ = state.apply(reply(f), 0)
    state, f = state.send([target(5), 0])
    state, _ = state.apply(reply(f), 0)  # one accepted, one rejected: a new epoch
    record = state.acceptance
    assert state.epoch == 1
    state = state.resume().leased(LaneId(3), 0)
    assert (state.resumed, state.computed, state.acceptance) == (1, 0, record)
    assert not state.can_draft  # the new route must catch up first, whatever the proposer has
    state, frame = state.send([])
    assert frame.tokens == list(state.tokens)  # one frame feeds all that every stage computed before
    assert frame.history == state.output  # the penalties of its sampled row count the whole completion


def test_a_lost_restore_starts_the_lane_over_keeping_what_was_handed_out():
    """The KV tier's entry was lost on some stage: the request starts over from position 0 on
    its lane. A fresh one counts nothing cached; one resumed after a route break (tokens handed
    out already) feeds them again and keeps its first lease's count."""
    fresh = RequestState(GenerationRequest(PROMPT, 10)).leased(LaneId(1), 3)
    again = fresh.resume(rebuilt=False)
    assert (again.computed, again.cached, again.resumed, again.epoch) == (0, 0, 0, 1)
    state, _ = RequestState(GenerationRequest(PROMPT, 10)).leased(LaneId(1), 2).send([])
    state, _ = state.apply([Sampled(30)], 0)
    state = state.delivered_one().resume().leased(LaneId(2), 3)  # a route break; the new lease restores
    again = state.resume(rebuilt=False)
    assert (again.computed, again.cached, again.resumed, again.delivered) == (0, 2, 1, 1)
    _, frame = again.send([])
    assert frame.tokens == [*PROMPT, 30]  # the prompt and the token handed out, fed again
