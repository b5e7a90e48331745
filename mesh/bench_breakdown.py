"""`mesh bench --breakdown`: where a frame's time goes, read from the coordinator's /metrics.

Stages stamp queue, compute, codec and sample times on every frame; the coordinator adds its
own and derives wire time from the round trip (mesh/hop_timing.py). Here the counters are
read before and after a workload and divided by the frames it made. What a token costs a
stream beyond the frame's pipeline time is "outside": HTTP, SSE, detokenizing, scheduling.
Averages cover every frame of the run, the prompt's last prefill chunk included.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from mesh.hop_timing import PARTS, WIRE


@dataclass(frozen=True)
class Counters:
    frames: float
    seconds: dict[tuple[str, str], float]
    batch_rows: dict[str, float]


def scrape(url: str) -> Counters:
    frames, seconds, rows = 0.0, {}, {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == "meshpipe_frames_total":
                frames = sample.value
            elif sample.name == "meshpipe_hop_seconds_total":
                seconds[(sample.labels["stage"], sample.labels["part"])] = sample.value
            elif sample.name == "meshpipe_hop_batch_rows_total":
                rows[sample.labels["stage"]] = sample.value
    return Counters(frames, seconds, rows)


def measure(url: str, streams: int, run: Callable[[], int]) -> list[tuple[str, float]]:
    """Run the workload (it returns tokens generated); (what, value per frame) pairs, in order."""
    before = scrape(url)
    started = time.perf_counter()
    tokens = run()
    wall = time.perf_counter() - started
    after = scrape(url)
    frames = after.frames - before.frames
    if frames <= 0 or tokens <= 0:
        return []
    per_frame = {key: (after.seconds[key] - before.seconds.get(key, 0.0)) * 1e3 / frames
                 for key in after.seconds}
    stages = sorted({stage for stage, _ in per_frame if stage != WIRE[0]}, key=_stage_order)
    out = [(f"stage {stage} {part}", per_frame[(stage, part)]) for stage in stages for part in PARTS
           if per_frame.get((stage, part), 0.0) >= 0.0005]  # a part the stage never does is 0
    if WIRE in per_frame:
        out.append(("wire (round trip less the stages)", per_frame[WIRE]))
    pipeline = sum(per_frame.values())
    out.append(("pipeline total", pipeline))
    token_interval = wall * 1e3 * streams / tokens  # ms between one stream's tokens
    out.append(("outside the pipeline (HTTP, SSE, detokenize)", max(token_interval - pipeline, 0.0)))
    return [(f"{part} (ms/frame)", ms) for part, ms in out] + [
        (f"stage {stage} rows per decode", (after.batch_rows[stage] - before.batch_rows.get(stage, 0.0)) / frames)
        for stage in stages if stage in after.batch_rows]


def _stage_order(stage: str) -> int:
    return int(stage) if stage.isdigit() else 1 << 30
