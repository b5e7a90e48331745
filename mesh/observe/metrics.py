"""Prometheus metrics for the coordinator, on a registry of its own."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from mesh.backend import Acceptance, WindowChoice
from mesh.reports.failures import Failures
from mesh.reports.hop_timing import HopTotals
from mesh.reports.recovery import Recoveries
from mesh.serving.admission import Admission
from proto import meshpipe_pb2 as pb


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("meshpipe_requests", "HTTP requests", ["endpoint", "status"], registry=r)
        self.stream_errors = Counter("meshpipe_stream_errors", "streams that failed after their 200 began",
                                     ["endpoint", "status"], registry=r)
        # internal errors are counted once, in the record /health reads too (`watch_failures`):
        # the two cannot disagree on what they count
        self.failures = Failures()
        r.register(_FailureCollector(self))
        self.prompt_tokens = Counter("meshpipe_prompt_tokens", "prompt tokens processed", registry=r)
        self.prompt_cached = Counter("meshpipe_prompt_tokens_cached", "prompt tokens found in the KV "
                                     "(the prefix cache): reused, not prefilled", registry=r)
        self.prompt_prefilled = Counter("meshpipe_prompt_tokens_prefilled", "prompt tokens prefilled",
                                        registry=r)
        self.generated = Counter("meshpipe_generated_tokens", "tokens generated", registry=r)
        self.in_flight = Gauge("meshpipe_requests_in_flight", "requests being served", registry=r)
        self.latency = Histogram("meshpipe_request_seconds", "request latency", registry=r)
        self.ttft = Histogram("meshpipe_time_to_first_token_seconds", "time to first token",
                              registry=r)
        self.spec_windows = Counter("meshpipe_speculative_windows", "verify windows", registry=r)
        self.spec_proposed = Counter("meshpipe_speculative_proposed_tokens", "draft tokens proposed",
                                     registry=r)
        self.spec_accepted = Counter("meshpipe_speculative_accepted_tokens", "draft tokens accepted",
                                     registry=r)
        # the same by proposer ("draft", "ngram"); the totals above keep their unlabelled names
        self.proposer_proposed = Counter("meshpipe_speculative_proposer_proposed_tokens",
                                         "draft tokens proposed, by proposer", ["proposer"], registry=r)
        self.proposer_accepted = Counter("meshpipe_speculative_proposer_accepted_tokens",
                                         "draft tokens accepted, by proposer", ["proposer"], registry=r)
        self.proposer_windows = Counter("meshpipe_speculative_proposer_windows", "verify windows, by proposer",
                                        ["proposer"], registry=r)
        # and by acceptance rule ("exact", "rejection": DESIGN.md §6), requests with it too
        self.rule_proposed = Counter("meshpipe_speculative_rule_proposed_tokens",
                                     "draft tokens proposed, by acceptance rule", ["rule"], registry=r)
        self.rule_accepted = Counter("meshpipe_speculative_rule_accepted_tokens",
                                     "draft tokens accepted, by acceptance rule", ["rule"], registry=r)
        self.rule_requests = Counter("meshpipe_speculative_rule_requests", "requests speculated, by acceptance rule",
                                     ["rule"], registry=r)

    def record_prompt(self, tokens: int, cached: int) -> None:
        self.prompt_tokens.inc(tokens)
        self.prompt_cached.inc(cached)
        self.prompt_prefilled.inc(tokens - cached)

    def record_speculative(self, spec: Acceptance | None, rule: str = "") -> None:
        if spec is None:
            return
        if rule:
            self.rule_requests.labels(rule).inc()
            self.rule_proposed.labels(rule).inc(spec.proposed)
            self.rule_accepted.labels(rule).inc(spec.accepted)
        self.spec_windows.inc(spec.windows)
        self.spec_proposed.inc(spec.proposed)
        self.spec_accepted.inc(spec.accepted)
        for name, record in spec.by:
            self.proposer_proposed.labels(name).inc(record.proposed)
            self.proposer_accepted.labels(name).inc(record.accepted)
            self.proposer_windows.labels(name).inc(record.windows)

    def watch_failures(self, failures: Failures) -> None:
        """Count internal errors in the coordinator's record: the mesh's own, which /health
        reports, and the API's (`internal_error`), which then /health reports as well."""
        self.failures = failures

    def internal_error(self, request_id: str, exc: BaseException) -> None:
        """An internal error the API met outside the mesh (the mesh counts its own)."""
        self.failures.failed(request_id, exc)

    def watch_recoveries(self, recoveries: Recoveries) -> None:
        """Export route recoveries: how many, how long breaks went unnoticed and took to heal."""
        self.registry.register(_RecoveryCollector(recoveries))

    def watch_windows(self, choices: Callable[[], tuple[tuple[str, WindowChoice], ...]]) -> None:
        """Export what each cost-aware window controller chose and what it predicted."""
        self.registry.register(_WindowCollector(choices))

    def watch_hops(self, totals: HopTotals) -> None:
        """Export where frames spent their time: per stage and part, plus the wire."""
        self.registry.register(_HopCollector(totals))

    def watch_admission(self, admission: Admission) -> None:
        """Export the queue in front of the lanes: how many wait now, how long each waited."""
        self.registry.register(_AdmissionCollector(admission))

    def watch_kv_tier(self, stages: Callable[[], list[tuple[str, pb.KvTierStats]]], refills: Callable[[], int]
                      ) -> None:
        """Export each stage's KV tier (DESIGN.md §2): hits by tier, misses, bytes held, restore time."""
        self.registry.register(_TierCollector(stages, refills))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _FailureCollector:
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics  # read at each scrape: `watch_failures` may swap the record

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily("meshpipe_internal_errors", "requests that failed inside the server "
                                     "(HTTP 500), by the exception's class", labels=["cause"])
        for cause, count in sorted(self.metrics.failures.by_cause.items()):
            family.add_metric([cause], count)
        yield family


