"""PDD's series in SGLang's own ``/metrics`` (``--enable-metrics``), named as SGLang names its own.

SGLang runs prometheus_client in multiprocess mode: with ``--enable-metrics`` the launcher sets
``PROMETHEUS_MULTIPROC_DIR`` before it starts the scheduler, metrics made in the scheduler process
are written to files there, and the launcher's ``/metrics`` merges them. PDD's state lives in the
scheduler process, so PDD makes its metrics there, on first use, and only when that variable is
set: without ``--enable-metrics`` :func:`server_metrics` is ``None`` and nothing below runs.

Names: ``sglang:pdd_<what>`` (SGLang's are ``sglang:<what>``, e.g. ``sglang:num_running_reqs``).

=====================================================  ======  =====================================
series                                                 role    source
=====================================================  ======  =====================================
``sglang:pdd_handoffs_total{mode}``                    relay   a handoff begun (One-Shot/Catch-Up)
``sglang:pdd_handoff_chunks_total{mode}``              relay   HandoffTokens sent (Catch-Up chunks)
``sglang:pdd_relay_finished_total``                    relay   the relay answered alone (singular
                                                               filter: main was ready too late)
``sglang:pdd_kv_digest_mismatches_total``              relay   main's WAN copy disagreed
``sglang:pdd_main_only_total{reason}``                 main    main decoded a relayed request from
                                                               its first token (relay gone, silent)
``sglang:pdd_handoff_latency_seconds``                 main    HandoffReady -> first relay tokens
``sglang:pdd_handoff_duration_seconds``                main    HandoffReady -> last chunk absorbed
``sglang:pdd_handoff_events_total{role,event}``        both    every handoff event (/server_info)
``sglang:pdd_handoff_refused_total{role,reason}``      both    messages or requests refused
``sglang:pdd_dropped_total{destination}``              prefill relays/mains dropped by fan-out
``sglang:pdd_late_registrations_refused_total``        prefill a relay or main registered too late
``sglang:pdd_fanout_events_total{event}``              prefill every fan-out counter
``sglang:pdd_wan_sent_bytes_total{main}``              prefill wire bytes sent across the WAN
``sglang:pdd_wan_queued_bytes{main}``                  prefill bytes waiting for a WAN worker
``sglang:pdd_wan_in_flight_bytes{main}``               prefill bytes handed to Mooncake, not done
``sglang:pdd_wan_rate_bytes_per_second{main}``         prefill measured over recent copies
``sglang:pdd_wan_kv_codec_ratio{main}``                prefill KV bytes per wire byte, coded copies
``sglang:pdd_wan_copies_total{mode}``                  prefill copies to main by mode: packed,
                                                               coded or one_sided
``sglang:pdd_kv_transfer_bytes_total{role}``           prefill KV bytes per destination role
=====================================================  ======  =====================================

The relay and main push theirs as events happen (``HandoffStats``). The prefill's fan-out and WAN
line are read by one exporter thread, ``pdd-metrics`` (:class:`PrefillExporter`, the owner of its
last-seen values), once per :data:`EXPORT_PERIOD_S`, from the immutable dict the fan-out
publishes and the WAN line's locked snapshot; ``lifecycle.close_scheduler`` closes it.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Optional

logger = logging.getLogger(__name__)

PREFIX = "sglang:pdd_"
EXPORT_PERIOD_S = 1.0
# Seconds: a same-host handoff takes milliseconds, a Catch-Up over a slow line many seconds.
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Main events that mean "main decoded it alone from the first token".
# (continued_alone ends a held request whose relay was lost or silent past
# --pdd-handoff-timeout; the two others are requests never held.)
MAIN_ONLY_EVENTS = {"continued_alone": "relay_lost_or_silent",
                    "relay_down_continued_alone": "relay_down",
                    "control_channel_down_continued_alone": "control_channel_down"}
# Fan-out counters (prefill.fanout.PrefillFanout.counters) with a series of their own.
DROPPED = {"relays_dropped": "relay", "mains_dropped": "main"}
LATE = "refused_late"

_lock = threading.Lock()
_metrics: Any = None
_checked = False


def enabled() -> bool:
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))


def server_metrics() -> Optional["ServerMetrics"]:
    """This process's PDD metrics, or None without --enable-metrics (made once, on first use)."""
    global _metrics, _checked
    if _checked:
        return _metrics
    with _lock:
        if not _checked:
            _metrics = ServerMetrics() if enabled() else None
            _checked = True
    return _metrics


