"""`mesh bench --breakdown`: where a frame's time goes, read from the coordinator's /metrics.

Stages stamp queue, compute, codec and sample times on every frame; the coordinator adds its
own and derives wire time from the round trip (mesh/reports/hop_timing.py). Here the counters are
read before and after a workload and divided by the frames it made. What a frame costs a
stream beyond its pipeline time is "outside": the draft's proposals, HTTP, SSE,
detokenizing, scheduling.
Frames are told apart by kind: a verify window's rows run in one decode at every stage, so
its rows per decode are about the window + 1, and it costs more than a plain decode frame.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.harness.harness import Row, Setup
from bench.harness.local_server import LocalServer
from bench.harness.streams import cycled, run_batches
from mesh.cli.bearer import auth_headers
from mesh.reports.hop_timing import PARTS, WIRE


@dataclass(frozen=True)
class Counters:
    frames: Mapping[str, float]  # kind -> frames
    seconds: Mapping[tuple[str, str, str], float]  # (kind, stage, part) -> s
    batch_rows: Mapping[tuple[str, str], float]  # (kind, stage) -> rows

    def since(self, before: Counters) -> dict[tuple[str, str, str], float]:
        """Seconds spent by (kind, stage, part) between `before` and these counters."""
        return {key: s - before.seconds.get(key, 0.0) for key, s in self.seconds.items()}


def scrape(url: str) -> Counters:
    frames: dict[str, float] = {}
    seconds: dict[tuple[str, str, str], float] = {}
    rows: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10,
                                                                         headers=auth_headers()).text):
        for sample in family.samples:
            labels = sample.labels
            if sample.name == "meshpipe_frames_total":
                frames[labels["kind"]] = sample.value
            elif sample.name == "meshpipe_hop_seconds_total":
                seconds[(labels["kind"], labels["stage"], labels["part"])] = sample.value
            elif sample.name == "meshpipe_hop_batch_rows_total":
                rows[(labels["kind"], labels["stage"])] = sample.value
    return Counters(MappingProxyType(frames), MappingProxyType(seconds), MappingProxyType(rows))


def measure(url: str, streams: int, run: Callable[[], int]) -> list[tuple[str, float]]:
    """Run the workload (it returns tokens generated); (what, value) pairs, in order.

    Per frame kind (decode, verify, prefill): ms per frame by stage and part, and the rows
    of the decodes that ran those frames; then the pipeline over all frames.
    """
    before = scrape(url)
    started = time.perf_counter()
    tokens = run()
    wall = time.perf_counter() - started
    after = scrape(url)
    frames = {k: n - before.frames.get(k, 0.0) for k, n in after.frames.items()}
    total = sum(frames.values())
    if total <= 0 or tokens <= 0:
        return []
    spent = after.since(before)
    per_row = compute_per_row(spent, after, before)
    out: list[tuple[str, float]] = []
    for kind in sorted(k for k, n in frames.items() if n > 0):
        out += _per_kind(kind, frames[kind], spent, per_row, after, before)
    out += row_ratios(per_row)
    pipeline = sum(spent.values()) * 1e3 / total
    frame_interval = wall * 1e3 * streams / total  # ms between one stream's frames
    return [*out, ("pipeline total, all frames (ms/frame)", pipeline),
            ("outside the pipeline (draft, HTTP, SSE, detokenize) (ms/frame)", max(frame_interval - pipeline, 0.0))]


def _per_kind(kind: str, frames: float, spent: dict[tuple[str, str, str], float],
              per_row: Mapping[tuple[str, str], float], after: Counters, before: Counters) -> list[tuple[str, float]]:
    ms = {(stage, part): seconds * 1e3 / frames for (k, stage, part), seconds in spent.items() if k == kind}
    stages = sorted({stage for stage, _ in ms if stage != WIRE[0]}, key=_stage_order)
    out = [(f"{kind} frames", frames)]
    out += [(f"{kind}: stage {stage} {part} (ms/frame)", ms[(stage, part)]) for stage in stages for part in PARTS
            if ms.get((stage, part), 0.0) >= 0.0005]  # a part the stage never does is 0
    if WIRE in ms:
        out.append((f"{kind}: wire, round trip less the stages (ms/frame)", ms[WIRE]))
    out.append((f"{kind}: pipeline (ms/frame)", sum(ms.values())))
    rows = {stage: n - before.batch_rows.get((k, stage), 0.0) for (k, stage), n in after.batch_rows.items()
            if k == kind}
    out += [(f"{kind}: stage {stage} rows per decode", rows[stage] / frames) for stage in stages if stage in rows]
    return out + [(f"{kind}: stage {stage} compute per row (ms)", per_row[(kind, stage)])
                  for stage in stages if (kind, stage) in per_row]


def compute_per_row(spent: Mapping[tuple[str, str, str], float], after: Counters,
                    before: Counters) -> dict[tuple[str, str], float]:
    """(kind, stage) -> ms of compute per row of the decodes that ran those frames. A decode's
    compute is stamped on every frame it ran, and so are its rows: per row, the sums give what
    one row of this kind cost, however frames were batched together."""
    per_row = {}
    for key, n in after.batch_rows.items():
        rows, compute = n - before.batch_rows.get(key, 0.0), spent.get((*key, "compute"))
        if rows > 0 and compute is not None:
            per_row[key] = compute * 1e3 / rows
    return per_row


def row_ratios(per_row: Mapping[tuple[str, str], float]) -> list[tuple[str, float]]:
    """A verify row's compute against a plain decode's, per stage, from the served path's
    own /metrics: the figure `python -m bench.row_cost` measures behind a bare stage core."""
    stages = sorted((stage for kind, stage in per_row if kind == "verify"), key=_stage_order)
    return [(f"stage {stage}: verify row / decode row, compute", per_row[("verify", stage)] / decode)
            for stage in stages if (decode := per_row.get(("decode", stage)))]


def _stage_order(stage: str) -> int:
    return int(stage) if stage.isdigit() else 1 << 30


def breakdown_rows(setup: Setup, servers: dict[int, LocalServer], prompts: list[str], streams: int) -> list[Row]:
    """One more pass per split server, one stream (and `streams` at once on split-2)."""
    units = [(f"split-{n}", server, 1) for n, server in servers.items()]
    if streams > 1 and 2 in servers:
        units.append((f"concurrency-{streams}", servers[2], streams))
    rows = []
    for unit, server, n in units:
        asked = cycled(prompts, max(n, len(prompts)))
        batches = [asked[i : i + n] for i in range(0, len(asked), n)]
        run = functools.partial(run_batches, server.url, setup, batches)
        rows += [Row(f"breakdown {unit}", what, value) for what, value in measure(server.url, n, run)]
    return rows
