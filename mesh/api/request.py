"""OpenAI request bodies: validated strictly, refused clearly, made into a GenerationRequest.

Every field OpenAI defines is either implemented, accepted because it changes nothing here
(`user`, `metadata`, ...), or refused with a 400 naming it when set to anything but its
default. Unknown fields are refused too, as OpenAI does: nothing is silently ignored.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from common.sampling import AUTO, EXACT, REJECTION, SamplingParams
from mesh.api.error import ApiError, bad_request
from mesh.api.invalid import invalid_request
from mesh.api.structured import Structure, structure
from mesh.api.tool_format import tool_format, written_calls
from mesh.backend import GenerationRequest
from mesh.model.chat_tokens import chat_tokens
from mesh.model.tokenizer import PromptRefusedError, PromptTooLongError, Tokenizer

INT32_MAX = 2**31 - 1
MAX_STOPS = 16
MAX_LOGIT_BIAS = 300  # OpenAI's limit
COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat runs to the context
_DIGITS = re.compile("[0-9]+")  # ASCII only, unlike \d and str.isdigit()


class _Strict(BaseModel):
    # strict: as OpenAI, no "42" for 42 and no true for 1; an int is still a number. Python's
    # json reads NaN and Infinity (and 1e999 as inf): a number field is told it must be finite,
    # not that NaN is out of its range
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # nothing to obfuscate on a private server


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None


class _Common(_Strict):
    model: str
    max_tokens: int | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # -1 (vLLM) and 0 (llama.cpp) mean no limit
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    ignore_eos: bool | None = None
    best_of: int | None = None
    # meshpipe's extension: how drafts are accepted (DESIGN.md §6); unset, the server's default
    speculative_acceptance: Literal["exact", "rejection"] | None = None


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    web_search_options: dict[str, Any] | None = None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool | None = None
    suffix: str | None = None
    response_format: dict[str, Any] | None = None


# field -> is this value one we serve as asked? Anything else is a 400 naming the field.
_SUPPORTED_VALUES: dict[str, Callable[[Any], bool]] = {
    "n": lambda v: v in (None, 1),
    "best_of": lambda v: v in (None, 1),
    "suffix": lambda v: not v,
    "functions": lambda v: not v,
    "function_call": lambda v: v in (None, "none"),
    "store": lambda v: not v,
    "modalities": lambda v: v in (None, ["text"]),
    "audio": lambda v: v is None,
    "prediction": lambda v: v is None,
    "reasoning_effort": lambda v: v is None,
    "web_search_options": lambda v: v is None,
}
_REASONS = {
    "n": "only n=1 is supported",
    "best_of": "only best_of=1 is supported",
    "functions": "the legacy 'functions' is not supported; send 'tools'",
    "function_call": "the legacy 'function_call' is not supported; send 'tool_choice'",
    "store": "this server stores nothing",
}


@dataclass(frozen=True)
class Prepared:
    """A validated request, tokenized, ready to generate."""

    generation: GenerationRequest
    stops: tuple[str, ...]
    chat: bool
    stream: bool
    include_usage: bool
    structure: Structure | None = None  # a grammar to compile in before generating (mesh/api/structured.py)
    echo: str | None = None  # /v1/completions' echo: the prompt's text, which the response's text begins with


def prepare(tok: Tokenizer, model_id: str, ctx: int, data: Any, chat: bool, acceptance: str = AUTO) -> Prepared:
    """Blocking (template rendering, tokenization): run it off the event loop. `acceptance`:
    the server's rule for requests that name none (`AUTO`: exact for a seeded request,
    rejection sampling for an unseeded one)."""
    body = _validate(ChatRequest if chat else CompletionRequest, data)
    _refuse_unsupported(body)
    if body.model != model_id:
        raise ApiError(404, f"model '{body.model}' does not exist; this server serves '{model_id}'",
                       "model_not_found", "model")
    stops = _stops(body.stop)
    sampling = _sampling(body, tok.n_vocab, acceptance)
    shape = _structure(tok, body)
    where = "messages" if chat else "prompt"
    try:
        if isinstance(body, ChatRequest):
            messages = _messages(body.messages, tok)
            _json_asked(shape, [m["content"] for m in messages], where)
            if shape is not None and shape.tools is not None:
                messages = _offer(messages, shape.tools.message)
            prompt = chat_tokens(tok, messages, ctx)
        else:
            assert isinstance(body, CompletionRequest)
            prompt = _completion_prompt(tok, body.prompt, ctx)
            text = body.prompt if isinstance(body.prompt, str) else tok.detokenize(prompt).decode(errors="replace")
            _json_asked(shape, [text], where)
    except PromptTooLongError as exc:
        raise bad_request(str(exc), where, "context_length_exceeded") from None
    except PromptRefusedError as exc:
        raise bad_request(str(exc), where, "invalid_prompt") from None
    max_tokens = _max_tokens(body, len(prompt), ctx, where)
    stream = bool(body.stream)
    include_usage = bool(stream and body.stream_options and body.stream_options.include_usage)
    echo = _echo(tok, body, prompt)
    generation = GenerationRequest(prompt, max_tokens, sampling, tok.eos_tokens(), bool(body.ignore_eos),
                                   prompt_logprobs=echo is not None and sampling.logprobs >= 0)
    return Prepared(generation, stops, chat, stream, include_usage, shape, echo)


def _echo(tok: Tokenizer, body: _Common, prompt: list[int]) -> str | None:
    """The text an echoed prompt begins the response with: the prompt as sent, or its tokens' text."""
    if not isinstance(body, CompletionRequest) or not body.echo:
        return None
    one = _one_prompt(body.prompt)
    return one if isinstance(one, str) else tok.detokenize(prompt).decode(errors="replace")


