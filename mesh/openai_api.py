"""The OpenAI-compatible HTTP API: /v1/models, /v1/chat/completions, /v1/completions."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from mesh.backend import (
    Backend,
    GenerationRequest,
    GenerationStats,
    MeshUnavailable,
    RequestRejected,
    Sampled,
)
from mesh.metrics import Metrics
from mesh.tokenizer import TextStream
from stage.sampling import SamplingParams

log = logging.getLogger("meshpipe.api")


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str, param: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.code, self.param, self.kind = status, code, param, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param,
                          "code": self.code}}


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    ignore_eos: bool = False


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)


class CompletionRequest(_Common):
    prompt: str | list[str]


def build_app(backend: Backend, metrics: Metrics, max_body: int = 4 << 20) -> FastAPI:
    app = FastAPI(title="meshpipe", docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        message = f"invalid request: {first.get('msg', 'malformed body')}" + (f" ({param})" if param else "")
        return JSONResponse(ApiError(400, message, "invalid_request", param).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = ApiError(exc.status_code, str(exc.detail), "not_found" if exc.status_code == 404 else "http_error")
        return JSONResponse(err.body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def crashed(_: Request, exc: Exception) -> JSONResponse:
        log.exception("request failed")
        err = ApiError(500, f"internal error: {exc}", "internal_error", kind="server_error")
        return JSONResponse(err.body(), status_code=500)

    @app.get("/health")
    async def health() -> JSONResponse:
        state = await backend.health()
        return JSONResponse(state, status_code=200 if state.get("ok") else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": backend.model_id, "object": "model",
                                            "created": 0, "owned_by": "meshpipe"}]}

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(body: ChatRequest) -> Response:
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        prompt = backend.tokenize(backend.render_chat(messages), special=True)
        return await _serve(backend, metrics, body, prompt, chat=True)

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest) -> Response:
        text = body.prompt if isinstance(body.prompt, str) else _single(body.prompt)
        return await _serve(backend, metrics, body, backend.tokenize(text, special=False), chat=False)

    return app


def _single(prompts: list[str]) -> str:
    if len(prompts) != 1:
        raise ApiError(400, "exactly one prompt per request is supported", "invalid_prompt", "prompt")
    return prompts[0]


def _generation(backend: Backend, body: _Common, prompt: list[int]) -> GenerationRequest:
    if body.model != backend.model_id:
        raise ApiError(404, f"model '{body.model}' does not exist; this server serves "
                       f"'{backend.model_id}'", "model_not_found", "model")
    if body.n != 1:
        raise ApiError(400, "only n=1 is supported", "invalid_n", "n")
    room = backend.ctx_per_session - len(prompt)
    asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if asked is not None and asked <= 0:
        raise ApiError(400, "max_tokens must be a positive integer", "invalid_max_tokens", "max_tokens")
    max_tokens = room if asked is None else asked
    if room <= 0 or max_tokens > room:
        raise ApiError(400, f"this request needs {len(prompt)} prompt tokens + {max_tokens} "
                       f"completion tokens, but the context holds {backend.ctx_per_session}",
                       "context_length_exceeded", "messages")
    sampling = SamplingParams(body.temperature, body.top_p, body.top_k, body.seed or 0)
    return GenerationRequest(prompt, max_tokens, sampling, backend.eos_tokens(), body.ignore_eos)


async def _serve(backend: Backend, metrics: Metrics, body: _Common, prompt: list[int],
                 chat: bool) -> Response:
    endpoint = "chat" if chat else "completions"
    try:
        req = _generation(backend, body, prompt)
    except ApiError as err:
        metrics.requests.labels(endpoint, str(err.status)).inc()
        raise
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    run = _Run(backend, metrics, req, stops, chat, endpoint)
    if body.stream:
        await run.open()  # errors before the first byte still get a proper status code
        return StreamingResponse(run.sse(), media_type="text/event-stream")
    return JSONResponse(await run.whole())


class _Run:
    """One generation: tokens from the backend become text, stop strings are honoured."""

    def __init__(self, backend: Backend, metrics: Metrics, req: GenerationRequest,
                 stops: list[str], chat: bool, endpoint: str) -> None:
        self.backend, self.metrics, self.req, self.stops = backend, metrics, req, stops
        self.chat, self.endpoint = chat, endpoint
        self.stats = GenerationStats()
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.started = time.perf_counter()
        self.tokens: AsyncIterator[Sampled] | None = None
        self.first: Sampled | None = None
        self.stopped = False

    async def open(self) -> None:
        self.metrics.in_flight.inc()
        self.tokens = self.backend.generate(self.req, self.stats)
        try:
            self.first = await anext(self.tokens, None)
        except BaseException as exc:
            await self._finish(None)
            raise _as_api_error(exc) from None
        self.metrics.ttft.observe(time.perf_counter() - self.started)

    async def deltas(self) -> AsyncIterator[str]:
        assert self.tokens is not None
        stream, held = TextStream(self.backend), ""
        keep = max((len(s) for s in self.stops), default=1) - 1
        token = self.first
        while token is not None:
            held += stream.push(token.token)
            cut = _find_stop(held, self.stops)
            if cut is not None:
                held, self.stopped = held[:cut], True
                break
            if len(held) > keep:
                yield held[: len(held) - keep]
                held = held[len(held) - keep:]
            token = await anext(self.tokens, None)
        if not self.stopped:
            held += stream.flush()
        if held:
            yield held

    async def whole(self) -> dict[str, Any]:
        await self.open()
        status = "200"
        try:
            text = "".join([d async for d in self.deltas()])
        except BaseException as exc:
            err = _as_api_error(exc)
            status = str(err.status)
            raise err from None
        finally:
            await self._finish(status)
        choice: dict[str, Any] = {"index": 0, "finish_reason": self.finish_reason(), "logprobs": None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.backend.model_id, "choices": [choice],
                "usage": self.usage()}

    async def sse(self) -> AsyncIterator[str]:
        status = "200"
        try:
            if self.chat:
                yield _sse(self.chunk({"role": "assistant", "content": ""}, None))
            async for delta in self.deltas():
                yield _sse(self.chunk({"content": delta} if self.chat else delta, None))
            yield _sse(self.chunk({} if self.chat else "", self.finish_reason()))
            yield _sse({**self.chunk({} if self.chat else "", None), "choices": [], "usage": self.usage()})
        except Exception as exc:
            err = _as_api_error(exc)
            status = str(err.status)
            yield _sse(err.body())
        finally:
            await self._finish(status)
        yield "data: [DONE]\n\n"

    def chunk(self, delta: Any, finish: str | None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        choice["delta" if self.chat else "text"] = delta
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.backend.model_id, "choices": [choice]}

    def finish_reason(self) -> str:
        return "stop" if self.stopped else self.stats.finish_reason

    def usage(self) -> dict[str, Any]:
        s = self.stats
        usage: dict[str, Any] = {"prompt_tokens": s.prompt_tokens, "completion_tokens": s.completion_tokens,
                                 "total_tokens": s.prompt_tokens + s.completion_tokens}
        if s.speculative is not None:
            usage["speculative"] = s.speculative
        return usage

    async def _finish(self, status: str | None) -> None:
        """Always close the backend's generator: that frees the session on every stage."""
        if self.tokens is not None:
            tokens, self.tokens = self.tokens, None
            await tokens.aclose()  # type: ignore[attr-defined]
        self.metrics.in_flight.dec()
        if status is not None:
            self.metrics.requests.labels(self.endpoint, status).inc()
            self.metrics.prompt_tokens.inc(self.stats.prompt_tokens)
            self.metrics.generated.inc(self.stats.completion_tokens)
            self.metrics.latency.observe(time.perf_counter() - self.started)
            self.metrics.record_speculative(self.stats.speculative)


def _find_stop(text: str, stops: list[str]) -> int | None:
    hits = [text.find(s) for s in stops if s and s in text]
    return min(hits) if hits else None


def _as_api_error(exc: BaseException) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, MeshUnavailable):
        return ApiError(503, str(exc), "mesh_unavailable", kind="server_error")
    if isinstance(exc, RequestRejected):
        return ApiError(400, str(exc), "request_rejected")
    log.error("generation failed: %r", exc)
    return ApiError(500, f"internal error: {exc}", "internal_error", kind="server_error")


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"

