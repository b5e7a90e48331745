"""The constrained bench scenario's table (issue 27), from made-up timings: no server."""

from __future__ import annotations

import json

from bench.harness.client import StreamTiming
from bench.scenarios.constrained import MODES, _table

FILM = json.dumps({"title": "Heat", "genre": "thriller", "year": 1995, "rating": 8.3, "cast": ["Pacino"],
                   "available": True})


def _timing(text: str, tokens: int) -> StreamTiming:
    return StreamTiming(0.1, tuple(0.1 + i / 20 for i in range(tokens)), tokens, text=text,
                        usage={"speculative": {"by_proposer": {"forced": {"proposed": 4, "accepted": 4}}}})


def _value(rows, metric: str) -> float:
    return next(r.value for r in rows if r.metric == metric)


def test_an_output_cut_by_the_token_limit_is_counted_apart_from_schema_failures():
    timings = {mode: [_timing(FILM, 30), _timing(FILM[:10], 64)] for mode in MODES}
    rows = _table("constrained split-2 0 ms", 0.0, timings, [_timing("free", 30)] * 2, 64)
    assert _value(rows, "outputs that fail their schema") == 0
    assert _value(rows, "outputs cut by --tokens before they ended") == len(MODES)  # one a mode
    assert _value(rows, "outputs identical to no speculation (1 = yes)") == 1
    timings["forced"][0] = _timing(FILM.replace("thriller", "western"), 30)  # ended, but off its schema
    rows = _table("constrained split-2 0 ms", 0.0, timings, [_timing("free", 30)] * 2, 64)
    assert _value(rows, "outputs that fail their schema") == 1
    assert _value(rows, "outputs identical to no speculation (1 = yes)") == 0
