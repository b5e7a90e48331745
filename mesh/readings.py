"""The coordinator's counters at one instant, read without asking any stage anything.

Everything here is in memory already: the hop sums the pipeline adds up per frame
(mesh/hop_timing.py), the stages' last Status replies, which the healer's liveness pings
refresh every second (mesh/healing.py), and the Prometheus counters the API keeps
(mesh/metrics.py). Two readings a while apart make the snapshot's rates (mesh/sampler.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from mesh.hop_timing import WIRE, HopTotals
from mesh.metrics import Metrics
from mesh.speculative.draft import DRAFT
from mesh.speculative.ngram import NGRAM

PROPOSERS = (DRAFT, NGRAM)


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
    value = metrics.registry.get_sample_value
    return Readings(
        at=time.monotonic(), generated=generated,
        stage_s=_stage_seconds(hops), frames=sum(hops.frames.values()),
        wire_s=sum(v for (_, stage, part), v in hops.seconds.items() if (stage, part) == WIRE),
        rows_sent=hops.rows_sent, rows_voided=hops.rows_voided, bytes_sent=hops.bytes_sent,
        ttft_sum=value("meshpipe_time_to_first_token_seconds_sum") or 0.0,
        ttft_count=value("meshpipe_time_to_first_token_seconds_count") or 0.0,
        prompt_tokens=value("meshpipe_prompt_tokens_total") or 0.0,
        prompt_cached=value("meshpipe_prompt_tokens_cached_total") or 0.0,
        proposers=tuple((name, _tally(metrics, name)) for name in PROPOSERS))


def _stage_seconds(hops: HopTotals) -> tuple[tuple[str, float], ...]:
    out: dict[str, float] = {}
    for (_, stage, _), seconds in hops.seconds.items():
        if stage != WIRE[0]:
            out[stage] = out.get(stage, 0.0) + seconds
    return tuple(sorted(out.items()))


def _tally(metrics: Metrics, name: str) -> Tally:
    value = metrics.registry.get_sample_value
    labels = {"proposer": name}
    return Tally(value("meshpipe_speculative_proposer_proposed_tokens_total", labels) or 0.0,
                 value("meshpipe_speculative_proposer_accepted_tokens_total", labels) or 0.0,
                 value("meshpipe_speculative_proposer_windows_total", labels) or 0.0)


def per_s(now: Readings, before: Readings | None, field: str) -> float:
    """The growth of a counter per second between two readings (0 with no earlier one)."""
    if before is None or now.at <= before.at:
        return 0.0
    return max(getattr(now, field) - getattr(before, field), 0) / (now.at - before.at)
