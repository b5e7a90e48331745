"""Request bodies: bounded before they are read, parsed into clean Unicode."""

from __future__ import annotations

import json
import re
from typing import Any

from starlette.requests import Request

from mesh.api.error import ApiError, bad_request

_SURROGATE = re.compile("[\ud800-\udfff]")


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, or 413 as soon as it is known to exceed `limit` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(size, limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: int, limit: int) -> ApiError:
    return ApiError(413, f"the request body is at least {size} bytes; this server accepts at most "
                    f"{limit} (mesh serve --max-body-bytes)", "request_too_large")


def parse_json(raw: bytes) -> Any:
    """JSON from strict UTF-8, with every lone surrogate (legal in JSON escapes, not in
    Unicode) made U+FFFD."""
    try:
        # json.loads(bytes) would decode with "surrogatepass": encoded surrogates would get in
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"the body is not valid UTF-8: {exc.reason} at byte {exc.start}", None,
                          "invalid_encoding") from None
    try:
        data = json.loads(text.removeprefix("\ufeff"))  # a byte order mark, as json.loads(bytes) allowed
    except (ValueError, RecursionError) as exc:
        raise bad_request(f"the body is not valid JSON: {exc}", None, "invalid_json") from None
    if b"\\u" not in raw:
        return data  # a lone surrogate can only arrive as an escape
    try:
        return _clean(data)
    except RecursionError:
        raise bad_request("the body is nested too deeply", None, "invalid_json") from None


def _clean(value: Any) -> Any:
    if isinstance(value, str):
        return _SURROGATE.sub("\ufffd", value)
    if isinstance(value, list):
        return [_clean(v) for v in value]
    if isinstance(value, dict):
        return {_clean(k): _clean(v) for k, v in value.items()}
    return value
