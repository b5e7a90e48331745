"""Rejection-sampling acceptance is exact in distribution, by enumeration (stage/rejection.py).

`verify` draws through a `Chooser`; here a chooser that follows a script walks every branch
of every coin and draw, so the probability of each outcome is computed exactly, not sampled.
On the tiny random model, two speculation rounds of a real draft (its own processed rows, cut
to TOP, sampled) give the first two tokens with the same distribution as plain sampling, at
three temperatures, under top-p and top-k, with and without a grammar's mask.
"""

from __future__ import annotations

import functools
import itertools
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import numpy as np
import pytest
from models import write_tiny_llama
from stats import goodness_of_fit

from common.sampling import REJECTION, Proposed, SamplingParams
from stage.distribution import probabilities, truncated
from stage.engine import EngineConfig, Step
from stage.llama_engine import LlamaRangeEngine
from stage.masks import pack
from stage.rejection import Chooser, chance, residual, verify
from stage.sampling import processed_rows, sample_rows

T = TypeVar("T")
VOCAB = 64
PROMPT = [1, 7, 30, 12]
WINDOW = 2


class Scripted:
    """A chooser that takes the branches `path` names, in order, and the first of each
    decision past it; it records each decision's options and the weight of the branch taken."""

    def __init__(self, path: list[int]) -> None:
        self.path, self.at = path, 0
        self.options: list[int] = []
        self.weight = 1.0

    def _take(self, weights: list[float]) -> int:
        i = self.path[self.at] if self.at < len(self.path) else 0
        self.options.append(len(weights))
        self.at += 1
        self.weight *= weights[i]
        return i

    def accept(self, chance: float) -> bool:
        return self._take([chance, 1.0 - chance]) == 0

    def pick(self, probs: np.ndarray) -> int:
        support = np.flatnonzero(probs > 0)
        return int(support[self._take(list(probs[support]))])


def enumerate_runs(run: Callable[[Scripted], T]) -> Iterator[tuple[T, float]]:
    """Every outcome of `run` with the weight of the branches that led to it (an odometer
    over the decisions, last first)."""
    path: list[int] = []
    while True:
        chooser = Scripted(path)
        outcome = run(chooser)
        if chooser.weight > 0:
            yield outcome, chooser.weight
        taken = chooser.path[: chooser.at] + [0] * (chooser.at - len(chooser.path))
        while taken and taken[-1] + 1 >= chooser.options[len(taken) - 1]:
            taken.pop()
        if not taken:
            return
        taken[-1] += 1
        path = taken


def _one_chooser(chooser: Chooser) -> Callable[[int], Chooser]:
    return lambda position: chooser


def _first_token(p: np.ndarray, d: Proposed, chooser: Scripted) -> int:
    return verify([p, p], [d], 0, _one_chooser(chooser))[0]


def test_one_draft_gives_p_exactly_whatever_q() -> None:
    rng = np.random.default_rng(3)
    for _ in range(20):
        p = rng.dirichlet(np.full(8, 0.4))
        q_ids = rng.choice(8, size=4, replace=False)
        weights = rng.dirichlet(np.ones(4)).astype(np.float32)
        got: defaultdict[int, float] = defaultdict(float)
        for x_index, qx in enumerate(Proposed(0, tuple(q_ids.tolist()), tuple(weights.tolist())).probs()):
            d = Proposed(int(q_ids[x_index]), tuple(q_ids.tolist()), tuple(weights.tolist()))
            for outcome, weight in enumerate_runs(functools.partial(_first_token, p, d)):
                got[outcome] += qx * weight
        assert np.allclose([got[t] for t in range(8)], p, atol=1e-12)


def test_a_point_mass_is_kept_with_probability_p_and_never_redrawn() -> None:
    p = np.array([0.5, 0.3, 0.2])
    d = Proposed(1)
    assert chance(p, d) == pytest.approx(0.3)
    r = residual(p, d)
    assert r[1] == 0
    assert r.sum() == pytest.approx(1.0)
    assert r[0] == pytest.approx(0.5 / 0.7)


def test_a_rejected_token_is_never_the_residual_draw() -> None:
    p = np.array([0.1, 0.6, 0.3])
    d = Proposed(0, (0, 2), (0.8, 0.2))  # q(0) = 0.8 > p(0): kept 1 time in 8
    assert residual(p, d)[0] == 0.0
    for outcome, _ in enumerate_runs(lambda c: verify([p, p], [d], 0, _one_chooser(c))):
        assert outcome in ([0, 0], [0, 1], [0, 2], [1, 1], [2, 2])  # kept then a draw, or a redraw twice


# -- two rounds on the tiny model -------------------------------------------------------


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LlamaRangeEngine, LlamaRangeEngine]]:
    tmp = tmp_path_factory.mktemp("rejection")
    # the draft is another random model of the same vocabulary: it disagrees often
    models = [write_tiny_llama(tmp / f"m{seed}.gguf", vocab=VOCAB, seed=seed) for seed in (0, 1)]
    cfg = EngineConfig(first=True, final=True, lanes=1, ctx_per_lane=64)
    opened = [LlamaRangeEngine(Path(m), cfg) for m in models]
    yield opened[0], opened[1]
    for engine in opened:
        engine.close()


