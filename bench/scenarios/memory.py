"""`mesh bench --scenarios memory`: peak RSS of each stage process of each split, against the baseline's.

KV is lanes x ctx, so only a 1-lane run holds what the baseline holds (one sequence of the
same context): the split servers are read as they are (8 lanes), then a 1-lane server of
each split past 1, after one long prompt, is read and held to the goal.
"""

from __future__ import annotations

import httpx

from bench.harness.client import stream_chat
from bench.harness.harness import Baseline, Row, ServeOptions, Setup, Shared, serve, weight_share
from bench.harness.local_server import LocalServer, stage_pids
from bench.harness.prompts import long_prompt
from mesh.cli.bearer import auth_headers
from mesh.reports.health import Health
from mesh.reports.proc_memory import peak_rss


def rows(shared: Shared) -> list[Row]:
    setup = shared.asked.setup
    out = _memory_rows(setup, shared.base, shared.servers, lanes=8)
    one_lane = ServeOptions(lanes=1)
    single = {n: shared.stack.enter_context(serve(setup, shared.tmp, n, one_lane)) for n in shared.servers if n > 1}
    long = long_prompt(shared.base.tokenizer)
    for server in single.values():
        stream_chat(server.url, setup.model_id, long, setup.tokens)
    return out + _memory_rows(setup, shared.base, single, lanes=1)


def _memory_rows(setup: Setup, base: Baseline, servers: dict[int, LocalServer], lanes: int) -> list[Row]:
    """Peak RSS per stage process; the 1-lane run is held to the goal."""
    base_rss = float(base.ask({"memory": True})["peak_rss"])
    single = lanes == 1
    label = "1 lane, as the baseline" if single else f"{lanes} lanes"
    out = [] if single else [Row("memory", "baseline peak RSS (MB)", base_rss / 1e6, base_rss / 1e6)]
    for n, server in servers.items():
        if n == 1:
            continue
        stages = Health.model_validate_json(httpx.get(f"{server.url}/health", timeout=10,
                                                      headers=auth_headers()).content).stages
        pids = [server.process.pid, *stage_pids(server.process.pid)]
        for stage, pid in zip(stages, pids, strict=False):
            assert stage.start is not None
            assert stage.end is not None
            share = weight_share(setup.manifest, stage.start, stage.end)
            out.append(Row(f"split-{n} stage {stage.stage}", f"peak RSS (MB), {label}, layers "
                           f"[{stage.start},{stage.end}), weights {share / 1e6:.0f} MB",
                           peak_rss(pid) / 1e6, base_rss / 1e6,
                           f"<= {(share + 200e6) / 1e6:.0f} MB" if single else ""))
    return out

