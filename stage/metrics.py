"""A stage's own /metrics (`mesh stage --metrics-listen HOST:PORT`): who claims it, the lanes
each claim holds and uses, and each loaded range's free lanes and engine time, for Prometheus.

The HTTP server runs on a thread of its own (prometheus_client's), so it never reads the
stage's state, which the event loop changes: the event loop writes a frozen reading once a
second (`StageExporter.refresh`), and a scrape reads the newest one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from stage.control import StageControl, split_endpoint

REFRESH_S = 1.0


@dataclass(frozen=True)
class Reading:
    claims: tuple[tuple[str, int, int], ...] = ()  # (coordinator, lanes granted, lanes in use)
    ranges: tuple[tuple[str, int, float], ...] = ()  # (range, lanes free, engine busy seconds)


def read(control: StageControl) -> Reading:
    """The stage as it stands; on the event loop."""
    infos = [lease.claim_info() for lease in control.leases.values()]
    return Reading(claims=tuple((i.coordinator_id, i.lanes, i.lanes_in_use) for i in infos),
                   ranges=tuple((str(h.key), len(h.free), h.batcher.busy_s) for h in control.hosting.ranges.values()))


class StageExporter(Collector):
    def __init__(self, control: StageControl) -> None:
        self.control = control
        self.reading = Reading()

    async def refresh(self) -> None:
        """Take a reading every REFRESH_S, until cancelled."""
        while True:
            self.reading = read(self.control)
            await asyncio.sleep(REFRESH_S)

    def collect(self) -> Iterator[Metric]:
        now = self.reading  # one reading for the whole scrape
        claims = GaugeMetricFamily("meshpipe_stage_claims", "coordinators holding a claim on this stage",
                                   value=len(now.claims))
        lanes = GaugeMetricFamily("meshpipe_stage_claim_lanes", "lanes granted to a coordinator's claim",
                                  labels=["coordinator"])
        used = GaugeMetricFamily("meshpipe_stage_claim_lanes_in_use", "a claim's lanes its open sessions hold",
                                 labels=["coordinator"])
        for coordinator, granted, in_use in now.claims:
            lanes.add_metric([coordinator], granted)
            used.add_metric([coordinator], in_use)
        free = GaugeMetricFamily("meshpipe_stage_range_free_lanes", "a loaded range's lanes granted to no claim",
                                 labels=["range"])
        busy = CounterMetricFamily("meshpipe_stage_range_busy_seconds", "engine time a loaded range has spent",
                                   labels=["range"])
        for name, lanes_free, busy_s in now.ranges:
            free.add_metric([name], lanes_free)
            busy.add_metric([name], busy_s)
        yield from (claims, lanes, used, free, busy)


def serve_metrics(listen: str, exporter: StageExporter) -> WSGIServer:
    """Serve the exporter's readings at http://`listen`/metrics; returns the server (`.shutdown()`)."""
    host, port = split_endpoint(listen, listening=True)
    registry = CollectorRegistry()
    registry.register(exporter)
    server, _ = start_http_server(port, addr=host, registry=registry)
    return server
