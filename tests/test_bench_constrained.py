"""The constrained bench scenario's table (issues 27, 42), from made-up timings: no server."""

from __future__ import annotations

import json

from bench.harness.client import StreamTiming
from bench.scenarios.constrained import MODES, SCHEMAS, _table

FILM = json.dumps({"title": "Heat", "genre": "thriller", "year": 1995, "rating": 8.3, "cast": ["Pacino"],
                   "available": True})
RECIPE = json.dumps({"title": "Leek soup", "servings": 4, "difficulty": "easy", "vegetarian": True,
                     "ingredients": [{"name": "leek", "grams": 400}, {"name": "potato", "grams": 300}]})


def _timing(text: str, tokens: int) -> StreamTiming:
    return StreamTiming(0.1, tuple(0.1 + i / 20 for i in range(tokens)), tokens, text=text,
                        usage={"speculative": {"by_proposer": {"forced": {"proposed": 4, "accepted": 4}}}})


def _value(rows, metric: str) -> float:
    return next(r.value for r in rows if r.metric == metric)


def test_an_output_cut_by_the_token_limit_is_counted_apart_from_schema_failures():
    timings = {mode: [_timing(FILM, 30), _timing(FILM[:10], 64)] for mode in MODES}
    rows = _table("constrained film split-2 0 ms", 0.0, SCHEMAS["film"], timings, [_timing("free", 30)] * 2, 64)
    assert _value(rows, "outputs that fail their schema") == 0
    assert _value(rows, "outputs cut by --tokens before they ended") == len(MODES)  # one a mode
    assert _value(rows, "outputs identical to no speculation (1 = yes)") == 1
    timings["forced"][0] = _timing(FILM.replace("thriller", "western"), 30)  # ended, but off its schema
    rows = _table("constrained film split-2 0 ms", 0.0, SCHEMAS["film"], timings, [_timing("free", 30)] * 2, 64)
    assert _value(rows, "outputs that fail their schema") == 1
    assert _value(rows, "outputs identical to no speculation (1 = yes)") == 0


def test_each_output_is_held_to_the_schema_its_rows_are_for():
    timings = {mode: [_timing(RECIPE, 30)] for mode in MODES}
    rows = _table("constrained recipe split-2 0 ms", 0.0, SCHEMAS["recipe"], timings, [_timing("free", 30)], 64)
    assert _value(rows, "outputs that fail their schema") == 0
    rows = _table("constrained film split-2 0 ms", 0.0, SCHEMAS["film"], timings, [_timing("free", 30)], 64)
    assert _value(rows, "outputs that fail their schema") == len(MODES)  # a recipe is no film
    nested = RECIPE.replace('"grams": 400', '"grams": 400, "cups": 2')  # a key the item's schema does not allow
    timings["draft"][0] = _timing(nested, 30)
    rows = _table("constrained recipe split-2 0 ms", 0.0, SCHEMAS["recipe"], timings, [_timing("free", 30)], 64)
    assert _value(rows, "outputs that fail their schema") == 1


def _goal(schema: str, delay: float) -> str:
    timings = {mode: [_timing(RECIPE, 30)] for mode in MODES}
    rows = _table("constrained", delay, SCHEMAS[schema], timings, [_timing("free", 30)], 64)
    return next(r.goal for r in rows if r.metric == "draft+forced tok/s (vs no speculation)")


def test_each_schema_holds_draft_and_forced_tokens_to_its_own_goal():
    assert (_goal("film", 0), _goal("film", 20), _goal("film", 50)) == (">= 1.0", ">= 1.5", ">= 1.5")
    assert (_goal("recipe", 0), _goal("recipe", 20), _goal("recipe", 50)) == (">= 1.0", ">= 1.8", ">= 1.8")