class ServerMetrics:
    def __init__(self) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        def counter(name, doc, labels=()):
            return Counter(PREFIX + name, doc, list(labels))

        def gauge(name, doc, labels=()):
            return Gauge(PREFIX + name, doc, list(labels), multiprocess_mode="mostrecent")

        self.handoffs = counter("handoffs", "PDD relay: handoffs begun, by mode", ["mode"])
        self.chunks = counter("handoff_chunks", "PDD relay: HandoffTokens messages sent (a "
                              "One-Shot handoff sends one, a Catch-Up several), by mode", ["mode"])
        self.handed_tokens = counter("handoff_tokens", "PDD relay: output tokens handed to main")
        self.relay_finished = counter(
            "relay_finished", "PDD relay: requests the relay answered alone because it finished "
            "before main was ready (the singular filter)")
        self.digest_mismatches = counter(
            "kv_digest_mismatches", "PDD relay: main's WAN copy of a prompt's KV disagreed with "
            "the relay's (--pdd-enable-kv-digest); the relay answered alone")
        self.main_only = counter(
            "main_only", "PDD main: relayed requests main decoded itself from the first token, "
            "by why", ["reason"])
        self.latency = Histogram(PREFIX + "handoff_latency_seconds", "PDD main: HandoffReady "
                                 "sent to the relay's first tokens received",
                                 buckets=LATENCY_BUCKETS_S)
        self.duration = Histogram(PREFIX + "handoff_duration_seconds", "PDD main: HandoffReady "
                                  "sent to the last chunk absorbed", buckets=LATENCY_BUCKETS_S)
        self.events = counter("handoff_events", "PDD relay/main: handoff events (as in "
                              "/server_info)", ["role", "event"])
        self.refused = counter("handoff_refused", "PDD relay/main: handoff messages or requests "
                               "refused, by reason", ["role", "reason"])
        self.dropped = counter("dropped", "PDD prefill: destinations the fan-out dropped from a "
                               "request (failed or gone), by role", ["destination"])
        self.late = counter("late_registrations_refused", "PDD prefill: a relay or main that "
                            "registered after its bootstrap timeout, refused")
        self.fanout = counter("fanout_events", "PDD prefill: the fan-out's counters (as in "
                              "/server_info pdd.fanout)", ["event"])
        self.wan_sent = counter("wan_sent_bytes", "PDD prefill: KV bytes sent across the WAN, "
                                "by main (Mooncake session)", ["main"])
        self.wan_queued = gauge("wan_queued_bytes", "PDD prefill: bytes waiting for a WAN worker",
                                ["main"])
        self.wan_in_flight = gauge("wan_in_flight_bytes", "PDD prefill: bytes handed to Mooncake "
                                   "on the WAN path, not yet done", ["main"])
        self.wan_rate = gauge("wan_rate_bytes_per_second", "PDD prefill: WAN throughput "
                              "measured over the recent copies to each main", ["main"])
        self.wan_codec_ratio = gauge("wan_kv_codec_ratio", "PDD prefill: KV bytes per wire byte "
                                     "of the coded copies to each main (1: none coded)", ["main"])
        self.wan_copies = counter("wan_copies", "PDD prefill: copies to main by mode (packed: raw "
                                  "records in main's staging ring, coded: coded records, "
                                  "one_sided: straight into main's pages)", ["mode"])

    # ---- relay and main (HandoffStats) ------------------------------------------------------
    def handoff_event(self, role: str, event: str, count: int = 1) -> None:
        self.events.labels(role, event).inc(count)
        if event.startswith("mode_"):
            self.handoffs.labels(event[len("mode_"):]).inc(count)
        elif event == "singular_finished_at_relay":
            self.relay_finished.inc(count)
        elif role == "main" and event in MAIN_ONLY_EVENTS:
            self.main_only.labels(MAIN_ONLY_EVENTS[event]).inc(count)

    def handoff_refused(self, role: str, reason: str) -> None:
        self.refused.labels(role, reason).inc()
        if role == "relay" and reason == "kv_digest_mismatch":
            self.digest_mismatches.inc()

    def handoff_chunk(self, mode: str, tokens: int) -> None:
        self.chunks.labels(mode).inc()
        self.handed_tokens.inc(tokens)

    # ---- prefill (PrefillExporter) ----------------------------------------------------------
    def fanout_counters(self, deltas: dict) -> None:
        for name, delta in deltas.items():
            if delta <= 0:
                continue
            self.fanout.labels(name).inc(delta)
            if name in DROPPED:
                self.dropped.labels(DROPPED[name]).inc(delta)
            elif name == LATE:
                self.late.inc(delta)

    def wan_line(self, lines: dict, sent_deltas: dict) -> None:
        for main, row in lines.items():
            self.wan_queued.labels(main).set(row.get("queued_bytes", 0))
            self.wan_in_flight.labels(main).set(row.get("in_flight_bytes", 0))
            self.wan_rate.labels(main).set(row.get("recent_bytes_per_s") or 0)
            self.wan_codec_ratio.labels(main).set(row.get("kv_codec_ratio") or 1.0)
        for main, delta in sent_deltas.items():
            if delta > 0:
                self.wan_sent.labels(main).inc(delta)

    def wan_copies_by_mode(self, deltas: dict) -> None:
        for mode, delta in deltas.items():
            if delta > 0:
                self.wan_copies.labels(mode).inc(delta)


