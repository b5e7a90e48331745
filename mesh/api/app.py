"""The OpenAI-compatible HTTP API: /v1/models, /v1/chat/completions, /v1/completions, and
vLLM's tokenizer endpoints (mesh/api/tokenize.py).

Handlers never block the event loop: bodies are bounded before they are read, and parsing,
template rendering and tokenization run on a small thread pool. A request whose client goes
away stops at its next token, streaming or not, which frees its session on every stage.
Every response, errors included, is counted in /metrics, and no exception escapes a handler
(one that did would make the server drop the keep-alive connection).

The front door, outermost first: a web origin not allowed is refused (mesh/api/origins.py);
every /v1 path needs an API key when keys are set (mesh/api/keys.py), one with no route too,
and so do /metrics, /health's details and the web page's data (mesh/api/ui.py); a POST must
be JSON, sent uncompressed (mesh/api/media.py); then the body's size, and the time it may
take to arrive (mesh/api/reads.py, which bounds the head in the server before any of this).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mesh.api.body import parse_json, read_body
from mesh.api.error import ApiError
from mesh.api.keys import ApiKeys
from mesh.api.media import json_required
from mesh.api.origins import OriginGuard
from mesh.api.reads import BoundedBody, ReadLimits
from mesh.api.request import Prepared, prepare
from mesh.api.responder import Responder, as_api_error
from mesh.api.structured import constrain
from mesh.api.tokenize import tokenizer_router
from mesh.api.ui import Feed, ui_router
from mesh.backend import Backend
from mesh.observe.metrics import Metrics

DEFAULT_MAX_BODY = 4 << 20
_ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/models": "models"}
CLIENT_GONE = 499  # nginx's "client closed request": counted, never seen by anyone


@dataclass(frozen=True)
class Access:
    """Who may use the API. The default is open, as before keys existed."""

    api_keys: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] = ()  # web origins allowed to call from a browser; "*" any
    public_metrics: bool = False  # /metrics without a key even when keys are set


def build_app(backend: Backend, metrics: Metrics, max_body: int = DEFAULT_MAX_BODY,
              access: Access | None = None, ui: Feed | None = None, reads: ReadLimits | None = None) -> FastAPI:
    """The API; with `ui`, the web page of the mesh too (mesh/api/ui.py). `reads` bounds the
    time a body may take (the head is bounded in the server: mesh/api/reads.py)."""
    access = access or Access()
    app = FastAPI(title="meshpipe", docs_url=None, redoc_url=None, lifespan=_sampling(ui))
    app.add_middleware(BoundedBody, timeout_s=(reads or ReadLimits()).body_timeout_s)  # innermost: its 408 is counted
    app.add_middleware(OriginGuard, origins=access.cors_origins)
    app.add_middleware(_CountResponses, metrics=metrics)  # outermost: counts the guard's refusals too
    keys = ApiKeys(access.api_keys)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if _is_v1(request.url.path):  # no route matched (404, 405): the key still comes first
            try:
                await keys.required(request)
            except ApiError as refused:
                return error_response(refused)
        err = ApiError(exc.status_code, str(exc.detail), "not_found" if exc.status_code == 404 else "http_error")
        return error_response(err)

    @app.exception_handler(ApiError)
    async def api_error(_: Request, err: ApiError) -> JSONResponse:  # a dependency's refusal
        return error_response(err)

    app.include_router(_operations(backend, metrics, keys, access.public_metrics))
    app.include_router(_v1(backend, metrics, max_body), dependencies=[Depends(keys.required)])
    app.include_router(tokenizer_router(backend, max_body), dependencies=[Depends(keys.required)])
    if ui is not None:
        app.include_router(ui_router(ui, keys))
    return app


def _sampling(ui: Feed | None) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """The server's life: the page's snapshots are taken while it serves."""

    @contextlib.asynccontextmanager
    async def life(_: FastAPI) -> AsyncIterator[None]:
        if ui is not None:
            ui.start()
        try:
            yield
        finally:
            if ui is not None:
                await ui.stop()

    return life


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def _operations(backend: Backend, metrics: Metrics, keys: ApiKeys, public_metrics: bool) -> APIRouter:
    """/health for load balancers and `mesh status`, /metrics for Prometheus."""
    router = APIRouter()

    @router.get("/health")
    async def health(request: Request) -> JSONResponse:
        state = await backend.health()
        status = 200 if state.ok else 503
        if not keys.admits(request.headers.get("authorization")):
            return JSONResponse({"ok": state.ok}, status_code=status)  # the route and memory need the key
        return JSONResponse(state.model_dump(mode="json"), status_code=status)

    @router.get("/metrics", dependencies=[] if public_metrics else [Depends(keys.required)])
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    return router


def _v1(backend: Backend, metrics: Metrics, max_body: int) -> APIRouter:
    router = APIRouter(prefix="/v1")
    prompts = ThreadPoolExecutor(max_workers=2, thread_name_prefix="prompt")

    @router.get("/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [_model(backend)]}

    @router.get("/models/{name:path}", response_model=None)
    async def one_model(name: str) -> dict[str, Any] | JSONResponse:
        if name == backend.model_id:
            return _model(backend)
        # ascii(): whatever the path held, the echo is printable and encodes
        return error_response(ApiError(404, f"model {ascii(name)[:200]} does not exist; this server serves "
                                       f"{backend.model_id!a}", "model_not_found", "model"))

    async def generate(request: Request, chat: bool) -> Response:
        endpoint = "chat" if chat else "completions"
        try:
            raw = await read_body(request, max_body)
            loop = asyncio.get_running_loop()
            prepared = await loop.run_in_executor(prompts, _prepare, backend, raw, chat)
            if prepared.structure is not None:  # compiled in a worker thread, bounded in time
                generation = await constrain(backend.tok(), prepared.structure, prepared.generation)
                prepared = dataclasses.replace(prepared, generation=generation)
            return await _respond(request, Responder(backend, metrics, prepared, endpoint), prepared)
        except ClientDisconnect:  # hung up mid-body: the client's doing, never an internal error
            return Response(status_code=CLIENT_GONE)
        except ApiError as err:
            return error_response(err)
        except Exception as exc:  # noqa: BLE001 -- a bug: logged, counted, a 500 to the client, server on
            return error_response(as_api_error(exc, "req-" + uuid.uuid4().hex[:24], metrics))

    @router.post("/chat/completions", response_model=None, dependencies=[Depends(json_required)])
    async def chat(request: Request) -> Response:
        return await generate(request, chat=True)

    @router.post("/completions", response_model=None, dependencies=[Depends(json_required)])
    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    return router


def _model(backend: Backend) -> dict[str, Any]:
    return {"id": backend.model_id, "object": "model", "created": 0, "owned_by": "meshpipe"}


def _prepare(backend: Backend, raw: bytes, chat: bool) -> Prepared:
    return prepare(backend.tok(), backend.model_id, backend.ctx_per_session, parse_json(raw), chat,
                   backend.speculative_acceptance)


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
    """Counts every response to the API by endpoint and HTTP status, errors included; a
    response its client left before it ended (a stream, mostly) counts as 499."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = _endpoint(scope.get("path", "")) if scope["type"] == "http" else None
        if endpoint is None:
            return await self.app(scope, receive, send)
        status, ended, gone = 500, False, False

        async def receiving() -> Message:
            nonlocal gone
            message = await receive()
            gone = gone or message["type"] == "http.disconnect"
            return message

        async def sending(message: Message) -> None:
            nonlocal status, ended
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                ended = not message.get("more_body", False)
            await send(message)

        try:
            await self.app(scope, receiving, sending)
        finally:
            self.metrics.requests.labels(endpoint, str(CLIENT_GONE if gone and not ended else status)).inc()


def _is_v1(path: str) -> bool:
    """Whether `path` is the API's, whose every answer, even "no such path", needs the key:
    without one, which paths exist is nobody's business."""
    return path == "/v1" or path.startswith("/v1/")


def _endpoint(path: str) -> str | None:
    path = path.rstrip("/")
    return "models" if path.startswith("/v1/models/") else _ENDPOINTS.get(path)
