"""The router's Prometheus metrics, in a registry of its own (tests start several routers).

Per request, never per token: the inter-token latency of a request is counted into its own small
bucket array (:class:`TokenGaps`, one bisect per chunk) and added to the shared histogram once,
when the request ends; prometheus_client's ``observe`` takes a lock and walks the buckets for each
value, which a stream of hundreds of tokens paid for every one of them. Owner of every table
here: the router's event loop.

With ``--workers N`` every worker's metrics are kept in prometheus_client's multiprocess files
(:func:`share_between_workers`, in the directory the supervisor names in
``PROMETHEUS_MULTIPROC_DIR``), and whichever worker answers ``/metrics`` renders all of them
(``MultiProcessCollector``): counters and histograms summed over the workers; of the gauges,
the requests outstanding on a server summed over the live workers, a server healthy only while
every live worker has it in rotation, its TP size the largest reported. Each worker refreshes
its gauges every second (:meth:`RouterMetrics.refresh`), so a scrape sees every worker's.
"""

from __future__ import annotations

import bisect
import os
import time
from typing import Optional

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, generate_latest,
                               multiprocess, values)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's; set by the supervisor

# Seconds. TTFT spans the brief's "seconds of tolerance"; ITL its 10-30 ms decode target and the
# handoff stall, which can reach the WAN's RTT and more.
_TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)
_ITL_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10)
# Predicted over actual WAN time of main's copy: 1 is a perfect prediction, below 1 the line was
# slower than the router thought (it should have hidden more behind a relay).
_RATIO_BUCKETS = (0.1, 0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2, 4, 10)
# Why a request went where it went (placement_reason).
PLACEMENT_REASONS = ("wan_below_hide_threshold", "wan_above_hide_threshold", "singular",
                     "no_relay", "main_unreachable")


def placement_reason(placement) -> str:
    """The rule that chose the pipeline: policy.choose_pipeline's, or a fallback."""
    from pdd_sglang import policy

    if placement.main_fallback:
        return "main_unreachable"  # no healthy main: the relay answers alone
    if placement.relay_fallback:
        return "no_relay"  # P->RLD->MD wanted (or no main either): P->MD
    return {policy.Pipeline.PREFILL_MAIN: "wan_below_hide_threshold",
            policy.Pipeline.RELAY_SINGULAR: "singular"}.get(placement.pipeline,
                                                            "wan_above_hide_threshold")


def share_between_workers() -> bool:
    """In a worker of ``--workers N`` (``PROMETHEUS_MULTIPROC_DIR`` set by the supervisor): keep
    this process's metrics in the directory's files from here on; whether they are."""
    if not os.environ.get(MULTIPROC_ENV):
        return False
    values.ValueClass = values.MultiProcessValue()  # what each metric made from now on uses
    return True


class BatchedHistogram:
    """A labelled Prometheus histogram to which a whole batch of observations is added at once
    (:meth:`batch`, :meth:`put`, :meth:`add`): one ``inc`` per bucket at the end of a request,
    not an ``observe`` per token."""

    def __init__(self, name: str, documentation: str, labelnames: tuple, buckets: tuple,
                 registry: CollectorRegistry):
        self.bounds = tuple(float(b) for b in buckets)
        self.histogram = Histogram(name, documentation, labelnames, buckets=buckets,
                                   registry=registry)

    def batch(self) -> list:
        """An empty batch: a count per bucket (+Inf last), then the sum."""
        return [0] * (len(self.bounds) + 1) + [0.0]

    def put(self, batch: list, value: float, count: int = 1) -> None:
        """``count`` observations of ``value`` into ``batch``."""
        batch[bisect.bisect_left(self.bounds, value)] += count
        batch[-1] += value * count

    def add(self, labels: tuple, batch: list) -> None:
        # prometheus_client's Histogram keeps a count per bucket (not cumulative) and the sum,
        # each a value of its own (a file's slot with --workers): the batch goes straight in.
        child = self.histogram.labels(*labels)
        for bucket, count in zip(child._buckets, batch):
            if count:
                bucket.inc(count)
        child._sum.inc(batch[-1])


