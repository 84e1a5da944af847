"""The handoff microbenchmark (scripts/bench_handoff.py) and the line-sharing one
(wan_emulator.copy_overlap) in a tiny configuration: real Mooncake TCP
writes and real control-channel messages across a real emulated line, no SGLang server.

Asserts the JSON's structure and relations that physics or the protocol impose (payload sizes,
the line's lower bound on latency, the KV really landing), never timing thresholds a busy machine
could break. Needs root and /dev/net/tun; skips with the reason otherwise. About 30 s.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from pdd_sglang.dev.wan_emulator import check_prerequisites, netns


def _unavailable_reason() -> str | None:
    try:
        check_prerequisites()
    except OSError as exc:
        return str(exc)
    if importlib.util.find_spec("mooncake") is None:
        return "the Mooncake transfer engine is not installed"
    return None


pytestmark = pytest.mark.skipif(_unavailable_reason() is not None,
                                reason=_unavailable_reason() or "")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO_ROOT, "scripts", "bench_handoff.py")
RATE_MBIT, RTT_MS, TOKENS, TRIALS = 100.0, 20.0, 100, 5
SLACK_MS = 0.5  # timer granularity and rounding, not a noise allowance: the bounds are hard


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")])))


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("handoff")
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--out", str(out), "--no-server", "--trials", str(TRIALS),
         "--warmup", "1", "--rate-mbit", str(RATE_MBIT), "--rtt-ms", str(RTT_MS),
         "--jitter-ms", "0", "--tokens", str(TOKENS)],
        capture_output=True, text=True, timeout=300, env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    # stdout is the table alone (progress goes to stderr), printed after the JSON is written.
    table = proc.stdout.splitlines()
    assert table[0].startswith("handoff of 100 tokens") and "token IDs" in proc.stdout, table
    return json.loads((out / "handoff.json").read_text())


def test_json_carries_what_the_figure_reads(result):
    assert result["line"]["rate_mbit"] == RATE_MBIT and result["line"]["rtt_ms"] == RTT_MS
    assert result["tokens"] == TOKENS and result["trials"] == TRIALS
    for path in ("kv", "kv_tiny_model", "token_ids"):
        row = result["handoff"][path]
        for key in ("payload_bytes", "mean_ms", "max_ms", "std_ms", "trials"):
            assert key in row, (path, key)
        assert row["trials"] == TRIALS
        assert row["min_ms"] <= row["mean_ms"] <= row["max_ms"]
        assert row["std_ms"] >= 0
    assert result["recompute"]["measured"] is False
    assert result["handoff"]["token_ids"]["includes_recompute"] is False
    assert len(result["per_trial"]) == 3 * TRIALS
    # The line's namespaces are gone once the script has exited.
    assert not any(netns.exists(n) for n in result["line"]["namespaces"].values())


def test_payloads_token_ids_are_tiny_next_to_the_kv(result):
    h, per_token = result["handoff"], result["kv_bytes_per_token"]
    message = h["token_ids"]["payload_bytes"]
    assert per_token["realistic"] == 50000  # configs/models/moe_1t_50kb.toml
    assert h["kv"]["kv_bytes"] == TOKENS * per_token["realistic"]
    assert h["kv_tiny_model"]["kv_bytes"] == TOKENS * per_token["tiny_model"]
    for path in ("kv", "kv_tiny_model"):
        assert h[path]["payload_bytes"] == h[path]["kv_bytes"] + message
    # 4 bytes per token ID plus a small envelope.
    assert 4 * TOKENS < message < 4 * TOKENS + 200
    assert message < h["kv_tiny_model"]["payload_bytes"] < h["kv"]["payload_bytes"]
    # What crossed the line (kernel counters, both directions) is at least the payload.
    for path in ("kv", "kv_tiny_model", "token_ids"):
        assert h[path]["wire_bytes_mean"] >= h[path]["payload_bytes"], path


def test_the_kv_really_crossed_with_mooncake(result):
    assert result["failed_writes"] == 0
    for path in ("kv", "kv_tiny_model"):
        assert result["handoff"][path]["kv_verified"] is True
    for row in result["per_trial"]:
        if row["kv_bytes"]:
            assert row["kv_verified"] is True
            # The relay's write lies inside main's window (ready sent -> tokens received).
            assert 0 < row["mooncake_write_ms"] < row["ms"], row
    assert result["refusals"] == {"main": {}, "relay": {}}


def test_latency_respects_the_line(result):
    """No trial beats the line: the token IDs need a round trip (ready out, tokens back); the KV
    also needs its bytes serialised at the set rate, all in the same A->B direction (FIFO)."""
    h = result["handoff"]
    assert h["token_ids"]["min_ms"] >= RTT_MS - SLACK_MS
    for path in ("kv", "kv_tiny_model"):
        serialise_ms = h[path]["kv_bytes"] * 8 / (RATE_MBIT * 1e6) * 1e3
        assert h[path]["min_ms"] >= RTT_MS + serialise_ms - SLACK_MS, (path, h[path])
    assert h["kv"]["min_ms"] > h["token_ids"]["min_ms"]


def test_ctrl_c_leaves_nothing_behind(tmp_path):
    # As from a terminal: a shell that runs its jobs in the background without job control
    # (CI's, perhaps) hands them SIGINT ignored, and Ctrl-C would never arrive.
    proc = subprocess.Popen(
        [sys.executable, SCRIPT, "--out", str(tmp_path), "--no-server", "--trials", "500",
         "--rtt-ms", "10", "--jitter-ms", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        first = proc.stderr.readline()
        assert first.startswith("line up:"), first
        names = first.rsplit("namespaces ", 1)[1].strip().split(" / ")
        assert "running" in proc.stderr.readline()
        time.sleep(2.0)  # mid-run: both peers and their Mooncake engines are up
        inside = [pid for name in names for pid in netns.pids_inside(name)]
        assert inside, "the peers should be running inside the line's namespaces"
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    assert not (tmp_path / "handoff.json").exists()
    assert not any(netns.exists(n) for n in names)
    for pid in inside:
        assert not os.path.exists(f"/proc/{pid}") or _zombie(pid), f"process {pid} left running"


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_copy_overlap_times_a_small_copy_behind_a_big_one(tmp_path):
    """The line-sharing microbenchmark of profile_cpu.py (wan_emulator.copy_overlap), tiny: real
    Mooncake copies across a real line; the times obey the line's physics and every trial is
    placed between fair sharing and in-order copies."""
    from pdd_sglang.dev.wan_emulator import copy_overlap

    # Small on purpose: it runs beside the suite's background quick demo, whose servers share
    # the machine's two cores (a second of line traffic, not the profile's 30).
    rate_mbit, big, small = 20.0, 384 << 10, 32 << 10
    result = copy_overlap.run(tmp_path, rate_mbit=rate_mbit, rtt_ms=10.0, jitter_ms=0.0,
                              big_bytes=big, small_bytes=small, delay_s=0.05, trials=2,
                              block_count=4, log=lambda _: None)
    rate = rate_mbit * 1e6 / 8
    assert len(result["trials"]) == 2
    for trial in result["trials"]:
        assert trial["small_alone_s"] >= small / rate
        assert trial["small_overlapped_s"] >= small / rate
        assert trial["big_s"] >= big / rate
        # the big copy had started first, so it cannot end before the small one started
        assert trial["big_left_at_small_start_s"] > 0
        assert trial["fair_s"] == pytest.approx(2 * trial["small_alone_s"])
        assert set(trial["tcp"]) == set(copy_overlap.TCP_COUNTERS)
    assert result["copy_order"] in ("fair", "in_order")
    assert len(result["positions"]) == 2


def test_copy_overlap_positions_a_trial_between_fair_and_in_order():
    from pdd_sglang.dev.wan_emulator.copy_overlap import blocks, summarise

    trials = [{"small_alone_s": 0.5, "small_overlapped_s": 1.0, "big_left_at_small_start_s": 5.0},
              {"small_alone_s": 0.5, "small_overlapped_s": 5.5, "big_left_at_small_start_s": 5.0},
              {"small_alone_s": 0.5, "small_overlapped_s": 3.25, "big_left_at_small_start_s": 5.0}]
    result = summarise(trials)
    assert result["positions"] == [0.0, 1.0, 0.5]
    assert result["median_position"] == 0.5 and result["copy_order"] == "in_order"
    assert summarise(trials[:1])["copy_order"] == "fair"
    assert blocks(10, 4) == [3, 3, 2, 2] and sum(blocks(8 << 20, 8)) == 8 << 20
