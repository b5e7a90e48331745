"""The constraint core without a model (issue 27): mask packing and application at the
final stage, the guide's rollback and forced tokens, schema refusals, tool grammars and the
tool-call parser. The vocabulary is the tiny GGUF's bytes: token b + 3 is byte b."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from common.sampling import SamplingParams
from mesh.api.error import ApiError
from mesh.api.structured import structure
from mesh.api.tool_calls import is_text, parse_calls
from mesh.constraints.compile import Constraint, build
from mesh.constraints.errors import ConstraintError
from mesh.constraints.guide import Guide, frame_masks
from mesh.constraints.schema import explain, schema_grammar
from mesh.constraints.tools import Function, Marker, ToolFormat, tool_grammar
from stage.frames import FrameSampling, sampling_of
from stage.masks import apply_masks, mask_bytes, masks_problem, pack, unpack
from stage.sampling import sample_rows

SCHEMA = {"type": "object", "properties": {"a": {"enum": ["xy", "xz"]}}, "required": ["a"],
          "additionalProperties": False}
HERMES = ToolFormat("hermes", Marker("<tool_call>"), Marker("</tool_call>"))
BARE = ToolFormat("json", None, None)


def _bytes(text: str) -> list[int]:
    return [b + 3 for b in text.encode()]


def _allowed(mask: bytes, vocab: int) -> set[int]:
    return {int(t) for t in np.flatnonzero(unpack(mask, vocab))}


@pytest.fixture(scope="module")
def constraint(byte_tokenizer) -> Constraint:
    return build(byte_tokenizer, schema_grammar(SCHEMA, "s"), "json_schema", lambda e: explain(e, SCHEMA, "s"))


# -- masks at the final stage --------------------------------------------------------------


def test_a_mask_packs_and_unpacks_to_the_same_tokens():
    vocab = 70
    mask = pack([0, 5, 31, 32, 69], vocab)
    assert len(mask) == mask_bytes(vocab) == 12
    assert set(np.flatnonzero(unpack(mask, vocab))) == {0, 5, 31, 32, 69}


def test_masks_apply_per_row_and_a_free_row_is_untouched():
    logits = np.arange(20, dtype=np.float32).reshape(2, 10)
    out = apply_masks(logits, [pack([1, 2], 10), b""])
    assert np.isneginf(out[0]).sum() == 8
    assert out[0, 2] == 2
    assert np.array_equal(out[1], logits[1])
    assert np.isfinite(logits).all()  # the engine's logits are left as they were


def test_sampling_under_a_mask_composes_with_bias_and_logprobs():
    """The mask comes after logit_bias: a biased token the grammar refuses is never drawn,
    and the logprobs are those of the distribution drawn from."""
    logits = np.zeros((1, 10), dtype=np.float32)
    params = SamplingParams(logit_bias=((9, 50.0), (4, 1.0)), logprobs=3)
    [picked] = sample_rows(logits, params, 0, 1, masks=[pack([3, 4], 10)])
    assert picked.token == 4
    assert [t for t, _ in picked.top] == [4, 3]  # refused tokens are no alternatives
    assert sum(np.exp(lp) for _, lp in picked.top) == pytest.approx(1.0)
    seeded = SamplingParams(temperature=1.0, seed=5)
    draws = {sample_rows(logits, seeded, p, 1, masks=[pack([7], 10)])[0].token for p in range(20)}
    assert draws == {7}


def test_masks_travel_in_the_frame_and_are_checked_there():
    frame = FrameSampling.for_rows(SamplingParams(), (), [1, 2, 3], 3, [pack([1], 10), b"", pack([2], 10)])
    assert sampling_of_header(frame).masks == frame.masks
    assert frame.problem(10, 100, 3) is None
    assert "3 grammar masks for 2" in (frame.problem(10, 100, 2) or "")
    assert masks_problem([bytes(4)], 10, 1) is not None  # allows no token: nothing could be sampled
    assert masks_problem([b"\x01"], 10, 1) is not None  # the wrong size for the vocabulary


def sampling_of_header(frame: FrameSampling) -> FrameSampling:
    from proto import meshpipe_pb2 as pb

    wire = pb.FrameHeader(sampling=frame.to_wire())
    return sampling_of(pb.FrameHeader.FromString(wire.SerializeToString()))


# -- the guide at stage 0 -----------------------------------------------------------------


def test_forced_tokens_run_up_to_the_choice(constraint):
    guide = Guide(constraint)
    # (this SPM test vocabulary spells a space as llama.cpp's escaped U+2581, so the
    # comparison stops before the first space)
    assert bytes(t - 3 for t in guide.forced(100)[:5]) == b'{"a":'
    guide.sync(_bytes('{"a": "xy'))
    assert [t - 3 for t in guide.forced(100)] == list(b'"}')
    guide.sync(_bytes('{"a": "x'))
    assert guide.forced(100) == []  # y or z: a choice
    assert _allowed(guide.mask(), constraint.vocab) == set(_bytes("yz"))


def test_rollback_returns_the_matcher_to_the_committed_output(constraint):
    """A rejected window's drafts are rolled back: the masks after it are those of the
    committed output alone, whatever the drafts were."""
    guide = Guide(constraint)
    committed = _bytes('{"a": "x')
    masks = frame_masks(guide, [0, *committed, *_bytes('y"}')], 1, len(committed), [committed[-1], *_bytes('y"}')],
                        drafts=3)
    assert [_allowed(m, constraint.vocab) for m in masks[:3]] == \
        [set(_bytes("yz")), set(_bytes('"')), set(_bytes("}"))]
    assert guide.done
    guide.sync(committed)  # the window was rejected at its first draft
    assert not guide.done
    assert _allowed(guide.mask(), constraint.vocab) == set(_bytes("yz"))
    guide.sync([*committed, *_bytes("z")])  # the target's token instead
    assert _allowed(guide.mask(), constraint.vocab) == set(_bytes('"'))


def test_a_lookup_is_cut_at_its_first_illegal_token(constraint):
    guide = Guide(constraint)
    guide.sync(_bytes('{"a": "'))
    assert guide.legal(_bytes('xy"}')) == 4
    assert guide.legal(_bytes('xq"}')) == 1
    assert guide.consumed == _bytes('{"a": "')  # checking consumed nothing


# -- refusals -----------------------------------------------------------------------------


@pytest.mark.parametrize(("schema", "words"), [
    ({"type": "object", "properties": {"a": {"type": "strin"}}}, "at s.properties.a.type"),
    ({"type": "object", "properties": {"a": {"minLength": "x"}}}, "at s.properties.a.minLength"),
    ([1, 2], "must be a JSON Schema object"),
    ({"type": "object", "description": "x" * 70_000}, "bytes of JSON"),
])
def test_an_invalid_schema_is_refused_naming_where(schema, words):
    with pytest.raises(ConstraintError, match=words):
        schema_grammar(schema, "s")


def test_a_deep_schema_is_refused_before_any_work_grows_with_it():
    deep: dict = {}
    inner = deep
    for _ in range(100_000):  # deeper than Python's recursion: the check must not recurse
        inner["items"] = {}
        inner = inner["items"]
    with pytest.raises(ConstraintError, match="nests"):
        schema_grammar(deep, "s")


def test_an_unsupported_keyword_is_named_with_its_path(byte_tokenizer):
    schema = {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}
    with pytest.raises(ConstraintError, match=r"'not'.*at s\.properties\.a\.not"):
        build(byte_tokenizer, schema_grammar(schema, "s"), "json_schema", lambda e: explain(e, schema, "s"))


@pytest.mark.parametrize(("schema", "where", "why"), [
    ({"type": "object", "properties": {"x": {"type": "string", "pattern": "("}}}, ".properties.x.pattern: '('",
     "unclosed group"),
    ({"type": "object", "properties": {"c": {"const": {"pattern": "("}}, "y": {"pattern": "(?=a)"}}},
     ".properties.y.pattern: '(?=a)'", "look-around"),  # a const's "pattern" is data, not a regex
    ({"type": "object", "patternProperties": {"a[": {}}}, ".patternProperties['a[']: 'a['", "unclosed"),
])
def test_a_pattern_that_is_no_regex_is_named_by_its_path_not_the_grammar(byte_tokenizer, schema, where, why):
    tools = [{"type": "function", "function": {"name": "add"}},
             {"type": "function", "function": {"name": "f", "parameters": schema}}]
    asked = [(structure(byte_tokenizer, {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
                        None, None, None), "response_format.json_schema.schema"),
             (structure(byte_tokenizer, None, tools, "required", None), "tools[1].function.parameters")]
    for shape, path in asked:
        assert shape is not None
        with pytest.raises(ConstraintError) as err:
            build(byte_tokenizer, shape.grammar, shape.kind, shape.explain)
        message = str(err.value)
        assert message.startswith(f"{path}{where} is not a valid regular expression ("), message
        assert why in message
        assert "calls:" not in message
        assert "%json" not in message


# -- tools --------------------------------------------------------------------------------

FUNCTIONS = [Function("add", {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                              "additionalProperties": False})]
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": FUNCTIONS[0].parameters}}]


def _accepts(byte_tokenizer, grammar: str, text: str) -> bool:
    guide = Guide(build(byte_tokenizer, grammar, "tools", lambda e: ConstraintError(e, "tools")))
    tokens = _bytes(text)
    return guide.legal(tokens) == len(tokens) and guide.matcher.try_consume_tokens(tokens) == len(tokens) \
        and bool(guide.matcher.is_accepting())


def test_required_forces_a_call_matching_the_parameters(byte_tokenizer):
    grammar = tool_grammar(FUNCTIONS, "required", False, HERMES)
    assert _accepts(byte_tokenizer, grammar, '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>')
    assert not _accepts(byte_tokenizer, grammar, '<tool_call>\n{"name": "add", "arguments": {"a": "1"}}\n</tool_call>')
    assert not _accepts(byte_tokenizer, grammar, "hello")


def test_auto_allows_text_or_calls(byte_tokenizer):
    grammar = tool_grammar(FUNCTIONS, "auto", True, HERMES)
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    assert _accepts(byte_tokenizer, grammar, "hello <b>")
    assert _accepts(byte_tokenizer, grammar, f"{call}\n{call}")
    assert not _accepts(byte_tokenizer, grammar, '<tool_call>\n{"name": "sub"')


def test_auto_for_a_model_of_unknown_format_is_a_400_naming_it(byte_tokenizer):
    with pytest.raises(ApiError, match="tiny"):
        structure(byte_tokenizer, None, TOOLS, "auto", None)
    forced = structure(byte_tokenizer, None, TOOLS, "required", None)
    assert forced is not None
    assert forced.tools is not None
    assert forced.tools.format.begin is None  # a bare call object


@pytest.mark.parametrize(("spec", "param", "code"), [
    ({"schema": {"type": "object"}}, "response_format.json_schema.name", "missing_required_parameter"),
    ({"name": 5, "schema": {"type": "object"}}, "response_format.json_schema.name", "missing_required_parameter"),
    ("x", "response_format.json_schema", "invalid_request"),
])
def test_a_json_schema_without_a_name_is_a_400_naming_it(byte_tokenizer, spec, param, code):
    with pytest.raises(ApiError) as err:
        structure(byte_tokenizer, {"type": "json_schema", "json_schema": spec}, None, None, None)
    assert (err.value.status, err.value.param, err.value.code) == (400, param, code)


def test_a_json_schema_without_a_schema_holds_the_output_to_an_object(byte_tokenizer):
    """As OpenAI, `schema` may be left out: the output is still JSON, any object, never free text."""
    shape = structure(byte_tokenizer, {"type": "json_schema", "json_schema": {"name": "x"}}, None, None, None)
    assert shape is not None
    assert shape.kind == "json_schema"
    assert _accepts(byte_tokenizer, shape.grammar, '{"a": [1, "b"]}')
    assert not _accepts(byte_tokenizer, shape.grammar, "hello")
    assert not _accepts(byte_tokenizer, shape.grammar, "[1]")


@pytest.mark.parametrize(("choice", "param"), [("sometimes", "tool_choice"),
                                               ({"type": "function", "function": {"name": "sub"}}, "tool_choice")])
def test_a_bad_tool_choice_is_a_400(byte_tokenizer, choice, param):
    with pytest.raises(ApiError) as err:
        structure(byte_tokenizer, None, TOOLS, choice, None)
    assert err.value.param == param


@pytest.mark.parametrize(("names", "param", "words"), [
    (["get weather"], "tools.0.function.name", "not a function name"),
    (["add", "f.x"], "tools.1.function.name", "not a function name"),
    (["add", ""], "tools.1.function.name", "not a function name"),
    (["x" * 65], "tools.0.function.name", "not a function name"),
    (["名前"], "tools.0.function.name", "not a function name"),
    (["add", "sub", "add"], "tools.2.function.name", r"the name of tools\[0\] too"),
])
@pytest.mark.parametrize("choice", ["required", "none"])
def test_a_tool_name_openai_refuses_or_used_twice_is_a_400_naming_it(byte_tokenizer, names, param, words, choice):
    tools = [{"type": "function", "function": {"name": name}} for name in names]
    with pytest.raises(ApiError, match=words) as err:
        structure(byte_tokenizer, None, tools, choice, None)
    assert (err.value.status, err.value.param) == (400, param)
    ok = [{"type": "function", "function": {"name": name}} for name in ("a-b_C9", "x" * 64)]
    shape = structure(byte_tokenizer, None, ok, choice, None)
    assert (shape is None) == (choice == "none")  # "none" offers no tools, yet checks them


def test_the_parser_reads_calls_and_drops_a_call_cut_short():
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    content, calls = parse_calls(f"{call}\n{call}\n<tool_call>\n{{\"name\": \"ad", HERMES)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1})] * 2
    assert len({c.id for c in calls}) == 2
    assert parse_calls("just text", HERMES) == ("just text", [])
    assert parse_calls(f"text, then {call}", HERMES) == (f"text, then {call}", [])  # as auto's grammar reads it
    assert [is_text(s, HERMES) for s in ("<to", "<tool_call>\n{", "<b", "Hi", "")] == [False, False, True, True, False]
    content, calls = parse_calls('{"name": "add", "arguments": {"a": 2}}', BARE)
    assert content is None
    assert calls[0].arguments == '{"a": 2}'


def test_an_earlier_call_is_written_back_in_the_models_own_format():
    from mesh.api.tool_format import written_calls

    calls = [{"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]
    written = written_calls(calls, HERMES)
    assert written == '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    assert parse_calls(written, HERMES)[1][0].arguments == '{"a": 1}'  # it reads back as it was sent
    assert json.loads(written_calls(calls, None)) == calls  # no known format: OpenAI's JSON


def test_the_grammar_vocabulary_keeps_its_tokenizer_alive(byte_tokenizer):
    """llguidance's vocabulary points into the tokenizer's: the cache holds the tokenizer, so it
    is never freed under it, and no later tokenizer can find a freed one's id there (the bench
    segfaulted in compute_bitmask when a second tokenizer reused a first one's id)."""
    import gc
    import weakref

    from mesh.constraints.vocab import grammar_tokenizer
    from mesh.model.tokenizer import Tokenizer

    first = Tokenizer(Path(byte_tokenizer.llm.model_path), "tiny")
    built, alive = grammar_tokenizer(first), weakref.ref(first)
    del first
    gc.collect()
    kept = alive()
    assert kept is not None
    assert grammar_tokenizer(kept) is built
    assert grammar_tokenizer(Tokenizer(Path(byte_tokenizer.llm.model_path), "tiny")) is not built
