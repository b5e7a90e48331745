"""`mesh bench --scenarios machines`: what a split costs a token, part by part (issue 42).

Split-2 against meshpipe on one node, no draft, every stage on a core of its own (always with
--machines): both decode the same prompts, their repeats interleaved, and each server's
/metrics counters are read before and after. A token's time is then told apart, per token:
- engine: every stage's compute and sampling (for a split, the sum over its stages: two
  llama.cpp decodes a token where one node runs one);
- codec: encoding and decoding hidden states;
- queue: a frame waiting for a stage's engine thread;
- wire: the round trip less every stage's own time, that is the links and, on each side of
  them, the event loops and thread hand-offs that move a frame (loopback at 0 ms);
- outside the pipeline: the coordinator's work around a frame (the generate loop, HTTP, SSE,
  detokenizing), the token's whole time less all of the above.
The last rows are split-2's cost over one node, per token, part by part.
"""

from __future__ import annotations

import statistics

from bench.harness.breakdown import Counters, scrape
from bench.harness.client import stream_chat
from bench.harness.harness import Row, Setup, Shared
from bench.harness.local_server import LocalServer
from mesh.reports.hop_timing import WIRE

PARTS = ("engine", "codec", "queue", "wire", "outside the pipeline")
GOAL = ">= 0.95"  # issue 42's, split-2 over one node


def rows(shared: Shared) -> list[Row]:
    setup, servers = shared.asked.setup, shared.servers
    if setup.machines is None or not {1, 2} <= set(servers):
        return [Row("machines", "needs --machines and --stages 1,2 (skipped)", 0.0)]
    return machine_rows(setup, {1: servers[1], 2: servers[2]}, shared.asked.prompts, shared.asked.args.repeats)


def machine_rows(setup: Setup, servers: dict[int, LocalServer], prompts: list[str], repeats: int) -> list[Row]:
    for server in servers.values():  # a first request warms caches and is not counted
        stream_chat(server.url, setup.model_id, prompts[0], 4)
    before = {n: scrape(s.url) for n, s in servers.items()}
    tps: dict[int, list[float]] = {n: [] for n in servers}
    for rep in range(repeats):
        for n in (1, 2) if rep % 2 == 0 else (2, 1):
            tps[n] += [stream_chat(servers[n].url, setup.model_id, p, setup.tokens).decode_tps for p in prompts]
    per_token = {n: token_parts(before[n], scrape(s.url), 1e3 / statistics.median(tps[n]))
                 for n, s in servers.items()}
    out = [Row("machines", f"split-{n} decode tok/s", statistics.median(tps[n]), samples=tps[n]) for n in servers]
    out.append(Row("machines", "split-2 ÷ one node, decode tok/s", statistics.median(tps[2]),
                   statistics.median(tps[1]), GOAL))
    for n in servers:
        out += [Row(f"machines split-{n}", f"{part} (ms/token)", ms) for part, ms in per_token[n].items()]
    out += [Row("machines split cost", f"{part}: split-2 less one node (ms/token)", per_token[2][part] - ms)
            for part, ms in per_token[1].items()]
    return out


def token_parts(before: Counters, after: Counters, token_ms: float) -> dict[str, float]:
    """ms a token, by part, from the counters' decode frames (one frame a token without a draft);
    `token_ms`: the token's whole time, as the client saw it."""
    frames = after.frames.get("decode", 0.0) - before.frames.get("decode", 0.0)
    if frames <= 0:
        raise RuntimeError("machines: the server ran no decode frames")
    spent: dict[str, float] = dict.fromkeys(PARTS[:-1], 0.0)
    for (kind, stage, part), seconds in after.since(before).items():
        if kind != "decode":
            continue
        ms = seconds * 1e3 / frames
        name = "wire" if (stage, part) == WIRE else "engine" if part in ("compute", "sample") else part
        spent[name] += ms
    return {**spent, "total": token_ms, "outside the pipeline": token_ms - sum(spent.values())}