def _structure(tok: Tokenizer, body: _Common) -> Structure | None:
    if isinstance(body, ChatRequest):
        shape = structure(tok, body.response_format, body.tools, body.tool_choice, body.parallel_tool_calls)
    else:
        assert isinstance(body, CompletionRequest)
        shape = structure(tok, body.response_format, None, None, None)
    if shape is not None and body.ignore_eos:
        raise bad_request("ignore_eos cannot be combined with structured output: the grammar ends the output",
                          "ignore_eos")
    return shape


def _json_asked(shape: Structure | None, texts: list[str], where: str) -> None:
    """OpenAI's rule for json_object, with its words: the prompt must ask for JSON. A model
    held to JSON it was not asked for writes whatever keeps it inside the grammar."""
    if shape is not None and shape.kind == "json_object" and not any("json" in t.lower() for t in texts):
        raise bad_request(f"'{where}' must contain the word 'json' in some form, to use 'response_format' of type "
                          "'json_object'.", where)


def _offer(messages: list[dict[str, Any]], offer: str) -> list[dict[str, Any]]:
    """The messages with the tools offered in the system message (a new one if there is none)."""
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{offer}"}, *messages[1:]]
    return [{"role": "system", "content": offer}, *messages]


# fields holding objects whose own fields a 400's `param` names
_NESTED = {"messages": frozenset(Message.model_fields), "stream_options": frozenset(StreamOptions.model_fields)}


def _validate(model: type[_Common], data: Any) -> _Common:
    if not isinstance(data, dict):
        raise bad_request("the body must be a JSON object", None)
    try:
        body = model.model_validate(data)
    except ValidationError as exc:
        raise invalid_request(exc, _NESTED) from None
    if body.stream_options is not None and body.stream is not True:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    return body


def _refuse_unsupported(body: _Common) -> None:
    for name in sorted(body.model_fields_set):
        accepts = _SUPPORTED_VALUES.get(name)
        if accepts is not None and not accepts(getattr(body, name)):
            reason = _REASONS.get(name, f"'{name}' is not supported")
            raise bad_request(f"{reason}; remove '{name}' from the request", name,
                              "unsupported_parameter")


