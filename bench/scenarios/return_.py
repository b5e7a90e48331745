"""`mesh bench --scenarios return`: split-3 without the draft, replies straight from the final stage
against relayed up the chain by stage 1, at each per-hop delay (the module's name ends in `_`:
`return` is a Python keyword)."""

from __future__ import annotations

import statistics

from bench.harness.client import stream_chat
from bench.harness.harness import Row, ServeOptions, Shared, serve


def rows(shared: Shared) -> list[Row]:
    setup, delays, prompts = shared.asked.setup, shared.asked.delays, shared.asked.prompts
    servers = {(d, relay): shared.stack.enter_context(serve(setup, shared.tmp, 3,
                                                            ServeOptions(delay_ms=d, relay=relay)))
               for d in delays for relay in (False, True)}
    tps: dict[tuple[float, bool], list[float]] = {key: [] for key in servers}
    for _ in range(shared.asked.args.repeats):
        for key, server in servers.items():
            tps[key] += [stream_chat(server.url, setup.model_id, p, setup.tokens).decode_tps for p in prompts]
    out = []
    for d in delays:
        relayed, direct = statistics.median(tps[(d, True)]), statistics.median(tps[(d, False)])
        out.append(Row(f"return split-3 {d:g} ms", "relayed replies decode tok/s", relayed,
                       samples=tps[(d, True)]))
        out.append(Row(f"return split-3 {d:g} ms", "direct return decode tok/s (vs relayed)", direct, relayed,
                       ">= 1.2" if d >= 20 else "", tps[(d, False)]))
    return out
