"""`mesh stage`: a stage daemon serving StageControl over gRPC (grpc.aio on asyncio)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Iterator

import grpc

from proto import meshpipe_pb2_grpc as pb_grpc
from stage.announce import announced
from stage.control import StageControl, StageOptions, split_endpoint
from stage.grpc_auth import TokenInterceptor
from stage.metrics import StageExporter, serve_metrics
from stage.tls import add_port

log = logging.getLogger("meshpipe.stage")


async def run_stage(listen: str, options: StageOptions, announce: bool = False, metrics: str | None = None) -> None:
    """Serve until SIGINT/SIGTERM; `announce` also advertises the stage on the LAN meanwhile,
    and `metrics` (HOST:PORT) serves the stage's /metrics there (stage/metrics.py)."""
    host, port = split_endpoint(listen, listening=True)
    interceptors = [TokenInterceptor(options.token)] if options.token else []
    server = grpc.aio.server(interceptors=interceptors)
    control = StageControl(options)
    pb_grpc.add_StageControlServicer_to_server(control, server)
    address = f"{host}:{port}"
    bound = add_port(server, address, options.tls)
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
    async with contextlib.AsyncExitStack() as lan:
        if metrics:
            lan.enter_context(_exported(control, metrics))
        if announce:  # withdrawn first on stop, so nobody discovers a stage that is going away
            await lan.enter_async_context(announced(control.stage_id, options.advertise, bound, options.engine))
        await stop.wait()
    await control.close()
    await server.stop(grace=1)


@contextlib.contextmanager
def _exported(control: StageControl, listen: str) -> Iterator[None]:
    exporter = StageExporter(control)
    refresh = asyncio.get_running_loop().create_task(exporter.refresh())
    server = serve_metrics(listen, exporter)
    log.info("stage metrics at http://%s/metrics", listen)
    try:
        yield
    finally:
        server.shutdown()
        refresh.cancel()
