"""The coordinator's counters at one instant, read without asking any stage anything.

Everything here is in memory already: the hop sums the pipeline adds up per frame
(mesh/reports/hop_timing.py), the stages' last Status replies, which the healer's liveness pings
refresh every second (mesh/routing/healing.py), and the Prometheus counters the API keeps
(mesh/observe/metrics.py). Two readings a while apart make the snapshot's rates (mesh/observe/sampler.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client.metrics import MetricWrapperBase

from mesh.observe.metrics import Metrics
from mesh.reports.hop_timing import WIRE, HopTotals
from mesh.speculative.proposers import counted

PROPOSERS = counted()  # mesh/speculative/proposers.py: every proposer a window controller sizes
PROPOSED = "meshpipe_speculative_proposer_proposed_tokens_total"
ACCEPTED = "meshpipe_speculative_proposer_accepted_tokens_total"
WINDOWS = "meshpipe_speculative_proposer_windows_total"


@dataclass(frozen=True)
class Tally:
    """A proposer's record since start, as /metrics counts it."""

    proposed: float = 0.0
    accepted: float = 0.0
    windows: float = 0.0


@dataclass(frozen=True)
class Readings:
    at: float  # monotonic
    generated: int  # tokens handed on
    stage_s: tuple[tuple[str, float], ...]  # (stage index, seconds of every frame's hops there)
    frames: int
    wire_s: float
    rows_sent: int
    rows_voided: int
    bytes_sent: int
    ttft_sum: float
    ttft_count: float
    prompt_tokens: float
    prompt_cached: float
    proposers: tuple[tuple[str, Tally], ...]

    @property
    def tally(self) -> Tally:
        """Every proposer's together."""
        t = [tally for _, tally in self.proposers]
        return Tally(sum(x.proposed for x in t), sum(x.accepted for x in t), sum(x.windows for x in t))


def read(hops: HopTotals, metrics: Metrics, generated: int) -> Readings:
    ttft, prompt = _samples(metrics.ttft), _samples(metrics.prompt_tokens)
    cached = _samples(metrics.prompt_cached)
    proposed, accepted = _samples(metrics.proposer_proposed), _samples(metrics.proposer_accepted)
    windows = _samples(metrics.proposer_windows)
    return Readings(
        at=time.monotonic(), generated=generated, stage_s=_stage_seconds(hops), frames=sum(hops.frames.values()),
        wire_s=sum(v for (_, stage, part), v in hops.seconds.items() if (stage, part) == WIRE),
        rows_sent=hops.rows_sent, rows_voided=hops.rows_voided, bytes_sent=hops.bytes_sent,
        ttft_sum=ttft.get(("meshpipe_time_to_first_token_seconds_sum", ""), 0.0),
        ttft_count=ttft.get(("meshpipe_time_to_first_token_seconds_count", ""), 0.0),
        prompt_tokens=prompt.get(("meshpipe_prompt_tokens_total", ""), 0.0),
        prompt_cached=cached.get(("meshpipe_prompt_tokens_cached_total", ""), 0.0),
        proposers=tuple((name, Tally(proposed.get((PROPOSED, name), 0.0), accepted.get((ACCEPTED, name), 0.0),
                                     windows.get((WINDOWS, name), 0.0))) for name in PROPOSERS))


def _samples(metric: MetricWrapperBase) -> dict[tuple[str, str], float]:
    """(sample name, proposer label or "") -> value, of one metric: collecting only the
    metrics read, not the whole registry, keeps a reading well under a millisecond."""
    return {(s.name, s.labels.get("proposer", "")): s.value for family in metric.collect() for s in family.samples}


def _stage_seconds(hops: HopTotals) -> tuple[tuple[str, float], ...]:
    out: dict[str, float] = {}
    for (_, stage, _), seconds in hops.seconds.items():
        if stage != WIRE[0]:
            out[stage] = out.get(stage, 0.0) + seconds
    return tuple(sorted(out.items()))


def per_s(now: Readings, before: Readings | None, field: str) -> float:
    """The growth of a counter per second between two readings (0 with no earlier one)."""
    if before is None or now.at <= before.at:
        return 0.0
    return max(getattr(now, field) - getattr(before, field), 0) / (now.at - before.at)
