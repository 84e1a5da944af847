"""`make demo`'s short configuration: same-DC PD against naive cross-DC PD over the emulated line.

Runs ``scripts/demo.py --quick`` as a subprocess (the real entry point: real SGLang servers in the
WAN emulator's namespaces, the PDD router, a streaming client) and checks its JSON: the WAN line
must cost cross-DC PD on P90 TTFT, PDD must beat naive cross-DC PD there, nothing errors or leaks, and every key the figures read is
there. A second run kills a server mid-run and checks that the demo still stops everything.
Needs root and /dev/net/tun (CI has both); skips with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pdd_sglang.dev.wan_emulator import check_prerequisites, netns

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "scripts" / "demo.py"
SETUP_KEYS = ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "itl_p50_ms", "itl_p99_ms", "wan_bytes",
              "requests", "errors")


@pytest.fixture(scope="module", autouse=True)
def wan_capable():
    try:
        check_prerequisites()
    except (PermissionError, FileNotFoundError) as err:
        pytest.skip(f"the demo needs the WAN emulator: {err}")


def run_demo(args: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(DEMO), *args], capture_output=True, text=True,
                          timeout=timeout_s, cwd=REPO)


def test_quick_demo_runs_three_setups_and_orders_cross_dc_after_same_dc(tmp_path):
    proc = run_demo(["--quick", "--out", str(tmp_path)], timeout_s=1200)
    assert proc.returncode == 0, f"demo failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    data = json.loads((tmp_path / "demo.json").read_text())
    setups = data["setups"]
    for name in ("same_dc_pd", "cross_dc_pd", "pdd"):
        missing = [k for k in SETUP_KEYS if setups[name].get(k) is None]
        assert not missing, f"{name} lacks {missing}"
        assert setups[name]["errors"] == 0, setups[name]["error_messages"]
        assert setups[name]["requests"] == data["workload"]["requests_per_setup"]
    for name in ("same_dc_pd", "cross_dc_pd"):
        # The router had no relay: every request took P->MD.
        assert setups[name]["pipelines"] == {"prefill_main": setups[name]["requests"]}
    # With a relay, the low-hit turns went through it.
    assert setups["pdd"]["pipelines"].get("prefill_relay_main", 0) > 0, setups["pdd"]["pipelines"]
    # The bar is measured and reported (not yet met on this machine: see the README).
    assert set(data["bar"]) >= {"pdd_over_same_dc_p99", "cross_dc_over_same_dc_p99"}
    for key in ("rate_mbit", "rtt_ms", "jitter_ms", "kv_bytes_per_token"):
        assert key in data["line"]
    assert data["workload"]["prompt_token_stats"] and data["workload"]["output_token_stats"]
    same, cross, pdd = setups["same_dc_pd"], setups["cross_dc_pd"], setups["pdd"]
    assert cross["ttft_p90_s"] > same["ttft_p90_s"], (same, cross)
    # PDD hides part of the WAN: its P90 TTFT is below naive cross-DC PD's (issue 7's ordering;
    # measured 7.1 vs 10.5, 9.0 vs 12.2 and 6.4 vs 11.5 s in the last three --quick runs).
    assert pdd["ttft_p90_s"] < cross["ttft_p90_s"], (pdd, cross)
    # Every byte of main's KV crossed the line in cross-DC PD, none did in same-DC PD.
    assert cross["wan_bytes_a_to_b"] >= cross["kv_bytes_to_main"] > 0
    assert same["wan_bytes"] < 100_000, same["wan_bytes"]
    assert not data["leaks"], data["leaks"]
    assert data["cleanup"] == {"namespaces_left": [], "server_processes_left": []}
    assert (tmp_path / "ttft.png").stat().st_size > 0


def test_server_crash_mid_run_still_cleans_up(tmp_path):
    proc = run_demo(["--quick", "--conversations", "1", "--turns", "3", "--inject-crash", "1",
                     "--out", str(tmp_path)], timeout_s=600)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "died during the run" in proc.stderr, proc.stderr[-4000:]
    match = re.search(r"cleanup: namespaces (\[.*?\]) left (\[.*?\]), "
                      r"server processes (\[.*?\]) left (\[.*?\])", proc.stderr)
    assert match, proc.stderr[-4000:]
    names, names_left, pids, pids_left = (json.loads(g.replace("'", '"')) for g in match.groups())
    assert names and names_left == [] and pids_left == []
    assert not any(netns.exists(n) for n in names)
    assert not any(os.path.exists(f"/proc/{p}") and netns._alive(p) for p in pids)
