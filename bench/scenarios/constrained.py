"""`mesh bench --scenarios constrained`: JSON-schema output with and without speculation (issues 27, 42).

Two schemas: a film (several keys, an enum and an array of strings) and a recipe (an
integer, an enum, a bool and a list of objects, issue 42's nested case), each with its own
prompt, decoded on split-2 at each per-hop delay by four servers: no speculation, forced
tokens only, the draft, and the draft plus forced tokens. The same servers serve both schemas,
interleaved per repeat. Rows, per schema: tok/s against no speculation, no speculation against
the same number of free tokens (what the masks cost), the acceptance of each proposer, whether
every output holds to its schema and equals the one without speculation, and the mask cost per
token, timed by replaying the output through a matcher in this process (the server's matcher
does the same work on the same tokens).
"""

from __future__ import annotations

import json
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import jsonschema
import numpy as np

from bench.harness.client import StreamTiming, stream_messages
from bench.harness.harness import Asked, Outcome, Row, Setup, split2_per_delay
from bench.harness.report import proposer_totals
from bench.harness.workloads import RECIPE, RECIPE_PROMPT
from mesh.constraints.compile import build
from mesh.constraints.guide import Guide
from mesh.constraints.schema import explain, schema_grammar
from mesh.model.tokenizer import Tokenizer
from stage.masks import apply_masks

SCHEMA: dict[str, Any] = {
    "type": "object", "additionalProperties": False,
    "required": ["title", "genre", "year", "rating", "cast", "available"],
    "properties": {"title": {"type": "string", "maxLength": 40},
                   "genre": {"enum": ["drama", "comedy", "thriller", "documentary"]},
                   "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
                   "rating": {"type": "number"},
                   "cast": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 3},
                   "available": {"type": "boolean"}}}
PROMPT = "Describe a film you like as JSON: title, genre, year, rating, cast, available."



