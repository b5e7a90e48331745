"""`mesh stage`: a stage daemon serving StageControl over gRPC (grpc.aio on asyncio)."""

from __future__ import annotations

import asyncio
import logging
import signal
import ssl

import grpc

from proto import meshpipe_pb2_grpc as pb_grpc
from stage.control import StageControl, StageOptions, split_endpoint
from stage.grpc_auth import TokenInterceptor

log = logging.getLogger("meshpipe.stage")


async def run_stage(listen: str, options: StageOptions,
                    grpc_credentials: grpc.ServerCredentials | None = None) -> None:
    host, port = split_endpoint(listen, listening=True)
    interceptors = [TokenInterceptor(options.token)] if options.token else []
    server = grpc.aio.server(interceptors=interceptors)
    control = StageControl(options)
    pb_grpc.add_StageControlServicer_to_server(control, server)
    address = f"{host}:{port}"
    bound = (server.add_secure_port(address, grpc_credentials) if grpc_credentials
             else server.add_insecure_port(address))
    if bound == 0:
        raise OSError(f"cannot listen on {address}")
    await server.start()
    # The first stdout line is the contract with a parent `mesh serve --local-stages`.
    print(f"listening {host}:{bound}", flush=True)
    log.info("stage %s listening on %s:%d", control.stage_id, host, bound)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await control._unload()
    await server.stop(grace=1)


def server_credentials(cert: str, key: str) -> grpc.ServerCredentials:
    with open(cert, "rb") as c, open(key, "rb") as k:
        return grpc.ssl_server_credentials([(k.read(), c.read())])


def tls_contexts(cert: str | None, key: str | None, ca: str | None
                 ) -> tuple[ssl.SSLContext | None, ssl.SSLContext | None]:
    from stage.tls import client_context, server_context

    server = server_context(cert, key) if cert and key else None
    client = client_context(ca) if ca else None
    return server, client
