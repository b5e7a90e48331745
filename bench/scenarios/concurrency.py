"""`mesh bench --scenarios concurrency`: aggregate tok/s of split-2 at each --streams count.

Against split-1 on one CPU set when machines are emulated (--machines), else against one
stream; with the inter-token gaps and how busy split-2's stages are at the most streams.
"""

from __future__ import annotations

import statistics

from bench.harness.busy import busy_during, busy_rows
from bench.harness.harness import Row, Setup, Shared
from bench.harness.local_server import LocalServer
from bench.harness.streams import cycled, parallel


def rows(shared: Shared) -> list[Row]:
    asked = shared.asked
    if 2 not in shared.servers:
        return []
    one_set = shared.servers.get(1) if asked.setup.machines else None
    return _concurrency_rows(asked.setup, shared.servers[2], one_set, asked.prompts,
                             [int(s) for s in asked.args.streams.split(",")], asked.args.repeats)


def _concurrency_rows(setup: Setup, server: LocalServer, single: LocalServer | None, prompts: list[str],
                      streams: list[int], repeats: int) -> list[Row]:
    """Each server first runs one round unmeasured, so every measured round finds the prompts in
    the prefix cache: the steady state."""
    units = {"split-2": server, **({"split-1": single} if single else {})}
    agg: dict[tuple[str, int], list[float]] = {(u, n): [] for u in units for n in streams}
    gaps: dict[int, list[float]] = {n: [] for n in streams}
    for s in units.values():  # unmeasured: a server's first round prefills cold and runs 20-30% slower
        parallel(s.url, setup, cycled(prompts, max(streams)))
    for _ in range(repeats):
        for n in streams:
            for unit, s in units.items():
                total, wall, timings = parallel(s.url, setup, cycled(prompts, n))
                agg[(unit, n)].append(total / wall)
                gaps[n] += [g for t in timings for g in t.gaps()] if unit == "split-2" else []
    out = [row for n in streams for row in _rows_at(n, agg, gaps[n], single is not None, streams[0])]
    most = max(streams)
    _, busy = busy_during(server.url, lambda: parallel(server.url, setup, cycled(prompts, most)))
    return out + busy_rows(f"concurrency-{most}", f"split-2, {most} streams", busy)


def _rows_at(n: int, agg: dict[tuple[str, int], list[float]], gaps: list[float], single: bool,
             first: int) -> list[Row]:
    value, samples = statistics.median(agg[("split-2", n)]), agg[("split-2", n)]
    out = []
    if single:
        base = statistics.median(agg[("split-1", n)])
        out.append(Row(f"concurrency-{n}", "split-1 on one CPU set, aggregate tok/s", base,
                       samples=agg[("split-1", n)]))
        out.append(Row(f"concurrency-{n}", "split-2 aggregate tok/s (vs split-1)", value, base,
                       ">= 1.6" if n == 8 else "", samples))
    else:
        one = statistics.median(agg[("split-2", first)])
        out.append(Row(f"concurrency-{n}", "aggregate tok/s (vs 1 stream)", value, one,
                       ">= 3.0" if n == 8 else "", samples))
    q = statistics.quantiles(gaps, n=20)
    out.append(Row(f"concurrency-{n}", "inter-token p50 (ms)", statistics.median(gaps) * 1e3))
    out.append(Row(f"concurrency-{n}", "inter-token p95 (ms)", q[18] * 1e3))
    return out
