"""One generation as OpenAI responses: tokens become text, stop strings are honoured, and the
result is one JSON body or a stream of server-sent events."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel

from common.sampling import Sampled
from mesh.api.error import ApiError
from mesh.api.request import Prepared
from mesh.api.responses import ChatCompletion, ChatDelta, Completion, Usage
from mesh.api.shape import Echo, ResponseShape
from mesh.api.stop_strings import find_stop, held_back
from mesh.api.tool_calls import ToolCall, is_text, parse_calls
from mesh.backend import (
    Account,
    Backend,
    Generation,
    MeshBusyError,
    MeshUnavailableError,
    PromptLogprobs,
    RequestRejectedError,
    RequestTimeoutError,
)
from mesh.constraints.tools import ToolFormat
from mesh.model.tokenizer import TextStream
from mesh.observe.metrics import Metrics
from mesh.reports.failures import InternalError

log = logging.getLogger("meshpipe.api")


class Responder:
    """One generation at the HTTP API: its tokens become text, stop strings are honoured, and
    it leaves as one JSON body or a stream of server-sent events."""

    def __init__(self, backend: Backend, metrics: Metrics, prepared: Prepared, endpoint: str) -> None:
        self.backend, self.metrics, self.p, self.endpoint = backend, metrics, prepared, endpoint
        self.id = ("chatcmpl-" if prepared.chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.started = time.perf_counter()
        self.events: Generation | None = None
        self.account = Account(len(prepared.generation.prompt), 0)  # the generation's, as last read
        self.first: Sampled | None = None
        self.stopped = False  # by a stop string, which the backend never sees
        self.scores: tuple[Sampled, ...] = ()  # the prompt's own logprobs, when echoed with logprobs
        self.shape = ResponseShape(backend, self.id, int(time.time()), prepared.chat,
                                   logprobs=prepared.generation.sampling.logprobs >= 0)

    async def open(self) -> None:
        """Start generating; errors before the first token raise here, with their status."""
        self.metrics.in_flight.inc()
        self.events = self.backend.generate(dataclasses.replace(self.p.generation, request_id=self.id))
        try:
            self.first = await self._next_token()
        except BaseException as exc:  # cancellation too: it must free the session, then go on
            await self._finish(failed=True, refused=isinstance(exc, RequestRejectedError | MeshBusyError))
            if isinstance(exc, Exception):
                raise as_api_error(exc, self.id, self.metrics) from None
            raise
        self.metrics.ttft.observe(time.perf_counter() - self.started)

    async def _next_token(self) -> Sampled | None:
        """The next token, past any other event; None when the generation is over."""
        assert self.events is not None
        try:
            while (event := await anext(self.events, None)) is not None:
                if isinstance(event, Sampled):
                    return event
                if isinstance(event, PromptLogprobs):
                    self.scores = event.scores
            return None
        finally:
            self.account = self.events.account

    async def deltas(self) -> AsyncIterator[tuple[str, list[Sampled]]]:
        """Text as it becomes final, with the tokens that made it."""
        stream, held, made = TextStream(self.backend.tok()), "", []
        step = self.first
        while step is not None:
            # `held` is only what may begin a stop string, and what came after it: all text
            # before it is out, and no stop string can begin there
            held += stream.push(step.token)
            made.append(step)
            cut = find_stop(held, self.p.stops)
            if cut is not None:
                held, self.stopped = held[:cut], True
                break
            keep = held_back(held, self.p.stops)
            if len(held) > keep:
                yield held[: len(held) - keep], made
                held, made = held[len(held) - keep:], []
            step = await self._next_token()
        if not self.stopped:
            held += stream.flush()
        if held or made:
            yield held, made

    async def whole(self) -> dict[str, Any]:
        await self.open()
        failed = True
        try:
            parts = [d async for d in self.deltas()]
            failed = False
        except Exception as exc:  # noqa: BLE001 -- every failure leaves as an API error with its status
            raise as_api_error(exc, self.id, self.metrics) from None
        finally:
            await self._finish(failed=failed)
        return self._body("".join(t for t, _ in parts), [s for _, made in parts for s in made]).model_dump()

    def _body(self, text: str, made: list[Sampled]) -> ChatCompletion | Completion:
        reason, usage = self.finish_reason(), self.usage()
        if not self.p.chat:
            return self.shape.completion_body(text, made, reason, usage, self._echo())
        content, calls = self._calls(text)
        reason = "tool_calls" if calls and reason == "stop" else reason
        return self.shape.chat_body(content, calls, made, reason, usage)

    async def sse(self) -> AsyncIterator[str]:
        failed = True
        try:
            if self.p.chat:
                yield _sse(self.shape.chunk("", role="assistant"))
            elif (echo := self._echo()) is not None:
                yield _sse(self.shape.echo_chunk(echo))
            if self._tools is not None:
                async for chunk in self._tool_chunks():
                    yield chunk
            else:
                async for text, made in self.deltas():
                    yield _sse(self.shape.chunk(text, made=made))
                yield _sse(self.shape.chunk(None, self.finish_reason()))
            if self.p.include_usage:
                yield _sse(self.shape.usage_chunk(self.usage()))
            failed = False
        except Exception as exc:  # noqa: BLE001 -- headers are sent: the error must go out as an event
            err = as_api_error(exc, self.id, self.metrics)
            self.metrics.stream_errors.labels(self.endpoint, str(err.status)).inc()
            yield _sse(err.body())
        finally:
            await self._finish(failed=failed)
        yield "data: [DONE]\n\n"

    def _echo(self) -> Echo | None:
        """The prompt the response begins with, when echoed; its logprobs came before any token."""
        if self.p.echo is None:
            return None
        return Echo(self.p.echo, self.p.generation.prompt, self.scores)

    @property
    def _tools(self) -> ToolFormat | None:
        s = self.p.structure
        return s.tools.format if s is not None and s.tools is not None else None

    def _calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The message's content and tool calls; all content when no tools were offered."""
        return (text, []) if self._tools is None else parse_calls(text, self._tools)

    async def _tool_chunks(self) -> AsyncIterator[str]:
        """A tool-offering stream: free text streams as content once it cannot be a call;
        calls are read whole (a call is known once its JSON closes), then leave as OpenAI
        streams them: per call its id and name, then its arguments."""
        assert self._tools is not None
        held, free = "", False
        async for text, _ in self.deltas():
            held += text
            if free or is_text(held, self._tools):
                yield _sse(self.shape.chunk(held))
                held, free = "", True
        content, calls = ("", []) if free else self._calls(held)
        if content:
            yield _sse(self.shape.chunk(content))
        for i, call in enumerate(calls):
            head = {"index": i, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
            yield _sse(self.shape.delta(ChatDelta(tool_calls=[head])))
            args = {"index": i, "function": {"arguments": call.arguments}}
            yield _sse(self.shape.delta(ChatDelta(tool_calls=[args])))
        reason = self.finish_reason()
        yield _sse(self.shape.chunk(None, "tool_calls" if calls and reason == "stop" else reason))

    def finish_reason(self) -> str:
        if self.stopped:
            return "stop"
        assert self.account.finish_reason is not None, "the generation ended without a reason"
        return self.account.finish_reason

    def usage(self) -> Usage:
        return Usage.of(self.account)

    async def _finish(self, failed: bool, refused: bool = False) -> None:
        """Always close the backend's generator: that frees the session on every stage."""
        try:
            if self.events is not None:
                events, self.events = self.events, None
                await events.aclose()
                self.account = events.account
        finally:  # a cleanup that fails or is cancelled again must not leave the request counted
            self.metrics.in_flight.dec()
        done = self.account
        if not refused:  # a refused prompt was never processed
            self.metrics.record_prompt(done.prompt_tokens, done.cached_tokens)
        self.metrics.generated.inc(done.completion_tokens)
        if not failed:
            self.metrics.latency.observe(time.perf_counter() - self.started)
        self.metrics.record_speculative(done.speculative, done.rule)


def as_api_error(exc: BaseException, request_id: str, metrics: Metrics) -> ApiError:
    """The API's answer to a failure: its status and OpenAI's error shape. An internal error
    is named by request id; one the mesh did not log and count already is logged here, with
    its traceback, and counted where the mesh counts its own (/health and /metrics read one
    record)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, MeshUnavailableError):
        return ApiError(503, str(exc), "mesh_unavailable", kind="server_error",
                        headers={"Retry-After": str(exc.retry_after_s)})
    if isinstance(exc, RequestRejectedError):
        return ApiError(400, str(exc), "request_rejected")
    if isinstance(exc, MeshBusyError):  # OpenAI's shape for a rate limit; clients honour Retry-After
        return ApiError(429, str(exc), "rate_limit_exceeded", kind="requests",
                        headers={"Retry-After": str(exc.retry_after_s)})
    if isinstance(exc, RequestTimeoutError):
        return ApiError(504, str(exc), "request_timeout", kind="server_error")
    if isinstance(exc, InternalError):  # the mesh logged it with its traceback and counted it
        return ApiError(500, str(exc), "internal_error", kind="server_error")
    log.error("request %s: internal error", request_id, exc_info=exc)
    metrics.internal_error(request_id, exc)
    return ApiError(500, f"internal error (request {request_id}, logged with its traceback): "
                    f"{type(exc).__name__}: {exc}", "internal_error", kind="server_error")


def _sse(payload: BaseModel | dict[str, Any]) -> str:
    # json.dumps keeps the bytes streams have always had; model_dump_json would save about
    # 3 µs a chunk (of 5-10 ms a token) but writes compact JSON
    body = payload.model_dump() if isinstance(payload, BaseModel) else payload
    return f"data: {json.dumps(body)}\n\n"
