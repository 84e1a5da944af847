"""deploy/grafana/pdd.json charts only series the servers and the router export."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "pdd.json"
SUFFIXES = ("_bucket", "_count", "_sum", "_total")


def _family(name: str) -> str:
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def _server_families(tmp_path) -> set[str]:
    code = ("import json; from prometheus_client import REGISTRY; "
            "from pdd_sglang.diagnostics.metrics import server_metrics; server_metrics(); "
            "from pdd_sglang.prefill.ledger import _PrometheusCounters; "
            "_PrometheusCounters.create(); "
            "print(json.dumps(sorted(m.name for c in list(REGISTRY._collector_to_names) "
            "for m in c.collect())))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                          env={"PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PYTHONPATH": str(REPO),
                               "PATH": "/usr/bin:/bin"}, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return set(json.loads(proc.stdout))


def test_every_charted_series_is_exported(tmp_path):
    from pdd_sglang.router.metrics import RouterMetrics

    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", ())]
    charted = {_family(n) for e in exprs for n in re.findall(r"(sglang:pdd_\w+|pdd_router_\w+)", e)}
    router = {m.name for m in RouterMetrics().registry.collect()}
    exported = router | _server_families(tmp_path)
    assert charted and not charted - exported, sorted(charted - exported)
    # Each of the figures has a chart.
    for family in ("sglang:pdd_handoffs", "sglang:pdd_relay_finished", "sglang:pdd_main_only",
                   "sglang:pdd_handoff_latency_seconds", "sglang:pdd_handoff_chunks",
                   "sglang:pdd_dropped", "sglang:pdd_late_registrations_refused",
                   "sglang:pdd_wan_sent_bytes", "sglang:pdd_wan_queued_bytes",
                   "sglang:pdd_wan_in_flight_bytes", "sglang:pdd_wan_rate_bytes_per_second",
                   "sglang:pdd_kv_digest_mismatches", "pdd_router_placements",
                   "pdd_router_wan_time_predicted_over_actual"):
        assert family in charted, family
