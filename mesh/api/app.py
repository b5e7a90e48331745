"""The OpenAI-compatible HTTP API: /v1/models, /v1/chat/completions, /v1/completions.

Handlers never block the event loop: bodies are bounded before they are read, and parsing,
template rendering and tokenization run on a small thread pool. A request whose client goes
away stops at its next token, streaming or not, which frees its session on every stage.
Every response, errors included, is counted in /metrics, and no exception escapes a handler
(one that did would make the server drop the keep-alive connection).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mesh.api.body import parse_json, read_body
from mesh.api.error import ApiError
from mesh.api.request import Prepared, prepare
from mesh.api.responder import Responder, as_api_error
from mesh.backend import Backend
from mesh.metrics import Metrics

DEFAULT_MAX_BODY = 4 << 20
_ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/models": "models"}
CLIENT_GONE = 499  # nginx's "client closed request": counted, never seen by anyone


def build_app(backend: Backend, metrics: Metrics, max_body: int = DEFAULT_MAX_BODY) -> FastAPI:
    app = FastAPI(title="meshpipe", docs_url=None, redoc_url=None)
    app.add_middleware(_CountResponses, metrics=metrics)
    prompts = ThreadPoolExecutor(max_workers=2, thread_name_prefix="prompt")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = ApiError(exc.status_code, str(exc.detail), "not_found" if exc.status_code == 404 else "http_error")
        return JSONResponse(err.body(), status_code=exc.status_code)

    @app.get("/health")
    async def health() -> JSONResponse:
        state = await backend.health()
        return JSONResponse(state.model_dump(mode="json"), status_code=200 if state.ok else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": backend.model_id, "object": "model",
                                            "created": 0, "owned_by": "meshpipe"}]}

    async def generate(request: Request, chat: bool) -> Response:
        endpoint = "chat" if chat else "completions"
        try:
            raw = await read_body(request, max_body)
            loop = asyncio.get_running_loop()
            prepared = await loop.run_in_executor(prompts, _prepare, backend, raw, chat)
            return await _respond(request, Responder(backend, metrics, prepared, endpoint), prepared)
        except ApiError as err:
            return JSONResponse(err.body(), status_code=err.status)
        except Exception as exc:  # noqa: BLE001 -- a bug: one line in the log, a 500 to the client, server on
            crash = as_api_error(exc)
            return JSONResponse(crash.body(), status_code=crash.status)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(request: Request) -> Response:
        return await generate(request, chat=True)

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    return app


def _prepare(backend: Backend, raw: bytes, chat: bool) -> Prepared:
    return prepare(backend.tok(), backend.model_id, backend.ctx_per_session, parse_json(raw), chat)


async def _respond(request: Request, run: Responder, prepared: Prepared) -> Response:
    if prepared.stream:
        await run.open()  # errors before the first byte still get a proper status code
        # Starlette cancels the stream when the client goes: the generator's cleanup frees it.
        return StreamingResponse(run.sse(), media_type="text/event-stream")
    body = await _unless_client_leaves(request, run.whole())
    return JSONResponse(body) if body is not None else Response(status_code=CLIENT_GONE)


async def _unless_client_leaves(request: Request, work: Awaitable[dict[str, Any]]) -> dict[str, Any] | None:
    """Await `work`, cancelling it (and returning None) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return None if task.cancelled() else task.result()


async def _disconnected(receive: Callable[[], Awaitable[Message]]) -> None:
    # The body is already read, so the next message the server has for us is the disconnect.
    while (await receive())["type"] != "http.disconnect":
        pass


class _CountResponses:
    """Counts every response to the API by endpoint and HTTP status, errors included."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = _ENDPOINTS.get(scope.get("path", "").rstrip("/")) if scope["type"] == "http" else None
        if endpoint is None:
            return await self.app(scope, receive, send)
        status = 500

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            self.metrics.requests.labels(endpoint, str(status)).inc()