def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOPS:
        raise bad_request(f"at most {MAX_STOPS} stop sequences are supported", "stop")
    if "" in stops:  # a client that sends one meant something; stopping nowhere is not it
        at = "stop" if isinstance(stop, str) else f"stop[{stops.index('')}]"
        raise bad_request(f"{at} is an empty string; a stop sequence holds at least one character",
                          at.replace("[", ".").rstrip("]"))
    return tuple(stops)


def _sampling(body: _Common, n_vocab: int, acceptance: str) -> SamplingParams:
    top_k = body.top_k or 0
    logprobs = -1
    if isinstance(body, ChatRequest) and body.logprobs:
        logprobs = body.top_logprobs or 0
    elif isinstance(body, ChatRequest) and body.top_logprobs is not None:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    elif isinstance(body, CompletionRequest) and body.logprobs is not None:
        logprobs = body.logprobs
    return SamplingParams(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=0 if top_k < 0 else min(top_k, INT32_MAX),  # past the vocabulary is no limit
        # no seed: a fresh draw, as OpenAI documents; any int64/uint64 seed maps onto uint64
        seed=secrets.randbits(64) if body.seed is None else body.seed % 2**64,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        logit_bias=_logit_bias(body.logit_bias, n_vocab),
        logprobs=logprobs,
        acceptance=_acceptance(body, acceptance),
    )


def _acceptance(body: _Common, default: str) -> str:
    """The request's rule, else the server's; AUTO keeps a seeded request's promise (the same
    output on any topology, with or without a draft) and samples the rest by rejection."""
    asked = body.speculative_acceptance or default
    if asked == AUTO:
        return EXACT if body.seed is not None else REJECTION
    return asked


def _logit_bias(bias: dict[str, float] | None, n_vocab: int) -> tuple[tuple[int, float], ...]:
    if len(bias or {}) > MAX_LOGIT_BIAS:
        raise bad_request(f"logit_bias holds at most {MAX_LOGIT_BIAS} tokens", "logit_bias")
    pairs = []
    for key, value in (bias or {}).items():
        token = _token_id(key, n_vocab)
        if token is None:
            raise bad_request(f"logit_bias key {key[:40]!r} is not a token id of this model "
                              f"(0..{n_vocab - 1})", "logit_bias")
        if not -100.0 <= value <= 100.0:
            raise bad_request(f"logit_bias[{key}] = {value} is outside [-100, 100]", "logit_bias")
        pairs.append((token, float(value)))
    return tuple(sorted(pairs))


def _token_id(key: str, n_vocab: int) -> int | None:
    """A token id written in ASCII digits alone: str.isdigit() would take "²" and "٣", and int()
    would take " 5 " (and refuse "²"); a key too long to be an id never reaches int()."""
    if not _DIGITS.fullmatch(key):
        return None
    digits = key.lstrip("0") or "0"
    return int(digits) if len(digits) <= len(str(n_vocab)) and int(digits) < n_vocab else None


def _messages(messages: list[Message], tok: Tokenizer) -> list[dict[str, Any]]:
    _tool_replies(messages)
    return [_message(i, m, tok) for i, m in enumerate(messages)]


def _tool_replies(messages: list[Message]) -> None:
    """As OpenAI, in its words (its spelling too: clients match them): a tool message names
    the call it answers, and an earlier assistant turn made that call. A reply to no call
    would reach the model as a result out of nowhere."""
    called: set[str] = set()
    for i, m in enumerate(messages):
        if m.role == "assistant":
            called |= {c["id"] for c in m.tool_calls or () if isinstance(c.get("id"), str)}
        elif m.role == "tool" and m.tool_call_id is None:
            raise bad_request("Missing parameter 'tool_call_id': messages with role 'tool' must have a "
                              "'tool_call_id'.", f"messages.{i}.tool_call_id", "missing_required_parameter")
        elif m.role == "tool" and m.tool_call_id not in called:
            raise bad_request("Invalid parameter: messages with role 'tool' must be a response to a preceeding "
                              "message with 'tool_calls'.", f"messages.{i}.role")


