"""POST bodies must say they are JSON, and be sent uncompressed.

A web page can make a browser send text/plain, form data or an untyped body anywhere
without asking first; it cannot send application/json cross-site without a CORS preflight,
which only an allowed origin passes (mesh/api/origins.py). Refusing every other type (415)
closes that door even where Origin is missing, and answers a client that forgot the header
with what it forgot rather than a parse error.

A compressed body (Content-Encoding: gzip, ...) is refused too, naming the encoding: it would
otherwise be read as JSON and be "not valid UTF-8", and decoding it would let a small body
grow past the size limit (a zip bomb).
"""

from __future__ import annotations

from starlette.requests import Request

from mesh.api.error import ApiError

JSON = "application/json"


async def json_required(request: Request) -> None:
    """The dependency: 415 in OpenAI's shape unless Content-Type is application/json
    (parameters such as `; charset=utf-8` allowed) and the body is not encoded."""
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("identity", ""):
        raise ApiError(415, f"Content-Encoding {ascii(encoding)[:200]} is not supported; send the body "
                       "uncompressed", "unsupported_content_encoding")
    sent = request.headers.get("content-type")
    if sent is not None and sent.split(";", 1)[0].strip().lower() == JSON:
        return
    got = "no Content-Type" if sent is None else f"Content-Type {ascii(sent)[:200]}"
    raise ApiError(415, f"the body must be JSON sent as Content-Type: {JSON}; got {got}",
                   "unsupported_media_type")
