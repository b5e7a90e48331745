"""The web page of the mesh: `/` redirects to `/ui`, whose data comes from one event stream.

The page's files (mesh/ui/: HTML, CSS, JS) are static and hold nothing of the mesh, so they
are served to anyone, as a login page is. Everything the page shows comes from /ui/events
(a snapshot a second, mesh/observe/sampler.py) or /ui/snapshot (the latest one, for `mesh status
--watch`), and both need the API key when keys are set: the page asks for it, keeps it in
the tab's sessionStorage and reads the stream with fetch() and an Authorization header
(EventSource cannot send one). No cookie is involved, so another site's page can make the
browser send nothing that counts. Every route here is a GET that reads: nothing a browser
asks of them makes the server generate.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from importlib import resources
from typing import Protocol

from fastapi import APIRouter, Depends
from fastapi.responses import RedirectResponse, Response, StreamingResponse

from mesh.api.error import ApiError
from mesh.api.keys import ApiKeys
from mesh.reports.snapshot import Snapshot

MAX_STREAMS = 64  # open event streams; one more gets 503: each holds a socket and a task
ASSETS = {"ui.css": "text/css", "ui.js": "text/javascript"}
# the page runs only its own script and talks only to its own server; no other site may frame it
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


class Feed(Protocol):
    """The snapshots (mesh/observe/sampler.py)."""

    snapshot: Snapshot | None
    watchers: int

    def start(self) -> None: ...

    async def stop(self) -> None: ...

    def events(self) -> AsyncIterator[bytes]: ...


def ui_router(feed: Feed, keys: ApiKeys) -> APIRouter:
    router = APIRouter()
    page = _asset("index.html")

    @router.get("/", include_in_schema=False)
    async def root() -> RedirectResponse:
        return RedirectResponse("/ui", status_code=307)

    @router.get("/ui")
    async def ui() -> Response:
        return Response(page, media_type="text/html; charset=utf-8", headers=PAGE_HEADERS)

    @router.get("/ui/static/{name}")
    async def static(name: str) -> Response:
        if name not in ASSETS:
            raise ApiError(404, "no such file", "not_found")
        return Response(_asset(name), media_type=ASSETS[name], headers=PAGE_HEADERS)

    @router.get("/ui/snapshot", dependencies=[Depends(keys.required)])
    async def snapshot() -> Response:
        if feed.snapshot is None:
            raise ApiError(503, "no snapshot yet: the mesh is starting", "starting")
        return Response(feed.snapshot.model_dump_json(), media_type="application/json",
                        headers={"Cache-Control": "no-store"})

    @router.get("/ui/events", dependencies=[Depends(keys.required)])
    async def events() -> StreamingResponse:
        if feed.watchers >= MAX_STREAMS:
            raise ApiError(503, f"{MAX_STREAMS} event streams are open already", "too_many_streams",
                           headers={"Retry-After": "5"})
        # Starlette cancels the generator when its client goes: `events` counts it out
        return StreamingResponse(feed.events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

    return router


def _asset(name: str) -> bytes:
    return resources.files("mesh.ui").joinpath(name).read_bytes()