def _rows(engine: LlamaRangeEngine) -> Callable[[tuple[int, ...]], np.ndarray]:
    @functools.cache
    def row(prefix: tuple[int, ...]) -> np.ndarray:
        """The logits after `prefix`, the lane run from position 0."""
        return engine.step([Step(0, 0, tokens=np.asarray(prefix, dtype=np.int32))])[0][-1].astype(np.float64)

    return row


class Rounds:
    """Speculation as the mesh runs it, one round at a time: the draft proposes WINDOW tokens
    from its processed rows cut to TOP, and the target verifies them in one frame."""

    def __init__(self, target: Callable, draft: Callable, params: SamplingParams, mask: bytes) -> None:
        self.target, self.draft, self.params, self.mask = target, draft, params, mask

    def dist(self, rows: Callable, prefix: tuple[int, ...]) -> np.ndarray:
        masks = (self.mask,) if self.mask else ()
        processed = processed_rows(rows(prefix)[None, :], self.params, (), (), masks)
        return probabilities(processed[0], self.params)

    def proposals(self, prefix: tuple[int, ...]) -> Iterator[tuple[list[Proposed], float]]:
        """Every window the draft may propose after `prefix`, with its probability."""
        def extend(drafted: list[Proposed], weight: float) -> Iterator[tuple[list[Proposed], float]]:
            if len(drafted) == WINDOW:
                yield drafted, weight
                return
            ids, probs = truncated(self.dist(self.draft, prefix + tuple(d.token for d in drafted)))
            q = Proposed(-1, tuple(ids.tolist()), tuple(probs.astype(np.float32).tolist()))
            for token, qx in zip(q.ids, q.probs(), strict=True):
                yield from extend([*drafted, Proposed(token, q.ids, q.weights)], weight * qx)
        yield from extend([], 1.0)

    def first(self, prefix: tuple[int, ...], n: int) -> dict[tuple[int, ...], float]:
        """The exact distribution of the next `n` tokens."""
        out: defaultdict[tuple[int, ...], float] = defaultdict(float)
        for drafted, weight in self.proposals(prefix):
            tokens = tuple(d.token for d in drafted)
            dists = [self.dist(self.target, prefix + tokens[:i]) for i in range(WINDOW + 1)]
            run = functools.partial(self._committed, dists, drafted)
            for committed, w in enumerate_runs(run):
                got = tuple(committed)[:n]
                if len(got) == n:
                    out[got] += weight * w
                    continue
                for rest, w2 in self.first(prefix + got, n - len(got)).items():
                    out[got + rest] += weight * w * w2
        return out

    @staticmethod
    def _committed(dists: list[np.ndarray], drafted: list[Proposed], chooser: Scripted) -> list[int]:
        tokens = verify(dists, drafted, 0, _one_chooser(chooser))
        kept = next((i for i, d in enumerate(drafted) if tokens[i] != d.token), len(drafted))
        return tokens[: kept + 1]  # what stage 0 commits: the drafts kept and the token after


@pytest.mark.parametrize("masked", [False, True], ids=["free", "masked"])
@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.5])
def test_two_rounds_give_plain_sampling_exactly(engines, temperature: float, masked: bool) -> None:
    target, draft = engines
    params = SamplingParams(temperature=temperature, top_p=0.9, top_k=5, acceptance=REJECTION)
    mask = pack([t for t in range(VOCAB) if t % 3], VOCAB) if masked else b""
    rounds = Rounds(_rows(target), _rows(draft), params, mask)
    got = rounds.first(tuple(PROMPT), 2)
    plain = {(a, b): rounds.dist(rounds.target, tuple(PROMPT))[a] * rounds.dist(rounds.target, (*PROMPT, a))[b]
             for a, b in itertools.product(range(VOCAB), repeat=2)}
    assert sum(got.values()) == pytest.approx(1.0, abs=1e-12)
    assert max(abs(got.get(k, 0.0) - v) for k, v in plain.items()) < 1e-12
    assert all(k in plain and plain[k] > 0 for k in got)  # nothing outside p's support
    rejected = 1 - sum(min(a, b) for a, b in zip(rounds.dist(rounds.target, tuple(PROMPT)),
                                                  rounds.dist(rounds.draft, tuple(PROMPT)), strict=True))
    assert rejected > 0.05, "the draft must disagree for the residual to be exercised"


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.9),
                                    SamplingParams(temperature=1.3, top_k=5)], ids=["t1", "top-p", "top-k"])
def test_the_distribution_is_what_the_plain_sampler_draws_from(engines, params: SamplingParams) -> None:
    """`probabilities` against 20,000 draws of the plain sampler at as many positions: the
    rejection rule's p is plain decoding's p (a chi-square at p = 0.001)."""
    row = _rows(engines[0])(tuple(PROMPT))
    p = probabilities(row, params)
    draws = [s.token for position in range(20_000) for s in sample_rows(row[None, :], params, position, 1)]
    counts = np.bincount(draws, minlength=VOCAB)
    assert set(np.flatnonzero(counts)) <= set(np.flatnonzero(p))
    support = np.flatnonzero(p > 0)
    assert goodness_of_fit(counts[support].tolist(), p[support].tolist()) > 0.001
