"""The route as `/health`, `mesh status` and the page show it: one line, and a row per stage.

They read the Route (routing's own record), so they live here rather than in mesh/reports/,
which sits below routing and holds only the records they fill (mesh/reports/health.py).
"""

from __future__ import annotations

import time

import psutil

from mesh.reports.health import ClaimHealth, StageHealth, StageState, TierHealth
from mesh.reports.hop_timing import HopTotals
from mesh.routing.route import RemoteStage, Route
from mesh.routing.stage_cost import cost_at, measured
from mesh.serving.pipeline import Pipeline
from proto import meshpipe_pb2 as pb
from stage.calibration import BATCH_ROWS
from stage.kv_tier import tier_stats


def describe(route: Route | None) -> str:
    if route is None or route.stage0 is None:
        return "none"
    r0 = route.stage0
    hops = [f"coordinator [{r0.start},{r0.end})"]
    hops += [f"{s.endpoint} [{s.range.start},{s.range.end})" for s in route.stages if s.range is not None]
    return " -> ".join(hops)


def stage_rows(route: Route | None, pipeline: Pipeline | None, engine0: str,
               hops: HopTotals | None = None) -> tuple[StageHealth, ...]:
    """Every stage's row, stage 0 (this process, running `engine0`) first."""
    if route is None or route.stage0 is None:
        return ()
    vm = psutil.virtual_memory()
    own = StageHealth(stage=0, endpoint="coordinator", start=route.stage0.start,
                      end=route.stage0.end, state="READY",
                      rss_bytes=psutil.Process().memory_info().rss,
                      mem_available_bytes=vm.available, status_at=time.time(),
                      busy_s=pipeline.core.batcher.busy_s if pipeline else None,
                      engine=engine0, kv_tier=tier_health(tier_stats(pipeline.core.tier.tier)
                                                          if pipeline and pipeline.core.tier else None))
    ready: StageState = "READY" if pipeline and not pipeline.broken else "BROKEN"
    rows = (own, *(_remote_row(i, s, ready, route.coordinator_id) for i, s in enumerate(route.stages, 1)))
    return tuple(row.model_copy(update={**_timing(route, hops, row.stage), **_parameters(route, row.stage)})
                 for row in rows)


def _parameters(route: Route, index: int) -> dict[str, int | None]:
    """A stage's parameters, all and active (fewer in a mixture of experts), as planned."""
    rng = route.stages[index - 1].range if index else route.stage0
    if rng is None or route.work is None:
        return {"parameters": None, "active_parameters": None}
    total, active = route.work.parameters(rng)
    return {"parameters": round(total), "active_parameters": round(active)}


def _timing(route: Route, hops: HopTotals | None, index: int) -> dict[str, float | None]:
    """A stage's predicted and measured time per decode, in ms, and its link's round trip."""
    stage = route.stages[index - 1] if index else None
    cal = stage.calibration if stage else route.calibration0
    rng = stage.range if stage else route.stage0
    seen = measured(hops, index) if hops is not None else None
    predicted = None
    if cal is not None and rng is not None and route.work is not None:
        predicted = cost_at(cal, seen.rows if seen else BATCH_ROWS).time(route.work.of(rng)) * 1e3
    return {"predicted_ms": predicted, "measured_ms": seen.time_s * 1e3 if seen else None,
            "link_ms": stage.ping_s * 1e3 if stage and stage.ping_s is not None else None}


def _remote_row(index: int, s: RemoteStage, ready: StageState, coordinator: str) -> StageHealth:
    """A stage as its last Status reply left it; a stage that stopped answering is UNREACHABLE."""
    claims = tuple(ClaimHealth(coordinator=c.coordinator_id, this=c.coordinator_id == coordinator,
                               start=c.layer_start, end=c.layer_end, lanes=c.lanes, lanes_in_use=c.lanes_in_use)
                   for c in (s.status.claims if s.status else ()))
    return StageHealth(stage=index, endpoint=s.endpoint,
                       start=s.range.start if s.range else None, end=s.range.end if s.range else None,
                       state=ready if s.reachable else "UNREACHABLE",
                       rss_bytes=s.status.rss_bytes if s.status else None,
                       mem_available_bytes=s.status.mem_available_bytes if s.status else None,
                       status_at=s.status_at, busy_s=s.status.busy_seconds if s.status else None,
                       engine=s.status.engine or None if s.status else None, claims=claims,
                       kv_tier=tier_health(s.status.kv_tier if s.status and s.status.HasField("kv_tier") else None))


def tier_health(st: pb.KvTierStats | None) -> TierHealth | None:
    if st is None:
        return None
    return TierHealth(hits=st.hits, misses=st.misses, ram_bytes=st.ram_bytes, disk_bytes=st.disk_bytes,
                      ram_limit=st.ram_limit, disk_limit=st.disk_limit)
