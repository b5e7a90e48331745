"""POST bodies must say they are JSON.

A web page can make a browser send text/plain, form data or an untyped body anywhere
without asking first; it cannot send application/json cross-site without a CORS preflight,
which only an allowed origin passes (mesh/api/origins.py). Refusing every other type (415)
closes that door even where Origin is missing, and answers a client that forgot the header
with what it forgot rather than a parse error.
"""

from __future__ import annotations

from starlette.requests import Request

from mesh.api.error import ApiError

JSON = "application/json"


async def json_required(request: Request) -> None:
    """The dependency: 415 in OpenAI's shape unless Content-Type is application/json
    (parameters such as `; charset=utf-8` allowed)."""
    sent = request.headers.get("content-type")
    if sent is not None and sent.split(";", 1)[0].strip().lower() == JSON:
        return
    got = "no Content-Type" if sent is None else f"Content-Type {ascii(sent)[:200]}"
    raise ApiError(415, f"the body must be JSON sent as Content-Type: {JSON}; got {got}",
                   "unsupported_media_type")
