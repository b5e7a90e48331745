"""Web pages: only the origins `--cors-origin` names may call the API from a browser.

A browser marks every cross-site request it sends with `Origin`; curl and the SDKs send
none. A page from any site may still *send* a request the browser calls simple (a POST of
text/plain, say): it cannot read the reply, but the server would spend its compute. So a
request whose Origin is not allowed is refused outright (403), before anything runs, and
an allowed one gets the CORS headers its browser needs, preflight included. No origin is
allowed unless named: CORS is off by default.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from starlette.datastructures import Headers, MutableHeaders
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from config.errors import MeshpipeError
from mesh.api.error import ApiError

ANY = "*"
METHODS = "GET, POST, OPTIONS"
ALWAYS_ALLOWED_HEADERS = ("Authorization", "Content-Type")
MAX_AGE_S = 600  # how long a browser may reuse a preflight's answer


class OriginError(MeshpipeError, ValueError):
    """A --cors-origin value that is not `*` or scheme://host[:port]."""


def origin(value: str) -> str:
    """A configured origin in the form browsers send it: scheme://host[:port], lower case."""
    if value == ANY:
        return ANY
    parts = urlsplit(value.strip().rstrip("/"))
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.path or parts.query or parts.fragment:
        raise OriginError(f"--cors-origin wants * or scheme://host[:port], as a browser sends it, got {value!r}")
    return f"{parts.scheme}://{parts.netloc}".lower()


class OriginGuard:
    """ASGI middleware: 403 for a request from an origin not allowed; CORS for one that is."""

    def __init__(self, app: ASGIApp, origins: tuple[str, ...]) -> None:
        self.app = app
        self.any = ANY in origins
        self.allowed = frozenset(origin(o) for o in origins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        sent = headers.get("origin")
        if sent is None:  # not from a browser page: curl, the SDKs, a load balancer
            return await self.app(scope, receive, send)
        if not self.any and sent.lower() not in self.allowed:
            return await _forbidden(sent)(scope, receive, send)
        if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
            return await self._preflight(sent, headers)(scope, receive, send)

        async def with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                out = MutableHeaders(scope=message)
                for name, value in self._allow(sent).items():
                    out.append(name, value)
                out.append("Access-Control-Expose-Headers", "Retry-After")
            await send(message)

        await self.app(scope, receive, with_cors)

    def _allow(self, sent: str) -> dict[str, str]:
        if self.any:
            return {"Access-Control-Allow-Origin": ANY}
        return {"Access-Control-Allow-Origin": sent, "Vary": "Origin"}

    def _preflight(self, sent: str, headers: Headers) -> Response:
        """The answer to a browser asking before its real request: the methods and headers
        it may send. Headers it asks for beyond the two the API reads (an SDK's own) are
        allowed too: from an allowed origin they change nothing the server does."""
        asked = [h.strip() for h in headers.get("access-control-request-headers", "").split(",") if h.strip()]
        wanted = {h.lower(): h for h in (*ALWAYS_ALLOWED_HEADERS, *asked)}
        allow = {**self._allow(sent), "Access-Control-Allow-Methods": METHODS,
                 "Access-Control-Allow-Headers": ", ".join(wanted.values()),
                 "Access-Control-Max-Age": str(MAX_AGE_S)}
        if not self.any:
            allow["Vary"] = "Origin, Access-Control-Request-Method, Access-Control-Request-Headers"
        return Response(status_code=204, headers=allow)


def _forbidden(sent: str) -> JSONResponse:
    err = ApiError(403, f"requests from the web origin {ascii(sent)[:200]} are not allowed here "
                   "(mesh serve --cors-origin names the origins that are)", "origin_not_allowed")
    return JSONResponse(err.body(), status_code=err.status)
