"""`make demo`'s short configuration: same-DC PD, naive cross-DC PD and PDD over the emulated line.

Runs ``scripts/demo.py --quick`` as a subprocess (the real entry point: real SGLang servers in the
WAN emulator's namespaces, each in its own cgroup CPU group, the PDD router, a streaming client),
started in the background as soon as the session has collected its tests, beside the pure-logic
tests (tests/conftest.py), and checks its JSON: both operating points and both placements ran, every
request has an outcome and PDD handed off, nothing errored or leaked, per-server CPU and the
stage split are there. Never timing: speed is what the demo prints, not what a test asserts.
Other runs: a server killed mid-run (also in the background, started late in the session, where
the CPU has room: tests/integration/conftest.py) and Ctrl-C during start-up leave no namespace,
cgroup or process behind; a missing CPU controller is refused with its reason. Needs root and
/dev/net/tun (CI has both); skips otherwise.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdd_sglang.dev.demo.report import OUTCOMES, STAGES
from pdd_sglang.dev.wan_emulator import check_prerequisites, netns

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "scripts" / "demo.py"
SETUP_KEYS = ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "itl_p50_ms", "wan_bytes", "requests",
              "errors", "outcomes", "stages", "cpu")
SERVERS = ("prefill", "main-a", "main-b", "relay")
CGROUP_CPU = Path("/sys/fs/cgroup/cpu")


@pytest.fixture(scope="module", autouse=True)
def wan_capable():
    try:
        check_prerequisites()
    except (PermissionError, FileNotFoundError) as err:
        pytest.skip(f"the demo needs the WAN emulator: {err}")


def run_demo(args: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(DEMO), *args], capture_output=True, text=True,
                          timeout=timeout_s, cwd=REPO)


def _cgroups_of(pid: int) -> list[str]:
    return sorted(p.name for p in CGROUP_CPU.glob(f"pdd-demo-{pid}-*"))


def _every_server_started(pid: int) -> bool:
    groups = _cgroups_of(pid)
    try:
        return len(groups) == len(SERVERS) and all(
            len((CGROUP_CPU / g / "cgroup.procs").read_text().split()) >= 2 for g in groups)
    except FileNotFoundError:
        return False


def test_quick_demo_runs_both_points_and_pdd_hands_off(background):
    # Started in the background when the session collected its tests (tests/conftest.py).
    proc = background.result(timeout_s=1200)
    out = background.out
    assert proc.returncode == 0, f"demo failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    data = json.loads((out / "demo.json").read_text())
    other = data["other_placement_setup"]
    assert data["placement"] == "congestion-aware" and other == "pdd_idle_line"
    for point, names in (("setups", ("same_dc_pd", "cross_dc_pd", "pdd", "pdd_no_budget", other)),
                         ("latency_setups", ("same_dc_pd", "cross_dc_pd", "pdd"))):
        workload = data["workload"] if point == "setups" else data["workload"]["latency"]
        for name in names:
            setup = data[point][name]
            missing = [k for k in SETUP_KEYS if setup.get(k) is None]
            assert not missing, f"{point}.{name} lacks {missing}"
            assert setup["errors"] == 0, setup["error_messages"]
            assert setup["requests"] == workload["requests_per_setup"]
            # Every request has exactly one outcome, from the router's finish summary.
            assert set(setup["outcomes"]) == set(OUTCOMES)
            assert sum(setup["outcomes"].values()) == setup["requests"], setup["outcomes"]
            # Every server's CPU group was read, and the stage split covers every request.
            assert set(setup["cpu"]) == set(SERVERS)
            assert all(c["quota_cores"] == data["cpu_budget"]["server_cores"]
                       for c in setup["cpu"].values())
            # The processes beside the servers were read too: router, line, clients.
            assert set(setup["host_cpu"]) == {"router", "line_forwarder", "clients"}
            assert all(u["cpu_s"] >= 0 for u in setup["host_cpu"].values()), setup["host_cpu"]
            assert setup["stages"]["requests_with_split"] == setup["requests"], setup["stages"]
            assert set(setup["stages"]["all"]) == set(STAGES)
            # registration_wait split by server intake (their time-stats log lines).
            assert "prefill received" in setup["intake"], setup["intake"]
            if name.startswith("pdd"):
                assert "relay registered" in setup["intake"], setup["intake"]
            if name in ("same_dc_pd", "cross_dc_pd"):
                # No relay: every request took P->MD and main answered it.
                assert setup["pipelines"] == {"prefill_main": setup["requests"]}
                assert setup["outcomes"]["main"] == setup["requests"]
        # Answers of the agentic shape: tens to hundreds of tokens.
        assert workload["output_token_stats"]["min"] >= 64
    setups = data["setups"]
    handoffs = sum(setups["pdd"]["outcomes"][k] for k in ("handoff_one_shot", "handoff_catch_up"))
    assert handoffs > 0, setups["pdd"]["outcomes"]
    assert setups["pdd"]["placement"] == "congestion-aware"
    # PDD as deployed places by the TTFT budget (1.15 x same-DC's P50); the budget-free one not.
    assert setups["pdd"]["ttft_budget_s"] == pytest.approx(
        1.15 * setups["same_dc_pd"]["ttft_p50_s"], abs=1e-3)
    assert setups["pdd_no_budget"]["ttft_budget_s"] is None
    assert set(setups["pdd"]["wan_line_by_class"]) == {
        "needed_now_sent_bytes", "cache_only_sent_bytes", "dropped_cache_only_bytes"}
    assert setups[other]["placement"] == "idle-line"
    # The prefill is busy in every setup; main-a only in same-DC PD.
    assert setups["same_dc_pd"]["cpu"]["prefill"]["cpu_s"] > 0
    assert setups["same_dc_pd"]["cpu"]["main-a"]["cpu_s"] > setups["pdd"]["cpu"]["main-a"]["cpu_s"]
    # Every byte of main's KV crossed the line in cross-DC PD, none did in same-DC PD.
    cross, same = setups["cross_dc_pd"], setups["same_dc_pd"]
    # (as wire bytes: auto codes copies where it pays; the demo-wide coded ratio, 5 % slack
    # for this setup's share of coded copies)
    codec = data["wan_kv_codec"]
    ratio = codec["coded_raw_bytes"] / codec["coded_wire_bytes"] if codec["coded_wire_bytes"] else 1.0
    assert cross["wan_bytes_a_to_b"] * ratio * 1.05 >= cross["kv_bytes_to_main"] > 0
    assert same["wan_bytes"] < 100_000, same["wan_bytes"]
    assert set(data["bar"]["checks"]) >= {"pdd_p99", "pdd_p50", "cross_dc_p99", "handoffs",
                                          "idle_line_p_to_md_wait"}
    # Issue 34's idle-line goal: every PDD setup's P->MD requests counted (0 is a count).
    waits = data["p_to_md_wait_over_alone"]
    assert waits["idle_line_setup"] == other
    assert set(waits["setups"]) == {"pdd", "pdd_no_budget", other}
    assert waits["setups"][other]["p_to_md_requests"] == sum(
        1 for r in setups[other]["rows"]
        if r["pipeline"] == "prefill_main" and r["outcome_kind"] == "main")
    assert not data["leaks"], data["leaks"]
    assert data["cleanup"] == {"namespaces_left": [], "server_processes_left": [],
                               "cgroups_left": []}
    for figure in ("ttft.png", "stages.png"):
        assert (out / figure).stat().st_size > 0


def _assert_nothing_left(stderr: str) -> None:
    match = re.search(r"cleanup: namespaces (\[.*?\]) left (\[.*?\]), "
                      r"server processes (\[.*?\]) left (\[.*?\]), "
                      r"cgroups (\[.*?\]) left (\[.*?\])", stderr)
    assert match, stderr[-4000:]
    names, names_left, pids, pids_left, groups, groups_left = (
        json.loads(g.replace("'", '"')) for g in match.groups())
    assert names and names_left == [] and pids_left == [] and groups and groups_left == []
    assert not any(netns.exists(n) for n in names)
    assert not any(os.path.exists(f"/proc/{p}") and netns._alive(p) for p in pids)
    assert not any((CGROUP_CPU / g).exists() for g in groups)


def test_server_crash_mid_run_still_cleans_up(background):
    proc = background.result(timeout_s=900)  # --quick --inject-crash 1, started in the background
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "died during the run" in proc.stderr, proc.stderr[-4000:]
    _assert_nothing_left(proc.stderr)


def test_ctrl_c_during_start_up_leaves_nothing_behind(tmp_path):
    # SIGINT at its default, as a terminal would deliver it.
    proc = subprocess.Popen([sys.executable, str(DEMO), "--quick", "--out", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        for line in proc.stdout:
            if line.startswith("starting the WAN line"):
                break
        # Until every server has spawned its first SGLang subprocess (two processes in its
        # cgroup): namespaces, cgroups, launchers and children all exist, mid start-up.
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not _every_server_started(proc.pid):
            time.sleep(0.2)
        groups = _cgroups_of(proc.pid)
        assert len(groups) == len(SERVERS), groups
        assert _every_server_started(proc.pid), [
            (g, (CGROUP_CPU / g / "cgroup.procs").read_text().split()) for g in groups]
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert "demo interrupted" in stderr, stderr[-4000:]
    # A cgroup can only be removed once no task is left in it: no server process survived.
    assert _cgroups_of(proc.pid) == []
    _assert_nothing_left(stderr)


def test_refuses_without_a_cpu_controller(tmp_path):
    proc = run_demo(["--quick", "--cgroup-cpu-root", str(tmp_path / "no-cgroup"),
                     "--out", str(tmp_path)], timeout_s=60)
    assert proc.returncode == 2
    assert "no cgroup v1 CPU controller" in proc.stderr, proc.stderr
