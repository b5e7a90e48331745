"""Why a grammar cannot be served: a 400 naming the parameter (and the schema path)."""

from __future__ import annotations

from config.errors import MeshpipeError


class ConstraintError(MeshpipeError, ValueError):
    """A response_format or tool schema this server cannot constrain to; HTTP 400 on `param`."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param