class _RecoveryCollector:
    def __init__(self, recoveries: Recoveries) -> None:
        self.r = recoveries

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily("meshpipe_recoveries", "route rebuilds after a break", value=self.r.count)
        yield CounterMetricFamily("meshpipe_sessions_resumed", "generations that went on through a rebuild",
                                  value=self.r.sessions)
        yield CounterMetricFamily("meshpipe_recovery_detect_seconds",
                                  "time breaks went unnoticed, summed", value=self.r.detect_s)
        yield CounterMetricFamily("meshpipe_recovery_resume_seconds",
                                  "time from a break to the new route, summed", value=self.r.resume_s)


class _AdmissionCollector:
    def __init__(self, admission: Admission) -> None:
        self.admission = admission

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("meshpipe_queue_depth", "requests waiting for a lane (mesh serve --max-queue)",
                                value=self.admission.waiting)
        waits = self.admission.waits
        buckets = [("+Inf" if b == float("inf") else repr(b), n) for b, n in waits.cumulative()]
        yield HistogramMetricFamily("meshpipe_queue_wait_seconds", "time admitted requests waited for a lane",
                                    buckets=buckets, sum_value=waits.total_s)


class _WindowCollector:
    GAUGES = (("window", "window", "drafts per verify window the controller chose (0: off)"),
              ("frames_in_flight", "depth", "verify frames in flight the controller chose"),
              ("predicted_tokens_per_second", "predicted_tok_s", "its predicted decode rate with that choice"),
              ("plain_tokens_per_second", "plain_tok_s", "the decode rate without speculation it weighs that against"))

    def __init__(self, choices: Callable[[], tuple[tuple[str, WindowChoice], ...]]) -> None:
        self.choices = choices

    def collect(self) -> Iterator[Metric]:
        made = self.choices()
        for name, field, doc in self.GAUGES:
            gauge = GaugeMetricFamily(f"meshpipe_speculative_{name}", doc, labels=["proposer"])
            for proposer, choice in made:
                gauge.add_metric([proposer], getattr(choice, field))
            yield gauge


class _HopCollector:
    def __init__(self, totals: HopTotals) -> None:
        self.totals = totals

    def collect(self) -> Iterator[Metric]:
        frames = CounterMetricFamily("meshpipe_frames", "frames that came back through the pipeline",
                                     labels=["kind"])
        for kind, count in sorted(self.totals.frames.items()):
            frames.add_metric([kind], count)
        seconds = CounterMetricFamily("meshpipe_hop_seconds", "frame time by frame kind, stage and part",
                                      labels=["kind", "stage", "part"])
        for key, value in sorted(self.totals.seconds.items()):
            seconds.add_metric(list(key), value)
        rows = CounterMetricFamily("meshpipe_hop_batch_rows", "rows of the decodes that ran the frames",
                                   labels=["kind", "stage"])
        for (kind, stage), count in sorted(self.totals.batch_rows.items()):
            rows.add_metric([kind, stage], count)
        yield frames
        yield seconds
        yield rows
        yield CounterMetricFamily("meshpipe_late_replies", "frames unanswered at their reply deadline while the "
                                  "stages kept working: waited for, not a break", value=self.totals.late_replies)


class _TierCollector:
    def __init__(self, stages: Callable[[], list[tuple[str, pb.KvTierStats]]], refills: Callable[[], int]) -> None:
        self.stages, self.refills = stages, refills

    def collect(self) -> Iterator[Metric]:
        hits = CounterMetricFamily("meshpipe_kv_tier_hits", "kept sequences loaded back into a lane, by stage "
                                   "and the tier they came from", labels=["stage", "tier"])
        misses = CounterMetricFamily("meshpipe_kv_tier_misses", "kept sequences asked for and not found whole",
                                     labels=["stage"])
        saved = CounterMetricFamily("meshpipe_kv_tier_saved", "sequences filed from a lane", labels=["stage"])
        held = GaugeMetricFamily("meshpipe_kv_tier_bytes", "bytes the tier holds, by stage and tier",
                                 labels=["stage", "tier"])
        restore = CounterMetricFamily("meshpipe_kv_tier_restore_seconds", "reading and loading kept sequences, "
                                      "summed", labels=["stage"])
        positions = CounterMetricFamily("meshpipe_kv_tier_restored_positions", "KV positions loaded back into "
                                        "lanes: restore seconds over these are its cost a token", labels=["stage"])
        save = CounterMetricFamily("meshpipe_kv_tier_save_seconds", "reading lanes out to file them, summed",
                                   labels=["stage"])
        for stage, st in self.stages():
            hits.add_metric([stage, "ram"], st.hits - st.hits_disk)
            hits.add_metric([stage, "disk"], st.hits_disk)
            misses.add_metric([stage], st.misses)
            saved.add_metric([stage], st.saved)
            held.add_metric([stage, "ram"], st.ram_bytes)
            held.add_metric([stage, "disk"], st.disk_bytes)
            restore.add_metric([stage], st.restore_seconds)
            positions.add_metric([stage], st.restored_positions)
            save.add_metric([stage], st.save_seconds)
        yield from (hits, misses, saved, held, restore, positions, save)
        yield CounterMetricFamily("meshpipe_kv_tier_refills", "requests prefilled again from position 0 because a "
                                  "stage could not restore what the tier was to give them", value=self.refills())