class PrefillExporter:
    """Thread ``pdd-metrics``: the prefill's fan-out counters and WAN line into Prometheus.

    Owns ``_last`` (the values it last exported); reads ``fanout.published`` (replaced whole by
    the fan-out's owner, never changed in place) and ``fanout.wan_line.snapshot()`` (locked).
    """

    def __init__(self, fanout: Any, metrics: ServerMetrics, period_s: float = EXPORT_PERIOD_S):
        self.fanout = fanout
        self.metrics = metrics
        self.period_s = period_s
        self._last_counters: dict = {}
        self._last_sent: dict = {}
        self._last_modes: dict = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pdd-metrics", daemon=True)

    def start(self) -> "PrefillExporter":
        self._thread.start()
        return self

    def _run(self) -> None:
        from pdd_sglang.lifecycle import name_os_thread

        name_os_thread("pdd-metrics")
        while not self._stop.wait(self.period_s):
            try:
                self.export_once()
            except Exception:  # a metric must never take the prefill down
                logger.exception("PDD: exporting prefill metrics failed")

    def export_once(self) -> None:
        published = self.fanout.published
        counters = {k: v for k, v in published.items() if isinstance(v, int) and k in
                    getattr(self.fanout, "counters", published)}
        deltas = {k: v - self._last_counters.get(k, 0) for k, v in counters.items()}
        self._last_counters = counters
        self.metrics.fanout_counters(deltas)
        lines = self.fanout.wan_line.snapshot()
        sent = {main: int(row.get("sent_bytes", 0)) for main, row in lines.items()}
        sent_deltas = {m: v - self._last_sent.get(m, 0) for m, v in sent.items()}
        self._last_sent = sent
        self.metrics.wan_line(lines, sent_deltas)
        choice = getattr(self.fanout, "codec_choice", None)
        modes = choice.state()["copies_by_mode"] if choice is not None else {}
        self.metrics.wan_copies_by_mode({m: v - self._last_modes.get(m, 0)
                                         for m, v in modes.items()})
        self._last_modes = modes

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        try:
            self.export_once()  # the last figures before the process ends
        except Exception:
            logger.exception("PDD: exporting prefill metrics failed")


def start_prefill_exporter(kv_mgr: Any) -> Optional[PrefillExporter]:
    """With --enable-metrics, export the prefill's fan-out and WAN line (closed by
    ``lifecycle.close_scheduler``). None, and no thread, without it."""
    metrics = server_metrics()
    fanout = getattr(kv_mgr, "pdd_fanout", None)
    if metrics is None or fanout is None:
        return None
    exporter = PrefillExporter(fanout, metrics).start()
    kv_mgr.pdd_metrics_exporter = exporter
    return exporter
