"""PDD's series in SGLang's /metrics (issue 26, item 3): made only with --enable-metrics (SGLang's
PROMETHEUS_MULTIPROC_DIR), named sglang:pdd_*, fed from the counters PDD keeps; and the router's
placements by reason and WAN-time prediction ratio."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SERVER_PROBE = r'''
import os, sys
from types import SimpleNamespace
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from pdd_sglang.decode.handoff_channel import HandoffStats
from pdd_sglang.diagnostics import metrics

relay, main = HandoffStats("relay"), HandoffStats("main")
for event in ("mode_catch-up", "mode_one-shot", "mode_one-shot", "singular_finished_at_relay",
              "handed_off"):
    relay.event(event)
relay.chunk_sent("catch-up", 64, 300)
relay.chunk_sent("catch-up", 10, 60)
relay.refuse("kv_digest_mismatch")
main.event("continued_alone")
main.event("relay_down_continued_alone")
main.latency(0.02)
main.duration(0.3)
assert relay.handed_tokens == 74 and relay.payload_bytes == 360

published = {"refused_late": 0, "relays_dropped": 0, "mains_dropped": 0, "rooms_open": 3,
             "mains_out": []}
lines = {"10.0.0.2:15000": {"queued_bytes": 10, "in_flight_bytes": 20, "recent_bytes_per_s": 1e6,
                            "sent_bytes": 1000}}
from pdd_sglang.prefill.wan_coded import CodecChoice
choice = CodecChoice("auto", 1e6)
fanout = SimpleNamespace(published=published, counters=dict.fromkeys(
    ("refused_late", "relays_dropped", "mains_dropped"), 0),
    wan_line=SimpleNamespace(snapshot=lambda: lines), codec_choice=choice)
exporter = metrics.PrefillExporter(fanout, metrics.server_metrics())
choice.count("packed_raw_copies")
exporter.export_once()
for key in ("packed_raw_copies", "coded_copies", "one_sided_copies"):
    choice.count(key)
fanout.published = {**published, "refused_late": 2, "mains_dropped": 1}
lines["10.0.0.2:15000"] = {**lines["10.0.0.2:15000"], "sent_bytes": 4000, "queued_bytes": 0}
exporter.export_once()
exporter.export_once()  # nothing new: counters do not move

registry = CollectorRegistry()
MultiProcessCollector(registry)
print(generate_latest(registry).decode())
'''


def _run(env_extra: dict, code: str) -> subprocess.CompletedProcess:
    import os

    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    env.update(env_extra)
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=120)


def _value(text: str, series: str) -> float:
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{series} not exported:\n{text}")


def test_server_metrics_in_sglangs_multiprocess_registry(tmp_path):
    proc = _run({"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}, SERVER_PROBE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    expected = {
        'sglang:pdd_handoffs_total{mode="one-shot"}': 2,
        'sglang:pdd_handoffs_total{mode="catch-up"}': 1,
        'sglang:pdd_handoff_chunks_total{mode="catch-up"}': 2,
        "sglang:pdd_handoff_tokens_total": 74,
        "sglang:pdd_relay_finished_total": 1,
        "sglang:pdd_kv_digest_mismatches_total": 1,
        'sglang:pdd_main_only_total{reason="relay_lost_or_silent"}': 1,
        'sglang:pdd_main_only_total{reason="relay_down"}': 1,
        "sglang:pdd_handoff_latency_seconds_count": 1,
        "sglang:pdd_handoff_duration_seconds_count": 1,
        'sglang:pdd_handoff_events_total{event="handed_off",role="relay"}': 1,
        'sglang:pdd_handoff_refused_total{reason="kv_digest_mismatch",role="relay"}': 1,
        'sglang:pdd_dropped_total{destination="main"}': 1,
        "sglang:pdd_late_registrations_refused_total": 2,
        'sglang:pdd_wan_sent_bytes_total{main="10.0.0.2:15000"}': 4000,
        'sglang:pdd_wan_queued_bytes{main="10.0.0.2:15000"}': 0,
        'sglang:pdd_wan_in_flight_bytes{main="10.0.0.2:15000"}': 20,
        'sglang:pdd_wan_rate_bytes_per_second{main="10.0.0.2:15000"}': 1e6,
        'sglang:pdd_wan_kv_codec_ratio{main="10.0.0.2:15000"}': 1.0,  # nothing coded
        'sglang:pdd_wan_copies_total{mode="packed"}': 2,
        'sglang:pdd_wan_copies_total{mode="coded"}': 1,
        'sglang:pdd_wan_copies_total{mode="one_sided"}': 1,
    }
    for series, value in expected.items():
        assert _value(out, series) == value, series
    assert 'destination="relay"' not in out  # nothing dropped there: no series made up


def test_without_enable_metrics_nothing_is_made():
    code = ("from pdd_sglang.diagnostics import metrics; from pdd_sglang.decode.handoff_channel "
            "import HandoffStats; s = HandoffStats('relay'); s.event('mode_one-shot'); "
            "s.chunk_sent('one-shot', 3, 10); "
            "import sys, threading; assert metrics.server_metrics() is None; "
            "assert 'prometheus_client' not in sys.modules, 'imported'; "
            "from types import SimpleNamespace as N; "
            "assert metrics.start_prefill_exporter(N(pdd_fanout=N())) is None; "
            "assert [t.name for t in threading.enumerate()] == ['MainThread']; print('inert')")
    proc = _run({}, code)
    assert proc.returncode == 0 and "inert" in proc.stdout, proc.stderr[-3000:]


def test_the_exporter_thread_stops_and_exports_its_last_figures(tmp_path):
    code = ("from types import SimpleNamespace as N; import threading; "
            "from pdd_sglang.diagnostics import metrics; "
            "f = N(published={'refused_late': 1}, counters={'refused_late': 0}, "
            "wan_line=N(snapshot=lambda: {})); kv = N(pdd_fanout=f); "
            "e = metrics.start_prefill_exporter(kv); assert kv.pdd_metrics_exporter is e; "
            "assert 'pdd-metrics' in [t.name for t in threading.enumerate()]; e.close(); "
            "assert 'pdd-metrics' not in [t.name for t in threading.enumerate()]; "
            "assert e._last_counters == {'refused_late': 1}; print('closed')")
    proc = _run({"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}, code)
    assert proc.returncode == 0 and "closed" in proc.stdout, proc.stderr[-3000:]


def test_router_placements_by_reason_and_wan_time_ratio():
    from types import SimpleNamespace

    from pdd_sglang import policy
    from pdd_sglang.router.metrics import RouterMetrics, placement_reason

    def placement(pipeline, **flags):
        return SimpleNamespace(pipeline=pipeline, main_fallback=flags.get("main_fallback", False),
                               relay_fallback=flags.get("relay_fallback", False))

    P = policy.Pipeline
    assert placement_reason(placement(P.PREFILL_MAIN)) == "wan_below_hide_threshold"
    assert placement_reason(placement(P.PREFILL_RELAY_MAIN)) == "wan_above_hide_threshold"
    assert placement_reason(placement(P.RELAY_SINGULAR)) == "singular"
    assert placement_reason(placement(P.PREFILL_MAIN, relay_fallback=True)) == "no_relay"
    assert placement_reason(placement(P.RELAY_SINGULAR, main_fallback=True)) == "main_unreachable"
    metrics = RouterMetrics()
    metrics.placed(placement(P.PREFILL_RELAY_MAIN))
    metrics.wan_copy_landed(2.0, 4.0)
    metrics.wan_copy_landed(0.0, 1.0)  # nothing predicted (all cached): actual only
    text = metrics.render(SimpleNamespace(all=lambda: [])).decode()
    label = P.PREFILL_RELAY_MAIN.label
    assert _value(text, f'pdd_router_placements_total{{pipeline="{label}",'
                        f'reason="wan_above_hide_threshold"}}') == 1
    assert _value(text, 'pdd_router_wan_time_predicted_over_actual_bucket{le="0.5"}') == 1
    assert _value(text, 'pdd_router_wan_time_predicted_over_actual_bucket{le="0.25"}') == 0
    assert _value(text, "pdd_router_wan_time_predicted_over_actual_count") == 1
    assert _value(text, "pdd_router_wan_time_seconds_count") == 2
