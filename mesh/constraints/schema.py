"""A JSON Schema made into an llguidance grammar, or a 400 saying where it is wrong.

Three checks, cheapest first, so a bad schema costs no grammar build: its size and nesting
(a pathological schema is refused before any work grows with it), the JSON Schema
meta-schema (an invalid schema names the path of the keyword at fault), and llguidance's
own validation (a feature it cannot constrain to is named, with where it is used).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import llguidance

from mesh.constraints.errors import ConstraintError

MAX_SCHEMA_BYTES = 64 * 1024
MAX_SCHEMA_DEPTH = 32
_UNIMPLEMENTED = re.compile(r'Unimplemented keys: \[(.*)\]')
_GRAMMAR_QUOTED = re.compile(r"\n +\d+ \|.*", re.DOTALL)  # llguidance quotes the grammar's lines from here on
_DATA = frozenset({"const", "enum", "default", "examples"})  # keywords whose values are data, not schemas


def schema_grammar(schema: Any, param: str) -> str:
    """The llguidance grammar of `schema`, checked for size, depth and validity; not yet
    checked against the vocabulary (`compile.compile_grammar` does that)."""
    if not isinstance(schema, dict | bool):
        raise ConstraintError(f"{param} must be a JSON Schema object", param)
    if (depth := _depth(schema)) > MAX_SCHEMA_DEPTH:  # first: measuring the size recurses
        raise ConstraintError(f"{param} nests {depth} levels deep; at most {MAX_SCHEMA_DEPTH} are accepted", param)
    size = len(json.dumps(schema))
    if size > MAX_SCHEMA_BYTES:
        raise ConstraintError(f"{param} is {size} bytes of JSON; at most {MAX_SCHEMA_BYTES} are accepted", param)
    _check_meta(schema, param)
    # JSON as OpenAI's models write it: one space after ':' and ',', nothing else between tokens.
    # Free whitespace would let a sampled run wander in newlines until max_tokens.
    return llguidance.LLMatcher.grammar_from_json_schema(
        schema if isinstance(schema, dict) else {} if schema else {"not": {}},
        overrides={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})


def explain(error: str, schema: Any, param: str) -> ConstraintError:
    """llguidance's refusal of a schema as a 400: an unsupported keyword is named with the
    first path that uses it, a regular expression it cannot parse with its path; never the
    grammar the schema was built into (a tool's error quotes it)."""
    found = _UNIMPLEMENTED.search(error)
    if found:
        keys = [k.strip().strip('"') for k in found.group(1).split(",") if k.strip()]
        where = next((p for k in keys for p in _paths_of(schema, k)), "")
        at = f" (at {param}{where})" if where else ""
        return ConstraintError(f"{param} uses {', '.join(map(repr, keys))}, which structured output does "
                               f"not support{at}", param)
    if "regex parse error" in error:
        bad = next(((where, regex, why) for where, regex in _regexes(schema) if (why := _regex_error(regex))), None)
        if bad is not None:
            where, regex, why = bad
            return ConstraintError(f"{param}{where}: {regex[:100]!r} is not a valid regular expression ({why})",
                                   param)
    return ConstraintError(f"{param} cannot be used for structured output: {_GRAMMAR_QUOTED.sub('', error)}", param)


def _regexes(value: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """Each regular expression in a schema, `pattern`'s and `patternProperties`' keys, with
    its path; a value the schema gives as data (`const`, `enum`, ...) holds none."""
    if isinstance(value, dict):
        if isinstance(value.get("pattern"), str):
            yield f"{path}.pattern", value["pattern"]
        if isinstance(value.get("patternProperties"), dict):
            yield from ((f"{path}.patternProperties[{k!r}]", k) for k in value["patternProperties"])
        for k, v in value.items():
            if k not in _DATA:
                yield from _regexes(v, f"{path}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _regexes(v, f"{path}[{i}]")


def _regex_error(regex: str) -> str | None:
    """Why llguidance cannot parse `regex` (its dialect is Rust's, not Python's), or None."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        llguidance.LLMatcher.grammar_from_json_schema({"type": "string", "pattern": regex}))
    if not is_error:
        return None
    reasons = [line[len("error: "):] for m in messages for line in m.splitlines() if line.startswith("error: ")]
    return reasons[-1] if reasons else "it cannot be parsed"


def _depth(schema: Any) -> int:
    """How deep containers nest, counted without recursion (a deep schema cannot overflow it)."""
    deepest, todo = 0, [(schema, 1)]
    while todo:
        value, depth = todo.pop()
        deepest = max(deepest, depth)
        if depth > MAX_SCHEMA_DEPTH:
            break
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        todo.extend((child, depth + 1) for child in children)
    return deepest


def _check_meta(schema: Any, param: str) -> None:
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    error = jsonschema.exceptions.best_match(validator(validator.META_SCHEMA).iter_errors(schema))
    if error is not None:
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path)
        raise ConstraintError(f"{param} is not a valid JSON Schema at {param}{where}: {error.message}", param)


def _paths_of(value: Any, key: str, path: str = "") -> Iterator[str]:
    """Where `key` is used as a keyword in the schema, shallowest first."""
    if isinstance(value, dict):
        if key in value:
            yield path + f".{key}"
        for k, v in value.items():
            yield from _paths_of(v, key, f"{path}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths_of(v, key, f"{path}[{i}]")
