"""Checks of the WAN emulator against what it promises: rate, RTT, jitter, order, cleanup.

Every figure is measured across a real line (namespaces + TUN + forwarder), never assumed.
Needs root and /dev/net/tun; skips with the reason otherwise. About 40 s.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from pdd_sglang.dev.wan_emulator import WanLine, check_prerequisites, cleanup_stale, measure, netns


def _unavailable_reason() -> str | None:
    if os.geteuid() != 0:
        return "WAN emulator tests need root (network namespaces, TUN devices)"
    if not os.path.exists("/dev/net/tun"):
        return "/dev/net/tun is missing: no TUN support here"
    if shutil.which("ip") is None:
        return "iproute2 'ip' is not installed (apt-get install -y iproute2)"
    try:
        check_prerequisites()
    except OSError as exc:
        return str(exc)
    return None


pytestmark = pytest.mark.skipif(_unavailable_reason() is not None,
                                reason=_unavailable_reason() or "")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RATE_MBIT = 100.0
RTT_MS = 40.0
# Forwarding adds about 0.5 ms per round trip on this kind of machine (two select() wake-ups
# and Python hops per direction); allow a few ms, as the issue asks.
RTT_TOLERANCE_MS = 3.0


@pytest.fixture(scope="module")
def steady_line():
    with WanLine(RATE_MBIT, RTT_MS, 0.0, seed=1) as line:
        yield line


def _process_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _assert_gone(line_namespaces: dict, pids: list[int]) -> None:
    for name in line_namespaces.values():
        assert not netns.exists(name), f"namespace {name} left behind"
    for pid in pids:
        assert not _process_alive(pid), f"process {pid} left running"
    host_links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert "wan0" not in host_links, "a line device leaked into the host namespace"


# (a) rate -------------------------------------------------------------------------------------
@pytest.mark.parametrize("src,dst,seconds", [("a", "b", 4.0), ("b", "a", 3.0)])
def test_bulk_tcp_copy_runs_at_the_set_rate(steady_line, src, dst, seconds):
    # Goodput excludes IP+TCP headers (~3.5% at MTU 1500), so about 0.965 is a perfect line;
    # above 1.02 would mean the limiter leaks. A copy during which the forwarder itself ran
    # late by over 5 ms (starved of CPU by the suite's background servers: the line cannot
    # keep its rate without a core) measured the machine, not the limiter: it is measured
    # again, twice at most, and the last measurement decides.
    for attempt in range(3):
        before = _late_rounds(steady_line)
        result = measure.bulk_rate(steady_line, seconds=seconds, warmup_s=1.0, src=src, dst=dst)
        ratio = result["steady_goodput_mbit"] / RATE_MBIT
        starved = _late_rounds(steady_line) > before
        if 0.90 <= ratio or not starved:
            break
    assert 0.90 <= ratio <= 1.02, (f"{src}->{dst} (attempt {attempt + 1}): {result}; forwarder: "
                                   f"{steady_line.stats()}; load average {os.getloadavg()}")


def _late_rounds(line) -> int:
    """Release rounds in which the forwarder ran over 5 ms late, both directions so far."""
    return sum(side["rounds_late_over_5ms"] for side in line.stats().values())


def test_forwarder_reports_its_own_counters(steady_line):
    before = steady_line.stats()
    measure.round_trips(steady_line, count=5)
    after = steady_line.stats()
    assert after["a_to_b"]["packets"] > before["a_to_b"]["packets"]
    assert after["b_to_a"]["packets"] > before["b_to_a"]["packets"]


def test_the_line_counts_what_crossed_it(steady_line):
    before_a, before_b = steady_line.counters("a"), steady_line.counters("b")
    result = measure.bulk_rate(steady_line, seconds=1.0, warmup_s=0.2)
    sent = steady_line.counters("a")["tx_bytes"] - before_a["tx_bytes"]
    delivered = steady_line.counters("b")["rx_bytes"] - before_b["rx_bytes"]
    # Headers make the wire bytes exceed the payload; the line's tail drops (TCP probing for
    # bandwidth) make A's "sent" exceed B's "delivered".
    assert result["bytes"] < delivered <= sent


def test_cluster_b_has_no_path_but_the_line(steady_line):
    b = steady_line.namespace("b")
    links = subprocess.run(["ip", "-n", b, "-o", "link"], capture_output=True, text=True).stdout
    assert sorted(l.split(":")[1].strip() for l in links.splitlines()) == ["lo", "wan0"]
    routes = subprocess.run(["ip", "-n", b, "route"], capture_output=True, text=True).stdout
    assert all("dev wan0" in r for r in routes.splitlines()), routes
    outside = steady_line.socket("b")
    with pytest.raises(OSError, match="unreachable"):
        outside.connect(("192.0.2.1", 80))  # TEST-NET: nothing in B routes there
    outside.close()


def test_local_traffic_in_cluster_a_stays_off_the_line(steady_line):
    before = steady_line.counters("a")
    server, client = steady_line.socket("a"), steady_line.socket("a")
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    client.connect(server.getsockname())
    conn, _ = server.accept()
    client.sendall(b"k" * 1_000_000)
    client.close()
    got = 0
    while chunk := conn.recv(65536):
        got += len(chunk)
    conn.close()
    server.close()
    after = steady_line.counters("a")
    assert got == 1_000_000
    assert after["tx_bytes"] - before["tx_bytes"] < 10_000  # P<->RLD-style loopback is local


# (b) RTT --------------------------------------------------------------------------------------
def test_small_message_round_trip_matches_the_set_rtt(steady_line):
    rtts = measure.round_trips(steady_line, count=50, size=64)
    stats = measure.summarize(rtts)
    # A round trip can never beat the line; it can be stretched by the measuring threads
    # being descheduled (the suite's background servers share the 2 cores: a median of 43.7 ms
    # on a 40 ms line in the ci run of 13:30), so the line's own delay is read from the fastest
    # round trips, and the median and the mean only bound the stretch.
    assert stats["min"] >= RTT_MS - 0.2, f"faster than the line allows: {stats}"
    assert stats["min"] - RTT_MS <= RTT_TOLERANCE_MS, f"the line adds delay: {stats}"
    assert stats["p50"] - RTT_MS <= 3 * RTT_TOLERANCE_MS, stats
    assert stats["mean"] - RTT_MS <= 5 * RTT_TOLERANCE_MS, stats


def test_round_trip_follows_the_setting_not_a_constant():
    with WanLine(RATE_MBIT, 10.0, 0.0) as line:
        stats = measure.summarize(measure.round_trips(line, count=20))
    assert stats["min"] >= 9.8 and stats["min"] - 10.0 <= RTT_TOLERANCE_MS, stats
    assert stats["p50"] - 10.0 <= 3 * RTT_TOLERANCE_MS, stats


# (c) jitter and order ---------------------------------------------------------------------------
def test_jitter_stays_within_bounds_and_nothing_is_reordered():
    jitter_ms = 10.0
    line = WanLine(RATE_MBIT, RTT_MS, jitter_ms, seed=7)
    with line:
        sparse = measure.one_way_probes(line, count=300, burst=1, gap_s=0.002)
        bursts = measure.one_way_probes(line, count=600, burst=30, gap_s=0.005)
        rtts = measure.round_trips(line, count=40, interval_s=0.005)
    low, high = RTT_MS / 2 - jitter_ms / 2, RTT_MS / 2 + jitter_ms / 2
    for probes in (sparse, bursts):
        assert probes["received"] == probes["sent"], probes["received"]
        assert probes["kernel_sent"] == probes["sent"], probes["kernel_sent"]
        assert probes["reordered"] == 0
        assert min(probes["delays_ms"]) >= low - 0.2, min(probes["delays_ms"])  # never early
    # Both ends are kernel stamps, so what lies above the window is the forwarder's own
    # lateness. This VM wakes a sleeping forwarder (real-time priority or not) over 1 ms late
    # in about 10 % of its release rounds, most of all when the machine is idle (measured:
    # 25-41 of about 300 rounds, up to 28 ms), and one late round delays a whole burst of 30:
    # FIFO order packs a burst's departures near the window's top, so a burst's 90th
    # percentile sits on the bound itself (measured 25.6-26.8 ms against 25 on an idle
    # machine). Hence the 90th percentile of the sparse probes, the median of the bursts, and
    # the forwarder's own account of its rounds below.
    sparse_delays, burst_delays = sorted(sparse["delays_ms"]), sorted(bursts["delays_ms"])
    assert sparse_delays[int(len(sparse_delays) * 0.90)] <= high + 1.5, sparse_delays[-40:]
    assert burst_delays[len(burst_delays) // 2] <= high + 1.5, burst_delays[-40:]
    # The jitter must really be there: sparse probes spread over most of the window.
    spread = sparse_delays[-1] - sparse_delays[0]
    assert spread >= 0.6 * jitter_ms, spread
    rtt_stats = measure.summarize(rtts)
    assert rtt_stats["min"] >= RTT_MS - jitter_ms - 0.2, rtt_stats
    assert abs(rtt_stats["p50"] - RTT_MS) <= jitter_ms, rtt_stats
    # The forwarder's account, per release round (one wake-up that releases packets), by how
    # late the round's oldest packet left. Not the maximum, for the reason above.
    for direction in ("a_to_b", "b_to_a"):
        counts = line.last_stats[direction]
        assert counts["release_rounds"] > 0, line.last_stats
        assert counts["rounds_late_over_1ms"] <= 0.25 * counts["release_rounds"], line.last_stats
        assert counts["rounds_late_over_5ms"] <= 0.05 * counts["release_rounds"], line.last_stats


# (d) cleanup ------------------------------------------------------------------------------------
def _start_sleeper(line: WanLine, side: str) -> subprocess.Popen:
    return line.popen(side, ["sleep", "300"])


def _reap(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_cleanup_after_normal_exit():
    with WanLine(RATE_MBIT, 10.0) as line:
        names, forwarder = dict(line.namespaces), line.forwarder_pid
        sleepers = [_start_sleeper(line, "a"), _start_sleeper(line, "b")]
        assert all(netns.exists(n) for n in names.values())
    _reap(sleepers)
    _assert_gone(names, [forwarder] + [p.pid for p in sleepers])


def test_cleanup_after_an_exception():
    with pytest.raises(RuntimeError, match="boom"):
        with WanLine(RATE_MBIT, 10.0) as line:
            names, forwarder = dict(line.namespaces), line.forwarder_pid
            sleepers = [_start_sleeper(line, "b")]
            raise RuntimeError("boom")
    _reap(sleepers)
    _assert_gone(names, [forwarder] + [p.pid for p in sleepers])


def test_cleanup_when_the_forwarder_is_killed():
    with WanLine(RATE_MBIT, 10.0) as line:
        names, forwarder = dict(line.namespaces), line.forwarder_pid
        sleepers = [_start_sleeper(line, "b")]
        os.kill(forwarder, signal.SIGKILL)
        line.proc.wait(timeout=5)
        assert not line.is_up()
    _reap(sleepers)
    _assert_gone(names, [forwarder] + [p.pid for p in sleepers])


def test_cleanup_when_the_owner_is_killed_with_sigkill():
    owner_code = textwrap.dedent("""
        import sys, time
        from pdd_sglang.dev.wan_emulator import WanLine
        line = WanLine(100, 10).start()
        sleeper = line.popen("b", ["sleep", "300"])
        print(line.forwarder_pid, sleeper.pid, flush=True)
        time.sleep(300)
    """)
    env = dict(os.environ, PYTHONPATH=REPO_ROOT)
    owner = subprocess.Popen([sys.executable, "-c", owner_code], stdout=subprocess.PIPE,
                             text=True, env=env)
    forwarder, sleeper = (int(x) for x in owner.stdout.readline().split())
    names = {"a": f"pddA-{forwarder}", "b": f"pddB-{forwarder}"}
    assert all(netns.exists(n) for n in names.values())
    owner.kill()  # no atexit, no handlers: only the forwarder's lifeline can clean up
    owner.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (
            any(netns.exists(n) for n in names.values()) or _process_alive(forwarder)):
        time.sleep(0.1)
    _assert_gone(names, [forwarder, sleeper])


def test_cleanup_stale_removes_leftovers_of_killed_runs():
    dead = subprocess.Popen(["true"])
    dead.wait()
    leftover = f"pddB-{dead.pid}"
    netns.create(leftover)
    try:
        assert leftover in cleanup_stale()
        assert not netns.exists(leftover)
    finally:
        netns.destroy(leftover)


def test_cli_up_then_down_leaves_nothing():
    env = dict(os.environ, PYTHONPATH=REPO_ROOT)
    cli = [sys.executable, "-m", "pdd_sglang.dev.wan_emulator"]
    up = subprocess.run([*cli, "up", "--rate-mbit", "50", "--rtt-ms", "10"], capture_output=True,
                        text=True, env=env, timeout=30)
    assert up.returncode == 0, up.stderr
    info = json.loads(up.stdout)
    try:
        # The detached line outlives the "up" command and carries traffic between the sides.
        assert all(netns.exists(n) for n in info["namespaces"].values())
        probe = subprocess.run(
            [*info["exec_prefix"]["b"], sys.executable, "-c",
             "import socket; s = socket.socket(); s.settimeout(5)\n"
             f"try: s.connect(({info['addresses']['a']!r}, 9))\n"
             "except ConnectionRefusedError: print('refused by A')"],
            capture_output=True, text=True, timeout=30)
        assert "refused by A" in probe.stdout, probe
    finally:
        down = subprocess.run([*cli, "down", "--pid", str(info["pid"])], capture_output=True,
                              text=True, env=env, timeout=30)
    assert down.returncode == 0, down.stderr
    _assert_gone(info["namespaces"], [info["pid"]])


# the WAN line bench's stream reference ------------------------------------------------------
def test_the_stream_reference_acknowledges_a_copy_only_once_it_has_crossed(steady_line, tmp_path):
    """scripts/bench_wan_line.py's reference (stream_reference.py): each timed copy's seconds
    cover its bytes at no more than the line's rate (an acknowledgement sent before the bytes
    landed would time a copy faster than the line), and the processes are gone after."""
    from pdd_sglang.dev.wan_emulator import stream_reference

    copy_bytes = 4 << 20
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
        REPO_ROOT, os.environ.get("PYTHONPATH")]))}
    seconds = stream_reference.measure(steady_line, copy_bytes, 2, 1, tmp_path, "test", env)
    assert len(seconds) == 2
    for s in seconds:
        assert copy_bytes * 8 / s / 1e6 <= RATE_MBIT * 1.05, seconds
    leftovers = subprocess.run(["pgrep", "-f", "wan_emulator.stream_reference"],
                               capture_output=True, text=True).stdout.split()
    assert leftovers == [], leftovers