def _message(i: int, m: Message, tok: Tokenizer) -> dict[str, Any]:
    content = _content_text(i, m.content)
    if content is None and m.role != "assistant":
        raise bad_request(f"messages[{i}].content is required for role '{m.role}'",
                          f"messages.{i}.content")
    out = m.model_dump(exclude_none=True)
    out["content"] = content or ""
    if m.role == "developer":
        out["role"] = "system"  # OpenAI's new name for it; templates know "system"
    if m.tool_calls and "tool_calls" not in (tok.template or ""):
        # A template that cannot show tool calls would drop them: keep them as text.
        calls = written_calls(m.tool_calls, tool_format(tok))
        out["content"] = f"{out['content']}\n{calls}" if out["content"] else calls
    return out


def _content_text(i: int, content: str | list[dict[str, Any]] | None) -> str | None:
    if not isinstance(content, list):
        return content
    if not content:  # as OpenAI: an empty array is refused, not read as no content
        raise bad_request(f"messages[{i}].content is an empty array; send at least one content part, "
                          "or a string", f"messages.{i}.content")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type")
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        else:
            what = f"'{kind}' parts are not supported: this model reads text only" \
                if kind in ("image_url", "input_audio", "file") else \
                f"content part of type {kind!r} is not supported (text parts have 'type': 'text' and 'text')"
            raise bad_request(f"messages[{i}].content[{j}]: {what}", f"messages.{i}.content.{j}")
    return "\n".join(texts)


def _completion_prompt(tok: Tokenizer, prompt: str | list[str] | list[int] | list[list[int]],
                       ctx: int) -> list[int]:
    """A string, a list of token ids, or a batch of exactly one of either."""
    one = _one_prompt(prompt)
    if isinstance(one, str):
        # OpenAI accepts "": generation starts from the start of a text, which a model that adds
        # no BOS of its own (SmolLM2) would otherwise not see, leaving no token to start from
        return tok.tokenize(one, special=False, limit=ctx) or ([tok.bos] if tok.bos >= 0 else [])
    ids = [int(t) for t in one]
    if any(not 0 <= t < tok.n_vocab for t in ids):
        raise bad_request(f"the prompt holds token ids outside 0..{tok.n_vocab - 1}", "prompt")
    return ids


def _one_prompt(prompt: str | list[str] | list[int] | list[list[int]]) -> str | list[int]:
    """The request's one prompt, out of a batch of one."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list | str):
        if len(prompt) != 1:
            raise bad_request("exactly one prompt per request is supported", "prompt")
        return prompt[0]
    return prompt  # type: ignore[return-value]  # a list of ints, or a string


def _max_tokens(body: _Common, prompt: int, ctx: int, where: str) -> int:
    asked = body.max_tokens
    if isinstance(body, ChatRequest) and body.max_completion_tokens is not None:
        asked = body.max_completion_tokens
    # /v1/completions takes 0, as OpenAI's legacy API does: with echo and logprobs it scores a
    # prompt and generates nothing (lm-eval's loglikelihood); a chat has nothing to show for it
    least = 0 if isinstance(body, CompletionRequest) else 1
    if asked is not None and asked < least:
        raise bad_request(f"max_tokens must be an integer of at least {least}", "max_tokens", "invalid_max_tokens")
    if prompt == 0:
        raise bad_request("the prompt is empty", where, "invalid_prompt")
    room = ctx - prompt
    if room <= 0 and not (asked == 0 and room == 0):
        raise bad_request(f"the prompt is {prompt} tokens, and the context holds {ctx}: "
                          "no room is left to generate", where, "context_length_exceeded")
    if asked is None:
        return min(COMPLETIONS_MAX_TOKENS, room) if isinstance(body, CompletionRequest) else room
    if asked > room:
        raise bad_request(f"this request needs {prompt} prompt tokens + {asked} completion tokens, "
                          f"but the context holds {ctx}; ask for at most {room}", where,
                          "context_length_exceeded")
    return asked