@dataclass(frozen=True)
class Schema:
    """One schema the scenario decodes: its name (the rows' label), the schema, its prompt and the
    goal for draft+forced over no speculation at 20 ms or more (below that, >= 1.0)."""

    name: str
    schema: dict[str, Any]
    prompt: str
    goal: str

    @property
    def messages(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": self.prompt}]

    @property
    def response_format(self) -> dict[str, Any]:
        return {"type": "json_schema", "json_schema": {"name": self.name, "schema": self.schema, "strict": True}}


SCHEMAS = {s.name: s for s in (Schema("film", SCHEMA, PROMPT, ">= 1.5"),
                               Schema("recipe", RECIPE, RECIPE_PROMPT, ">= 1.8"))}  # 1.8: issue 42's
Timings = dict[str, list[StreamTiming]]  # mode -> every request's timing, over all repeats
# mode -> serve() keywords; "none" first: the others are measured against it
NO_FORCED = ("--no-forced-drafts",)
MODES: dict[str, dict[str, Any]] = {
    "none": {"extra": NO_FORCED}, "forced": {}, "draft": {"draft": True, "extra": NO_FORCED},
    "draft+forced": {"draft": True}}


def constrained_rows(setup: Setup, delays: list[float], repeats: int) -> list[Row]:
    """One delay at a time, four split-2 servers each, serving every schema."""
    rows: list[Row] = []
    outputs: dict[str, list[str]] = {}
    for d, urls in split2_per_delay(setup, "mesh-bench-constrained-", delays, MODES):
        timings, free = _measure(setup, urls, repeats)
        for name, schema in SCHEMAS.items():
            rows += _table(f"constrained {name} split-2 {d:g} ms", d, schema, timings[name], free[name],
                           setup.tokens)
        # the last delay's outputs are replayed: greedy, every delay decodes the same ones
        outputs = {name: [t.text for t in timings[name]["none"]] for name in SCHEMAS}
    tok = Tokenizer(setup.gguf, setup.model_id)  # one for every schema's mask rows: loading one reads the vocabulary
    return rows + [row for name, texts in outputs.items() for row in _mask_rows(tok, SCHEMAS[name], texts)]


def _measure(setup: Setup, urls: dict[str, str], repeats: int
             ) -> tuple[dict[str, Timings], dict[str, list[StreamTiming]]]:
    """Every mode per repeat, in rotating order, each on every schema; then, per schema, as many
    free tokens without speculation."""
    timings: dict[str, Timings] = {name: defaultdict(list) for name in SCHEMAS}
    modes = list(urls)
    for rep in range(repeats):
        for mode in modes[rep % len(modes):] + modes[: rep % len(modes)]:
            for name, schema in SCHEMAS.items():
                timings[name][mode].append(stream_messages(
                    urls[mode], setup.model_id, schema.messages, setup.tokens, ignore_eos=False,
                    sampling={"response_format": schema.response_format}))
    free = {name: [stream_messages(urls["none"], setup.model_id, schema.messages, t.completion_tokens)
                   for t in timings[name]["none"]] for name, schema in SCHEMAS.items()}
    return timings, free


def _table(scenario: str, delay: float, schema: Schema, timings: Timings, free: list[StreamTiming],
           limit: int) -> list[Row]:
    tps = {mode: [t.decode_tps for t in ts] for mode, ts in timings.items()}
    med = {mode: statistics.median(v) for mode, v in tps.items()}
    goal = schema.goal if delay >= 20 else ">= 1.0"
    free_tps = [t.decode_tps for t in free]
    rows = [Row(scenario, "no speculation tok/s", med["none"], samples=tps["none"]),
            Row(scenario, "no speculation (vs the same tokens unconstrained)", med["none"],
                statistics.median(free_tps), ">= 0.95", free_tps)]
    for mode in ("forced", "draft", "draft+forced"):
        rows.append(Row(scenario, f"{mode} tok/s (vs no speculation)", med[mode], med["none"],
                        goal if mode == "draft+forced" else "", tps[mode]))
        for name, (p, a) in sorted(proposer_totals([t.usage.get("speculative", {}).get("by_proposer") or {}
                                                    for t in timings[mode]]).items()):
            rows.append(Row(scenario, f"{mode}: {name} accept rate ({p:g} proposed)", a / p if p else 0.0))
    # an output --tokens cut short is no failure of the grammar: it is counted apart
    ended = [t.text for ts in timings.values() for t in ts if t.completion_tokens < limit]
    cut = sum(len(ts) for ts in timings.values()) - len(ended)
    same = all(t.text == ref.text for ts in timings.values() for t, ref in zip(ts, timings["none"], strict=True))
    failed = sum(not _valid(o, schema.schema) for o in ended)
    return [*rows, Row(scenario, "outputs that fail their schema", float(failed), goal="0"),
            Row(scenario, "outputs cut by --tokens before they ended", float(cut)),
            Row(scenario, "outputs identical to no speculation (1 = yes)", float(same), goal="1")]


def _valid(text: str, schema: dict[str, Any]) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def _mask_rows(tok: Tokenizer, schema: Schema, outputs: list[str]) -> list[Row]:
    """The mask's cost per token: computed at stage 0 and applied at the final stage, for
    the outputs decoded on `schema`, replayed through a fresh matcher here."""
    constraint = build(tok, schema_grammar(schema.schema, "schema"), "json_schema",
                       lambda e: explain(e, schema.schema, "schema"))
    compute, applying, n = 0.0, 0.0, 0
    for text in outputs:
        guide = Guide(constraint)
        tokens = tok.tokenize(text, special=False, add_bos=False)
        masks = guide.row_masks([], tokens[:-1]) if tokens else []
        compute += guide.mask_s
        logits = np.zeros((1, tok.n_vocab), dtype=np.float32)
        began = time.perf_counter()
        for mask in masks:
            apply_masks(logits, [mask])
        applying += time.perf_counter() - began
        n += len(masks)
    per = 1e6 / max(n, 1)
    scenario = f"constrained {schema.name} mask cost"
    return [Row(scenario, "mask computed at stage 0, µs per token", compute * per),
            Row(scenario, "mask applied at the final stage, µs per token", applying * per)]


def run(asked: Asked) -> Outcome:
    return Outcome(constrained_rows(asked.setup, asked.delays, asked.args.repeats))
