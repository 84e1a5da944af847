"""scripts/bench_router.py end to end, in a smoke setting: both routers through the fake backends,
and router_bench.json has the rows the issue names (figures are the bench's to print, not a
test's to check)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ROW_FIELDS = {"router", "mode", "concurrency", "answer_tokens", "added_ttft_p50_ms",
              "added_ttft_p99_ms", "added_itl_p50_ms", "added_itl_p99_ms", "rps",
              "cpu_s_per_request", "errors"}


def test_quick_bench_writes_one_row_per_router_mode_and_concurrency(tmp_path):
    pytest.importorskip("sglang_router")
    out = tmp_path / "bench" / "router_bench.json"
    # --out a folder that does not exist yet: made first, the report written in it
    cmd = [sys.executable, str(REPO / "scripts/bench_router.py"), "--quick", "--no-cgroup",
           "--routers", "pdd_p_rld_md,sglang_router", "--concurrency", "1,4",
           "--duration-s", "0.7", "--long-answer-tokens", "120", "--out", str(tmp_path / "bench"),
           "--log-dir", str(tmp_path / "logs"), "--profile"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    runs = report["runs"]
    keys = {(r["router"], r["mode"], r["kind"], r["concurrency"]) for r in runs}
    for router, mode in (("pdd", "p_rld_md"), ("sglang-router", "pd")):
        assert {(router, mode, "load", 1), (router, mode, "load", 4),
                (router, mode, "saturation", 4), (router, mode, "long", 1)} <= keys
    # Agentic chats (tools, a tool call and its result) through the PDD router only.
    assert ("pdd", "p_rld_md", "chat", 4) in keys
    assert not any(kind == "chat" for router, _, kind, _ in keys if router != "pdd")
    for row in runs:
        assert ROW_FIELDS <= set(row), row
        assert row["errors"] == 0, row["error_samples"]
        assert row["rps"] > 0 and row["cpu_s_per_request"] is not None
        assert row["added_ttft_p99_ms"] is not None and row["added_itl_p99_ms"] is not None
    long_row = next(r for r in runs if r["kind"] == "long" and r["router"] == "pdd")
    assert long_row["answer_tokens"] == 120
    assert "| pdd | p_rld_md |" in done.stdout  # the table
    # --profile: py-spy on the PDD router in its highest-concurrency load run and saturation run
    profile = json.loads((out.parent / "router_profile.json").read_text())
    assert report["router_profile"] == str(out.parent / "router_profile.json")
    assert {(e["mode"], e["kind"], e["concurrency"]) for e in profile["runs"]} == {
        ("p_rld_md", "load", 4), ("p_rld_md", "saturation", 4)}
    # The quick saturation run lasts about a second: on a loaded machine py-spy may attach only
    # as it ends (a fresh-clone CI run, 2026-12-04: 0 samples there, the load run's fine). Every
    # entry must have run cleanly, and the run that lasts must have been sampled.
    for entry in profile["runs"]:
        assert entry["error"] is None, entry
        if entry["kind"] == "load" or entry["samples"]:
            assert entry["samples"] > 0, entry
            assert sum(entry["buckets"].values()) == pytest.approx(1.0, abs=1e-3)
            assert entry["top_own"] and entry["top_cumulative"]
    assert {(r["kind"], r["concurrency"]) for r in runs if r.get("profiled")} == {
        ("load", 4), ("saturation", 4)}
    assert "| p_rld_md | after | load | 4 |" in done.stdout  # the profile's table


def test_the_bench_runs_the_pdd_router_with_keys_and_tls_on_every_leg(tmp_path):
    """--keys-tls: the client reaches the router over TLS with its key, the router the fake
    servers over https with theirs (any refusal would be an error row)."""
    out = tmp_path / "router_bench.json"
    cmd = [sys.executable, str(REPO / "scripts/bench_router.py"), "--quick", "--no-cgroup",
           "--keys-tls", "--routers", "pdd_p_rld_md", "--concurrency", "2",
           "--duration-s", "0.7", "--long-answer-tokens", "120", "--out", str(out),
           "--log-dir", str(tmp_path / "logs")]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["settings"]["keys_tls"] is True
    assert {(r["mode"], r["kind"]) for r in report["runs"]} == {
        ("p_rld_md", "load"), ("p_rld_md", "chat"), ("p_rld_md", "saturation"),
        ("p_rld_md", "long")}
    for row in report["runs"]:
        assert row["errors"] == 0 and row["rps"] > 0, row
    log = (tmp_path / "logs" / "pdd-p_rld_md-after.log").read_text()
    assert "listening on https://" in log
