"""The mesh token on the gRPC control plane: every call must carry it."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

TOKEN_KEY = "x-mesh-token"


def token_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return ((TOKEN_KEY, token),) if token else ()


class TokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str) -> None:
        self.token = token.encode()

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "missing or wrong mesh token (x-mesh-token)")

        self.deny_unary: grpc.RpcMethodHandler[Any, Any] = grpc.unary_unary_rpc_method_handler(deny)
        self.deny_stream: grpc.RpcMethodHandler[Any, Any] = grpc.unary_stream_rpc_method_handler(deny)

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        sent = dict(details.invocation_metadata or ()).get(TOKEN_KEY, "")
        if hmac.compare_digest(str(sent).encode(), self.token):
            return await continuation(details)
        handler = await continuation(details)
        return self.deny_stream if handler and handler.response_streaming else self.deny_unary
