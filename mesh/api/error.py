"""The one error type the HTTP API answers with, in OpenAI's error shape."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from config.errors import MeshpipeError


class ApiError(MeshpipeError):
    def __init__(self, status: int, message: str, code: str, param: str | None = None,
                 kind: str = "invalid_request_error", headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.param, self.kind = status, code, param, kind
        self.headers = dict(headers or {})  # e.g. Retry-After on a 429, WWW-Authenticate on a 401

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: str | None, code: str = "invalid_request") -> ApiError:
    return ApiError(400, message, code, param)