class RouterMetrics:
    def __init__(self, shared: bool = False) -> None:
        """``shared``: a worker of several (:func:`share_between_workers` was called)."""
        self.shared = shared
        self._children: dict = {}  # (metric, labels) -> its child: see child()
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("pdd_router_requests", "Requests placed, by pipeline and API",
                                ["pipeline", "api"], registry=r)
        self.outcomes = Counter(
            "pdd_router_handoff", "Finished requests by how the answer was made: main_only "
            "(P->MD), handoff (relay then main; mode as the relay reported it, else 'unknown'), "
            "relay_finished (the relay completed it, main's copy aborted or cached), "
            "relay_lost (the relay died before a handoff; main decoded from the first token)",
            ["outcome", "mode"], registry=r)
        self.main_waits = Counter(
            "pdd_router_main_waits", "P->RLD->MD requests whose main waited for the WAN copy of "
            "the turn they extend, by how the wait ended (landed, timed_out)", ["end"], registry=r)
        self.retries = Counter(
            "pdd_router_retries", "Requests re-sent after a failure before their first token, "
            "by the failure's cause", ["cause"], registry=r)
        self.ttft_budget = Counter(
            "pdd_router_ttft_budget", "Requests placed against a TTFT budget (--ttft-slo-ms or "
            "the request's ttft_slo_ms): within (P->MD predicted within it, or a relay with "
            "headroom), over (no relay headroom: P->MD over budget), no_budget",
            ["verdict"], registry=r)
        self.errors = Counter("pdd_router_errors", "Requests failed or refused, by cause "
                              "(relay_lost: recovered by main, not failed)",
                              ["cause"], registry=r)
        self.ttft = Histogram("pdd_router_time_to_first_token_seconds",
                              "Request arrival at the router to the first token sent",
                              ["pipeline"], buckets=_TTFT_BUCKETS, registry=r)
        self.itl = BatchedHistogram(
            "pdd_router_inter_token_latency_seconds", "Gap between tokens sent to the client (a "
            "chunk's gap split evenly over its tokens, as bench_serving does; a request's gaps "
            "are added when it ends)", ("pipeline",), _ITL_BUCKETS, r)
        self.handoff_gap = Histogram("pdd_router_handoff_gap_seconds",
                                     "Last relay token to first main token, seen by the client",
                                     buckets=_ITL_BUCKETS, registry=r)
        self.wan_bytes = Counter(
            "pdd_router_wan_kv_bytes",
            "KV bytes that crossed the WAN to main: (prompt - main's reported cached tokens) x "
            "KV bytes per token; an estimate from main's answer, the prefill's ledger is exact",
            ["main"], registry=r)
        self.wan_bytes_predicted = Counter(
            "pdd_router_wan_kv_bytes_predicted", "The same, predicted from the prefix mirror at "
            "placement", ["main"], registry=r)
        self.mirror_error_tokens = Histogram(
            "pdd_router_mirror_error_tokens",
            "Mirror's predicted prefix match minus main's reported cached tokens",
            buckets=(-1024, -64, -1, 0, 1, 64, 1024, 16384), registry=r)
        self.outstanding = Gauge("pdd_router_outstanding_requests",
                                 "Requests the router holds on each server", ["role", "url"],
                                 registry=r, multiprocess_mode="livesum")
        self.healthy = Gauge("pdd_router_server_healthy", "1 when in rotation", ["role", "url"],
                             registry=r, multiprocess_mode="livemin")
        self.tp_size = Gauge("pdd_router_server_tp_size", "The server's --tp-size (from its "
                             "/server_info); roles may differ where one size divides the other",
                             ["role", "url"], registry=r, multiprocess_mode="livemax")
        self.placements = Counter(
            "pdd_router_placements", "Requests placed, by pipeline and the rule that chose it "
            "(wan_below_hide_threshold: P->MD, nothing worth hiding; wan_above_hide_threshold: "
            "P->RLD->MD; singular: the relay alone, short output; no_relay, main_unreachable: "
            "fallbacks)", ["pipeline", "reason"], registry=r)
        self.wan_time_ratio = Histogram(
            "pdd_router_wan_time_predicted_over_actual",
            "Main's WAN copy: the placement's predicted seconds over the router's measure (from "
            "prefill's forward done, seen as the relay's first token, or from placement on "
            "P->MD, to main's first token)", buckets=_RATIO_BUCKETS, registry=r)
        self.wan_time_actual = Histogram(
            "pdd_router_wan_time_seconds", "Main's WAN copy as the router measures it (see "
            "pdd_router_wan_time_predicted_over_actual)", buckets=_TTFT_BUCKETS, registry=r)

    def child(self, metric, *labels):
        """``metric.labels(*labels)`` from a dict: prometheus_client's own look-up validates
        the labels and takes a lock, several times a request on the request's way out."""
        key = (metric, labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def request_placed(self, placement, api: str) -> None:
        """A request (or a retry of one) goes to its servers."""
        pipeline = placement.pipeline.label
        self.child(self.requests, pipeline, api).inc()
        self.child(self.ttft_budget, placement.ttft_budget).inc()
        self.placed(placement)

    def placed(self, placement) -> None:
        self.child(self.placements, placement.pipeline.label, placement_reason(placement)).inc()

    def wan_copy_landed(self, predicted_s: float, actual_s: float) -> None:
        """A copy to main landed after ``actual_s``; placement predicted ``predicted_s``."""
        if actual_s <= 0:
            return
        self.wan_time_actual.observe(actual_s)
        if predicted_s > 0:
            self.wan_time_ratio.observe(predicted_s / actual_s)

    def refresh(self, pool) -> None:
        """This process's gauges from the pool as it is now."""
        for upstream in pool.all():
            self.outstanding.labels(upstream.role, upstream.url).set(upstream.outstanding)
            self.healthy.labels(upstream.role, upstream.url).set(1 if upstream.healthy else 0)
            if upstream.tp_size is not None:
                self.tp_size.labels(upstream.role, upstream.url).set(upstream.tp_size)

    def render(self, pool) -> bytes:
        """The exposition text: this router's metrics, or every worker's with ``--workers``."""
        self.refresh(pool)
        if not self.shared:
            return generate_latest(self.registry)
        every_worker = CollectorRegistry()
        multiprocess.MultiProcessCollector(every_worker)
        return generate_latest(every_worker)


class TokenClock:
    """Times one request's tokens as the client receives them; its inter-token gaps reach the
    shared histogram when the request ends (:meth:`close`)."""

    def __init__(self, metrics: RouterMetrics, pipeline: str, started: Optional[float] = None):
        self.metrics = metrics
        self.pipeline = pipeline
        self.started = time.perf_counter() if started is None else started
        self.last: Optional[float] = None
        self.ttft_s: Optional[float] = None
        self.handoff_gap_s: Optional[float] = None
        self._gaps = metrics.itl.batch()

    def close(self) -> None:
        """Add the request's inter-token gaps to the shared histogram (once)."""
        if self._gaps[-1] or any(self._gaps[:-1]):
            self.metrics.itl.add((self.pipeline,), self._gaps)
        self._gaps = self.metrics.itl.batch()

    def tokens_sent(self, count: int, first_after_handoff: bool = False) -> None:
        if count <= 0:
            return
        now = time.perf_counter()
        if self.last is None:
            # A first chunk's extra tokens arrived with the first one: no gap to report.
            self.ttft_s = now - self.started
            self.metrics.child(self.metrics.ttft, self.pipeline).observe(self.ttft_s)
            self.last = now
            return
        gap = now - self.last
        if first_after_handoff:
            self.handoff_gap_s = gap
            self.metrics.handoff_gap.observe(gap)
        self.metrics.itl.put(self._gaps, gap / count, count)
        self.last = now
