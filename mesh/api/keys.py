"""API keys: `Authorization: Bearer KEY`, checked in constant time against every key.

With no key configured the API is open, as it always was. A route, page or event stream
that needs a key takes `ApiKeys.required` as a dependency; /health asks `admits` itself,
because it answers everyone, only in less detail.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

from starlette.requests import Request

from mesh.api.error import ApiError


class ApiKeys:
    """The keys a request may carry. Only their SHA-256 digests are kept: comparing digests
    of equal length leaks neither a key's length nor how much of it a guess got right."""

    def __init__(self, keys: Iterable[str] = ()) -> None:
        self._digests = tuple(hashlib.sha256(k.encode()).digest() for k in keys)

    def __bool__(self) -> bool:
        return bool(self._digests)

    def admits(self, authorization: str | None) -> bool:
        """Whether an Authorization header's bearer token is one of the keys (always, with none)."""
        if not self._digests:
            return True
        token = _bearer(authorization)
        # starlette decodes headers as latin-1: encoding back gives the bytes the client sent
        given = hashlib.sha256(token.encode("latin-1", errors="replace")).digest()
        matched = False
        for digest in self._digests:  # every key, whichever matches: the time says nothing
            matched |= hmac.compare_digest(digest, given)
        return matched and bool(token)

    async def required(self, request: Request) -> None:
        """The dependency: 401, in OpenAI's shape, unless the request carries a key."""
        header = request.headers.get("authorization")
        if self.admits(header):
            return
        if header is None:
            message = "this server needs an API key: send it as `Authorization: Bearer KEY`"
        elif not _is_bearer(header):  # a bare key, or Basic: the key may be right, the header is not
            message = "the Authorization header must use the Bearer scheme: 'Authorization: Bearer <key>'"
        else:
            message = "the API key is not valid for this server"
        raise ApiError(401, message, "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def _is_bearer(authorization: str) -> bool:
    return authorization.strip().partition(" ")[0].lower() == "bearer"


def _bearer(authorization: str | None) -> str:
    scheme, _, token = (authorization or "").strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""
