"""Two Mooncake TCP copies across the emulated line at once: what a copy that starts behind a
big one pays (issue 25: the simulator's line model, ``LinkProfile.copy_order``).

In the demo at load, a short turn's KV copy often starts while a document turn's (about 8 MB)
is still crossing the line. This measures that case with nothing else running: per trial the
sender (cluster A) writes the small copy alone, then starts the big copy and, ``delay_s`` into
it, the small one, each a real Mooncake TCP write of the KV's blocks (one per layer, K and V)
into the receiver's registered buffer (cluster B). It also reads its namespace's TCP counters
(``TcpExt`` in ``/proc/net/netstat``: SYN retransmissions, timeouts), the mechanism's trace.

``run`` returns, per trial, the small copy alone and overlapped, the big copy's time left when
the small one started, and where the overlapped small copy landed between the two ways the
simulator can share the line:

- ``fair``: it shares the line with the big copy from its start (each gets half):
  ``2 x small alone`` while the big one lasts;
- ``in_order``: it waits for the big copy's bytes: ``big left + small alone``.

``position`` = (overlapped - fair) / (in_order - fair): 0 is fair sharing, 1 is in order.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from pdd_sglang.dev.wan_emulator import WanLine
from pdd_sglang.dev.wan_emulator.handoff_peers import _mooncake, _report, _stdin_closed
from pdd_sglang.dev.wan_emulator.line import stop_process

PEER_READY_TIMEOUT_S = 120.0
TCP_COUNTERS = ("TCPSynRetrans", "TCPTimeouts", "TCPLostRetransmit")


def blocks(nbytes: int, count: int) -> list[int]:
    """A copy's blocks: the KV of one request per layer, K and V (``count`` of them)."""
    size, extra = divmod(nbytes, count)
    return [size + (1 if i < extra else 0) for i in range(count)]


def tcp_counters() -> dict:
    """This network namespace's TcpExt counters named in TCP_COUNTERS."""
    lines = Path("/proc/net/netstat").read_text().splitlines()
    for names, values in zip(lines[::2], lines[1::2]):
        if names.startswith("TcpExt:"):
            table = dict(zip(names.split()[1:], (int(v) for v in values.split()[1:])))
            return {k: table.get(k, 0) for k in TCP_COUNTERS}
    return {k: 0 for k in TCP_COUNTERS}


# ---- the two peers -----------------------------------------------------------------------------
def run_receiver(args) -> None:
    engine, buffer, ptr, session = _mooncake(args.host, args.big + args.small)
    _report({"ready": True, "session_id": session, "buffer_ptr": ptr})
    _stdin_closed().wait()
    del engine, buffer


def run_sender(args) -> None:
    engine, src, src_ptr, _ = _mooncake(args.host, args.big + args.small)

    def write(nbytes: int, offset: int) -> float:
        sizes = blocks(nbytes, args.blocks)
        starts = [offset + sum(sizes[:i]) for i in range(len(sizes))]
        began = time.perf_counter()
        ret = engine.batch_transfer_sync_write(args.target_session,
                                               [src_ptr + s for s in starts],
                                               [args.target_ptr + s for s in starts], sizes)
        if ret != 0:
            raise RuntimeError(f"Mooncake write of {nbytes} B failed ({ret})")
        return time.perf_counter() - began

    write(args.small, args.big)                    # warm-up: engine, session, first connection
    trials = []
    for _ in range(args.trials):
        alone = write(args.small, args.big)
        before = tcp_counters()
        big_ends = {}

        def big_copy():
            big_ends["began"] = time.perf_counter()
            write(args.big, 0)
            big_ends["ended"] = time.perf_counter()
        thread = threading.Thread(target=big_copy)
        thread.start()
        time.sleep(args.delay_s)
        small_began = time.perf_counter()
        overlapped = write(args.small, args.big)
        thread.join()
        after = tcp_counters()
        trials.append({"small_alone_s": alone, "small_overlapped_s": overlapped,
                       "big_s": big_ends["ended"] - big_ends["began"],
                       "big_left_at_small_start_s": big_ends["ended"] - small_began,
                       "tcp": {k: after[k] - before[k] for k in TCP_COUNTERS}})
        time.sleep(args.pause_s)                   # the line drains between trials
    _report({"trials": trials})


# ---- the orchestrator --------------------------------------------------------------------------
def summarise(trials: list[dict]) -> dict:
    """Each trial's position between fair sharing (0) and in-order copies (1), and the median."""
    for t in trials:
        fair = 2 * t["small_alone_s"]
        in_order = max(t["big_left_at_small_start_s"], 0.0) + t["small_alone_s"]
        span = in_order - fair
        t["fair_s"], t["in_order_s"] = fair, in_order
        t["position"] = (t["small_overlapped_s"] - fair) / span if span > 0 else None
    positions = [t["position"] for t in trials if t["position"] is not None]
    return {"trials": trials, "positions": positions,
            "median_position": statistics.median(positions) if positions else None,
            "copy_order": (None if not positions else
                           "in_order" if statistics.median(positions) >= 0.5 else "fair")}


def run(out_dir: Path, *, rate_mbit: float, rtt_ms: float, jitter_ms: float,
        big_bytes: int, small_bytes: int, delay_s: float, trials: int, block_count: int,
        log: Callable[[str], None] = print) -> dict:
    import os

    from pdd_sglang.dev.wan_emulator.handoff_bench import REPO, _read_json_line

    out_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                                     os.environ.get("PYTHONPATH")]))}
    common = ["--big", str(big_bytes), "--small", str(small_bytes)]
    line = WanLine(rate_mbit, rtt_ms, jitter_ms, seed=2)
    receiver = sender = None
    logs = {name: open(out_dir / f"overlap_{name}.log", "ab") for name in ("receiver", "sender")}
    try:
        line.start(log_path=str(out_dir / "overlap_line.log"))
        module = [sys.executable, "-m", "pdd_sglang.dev.wan_emulator.copy_overlap"]
        receiver = line.popen("b", [*module, "receiver", "--host", line.address("b"), *common],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=logs["receiver"], env=env, text=True)
        target = _read_json_line(receiver, "receiver", PEER_READY_TIMEOUT_S)
        log(f"copy overlap: {trials} trials of a {small_bytes} B copy {delay_s:g} s into a "
            f"{big_bytes} B one ...")
        sender = line.popen("a", [*module, "sender", "--host", line.address("a"), *common,
                                  "--target-session", target["session_id"],
                                  "--target-ptr", str(target["buffer_ptr"]),
                                  "--delay-s", str(delay_s), "--trials", str(trials),
                                  "--blocks", str(block_count)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=logs["sender"], env=env, text=True)
        budget = trials * (big_bytes / (rate_mbit * 1e6 / 8) * 3 + 30) + 120
        report = _read_json_line(sender, "sender", budget)
    finally:
        stop_process(sender)
        stop_process(receiver)
        line.stop()
        for handle in logs.values():
            handle.close()
    result = summarise(report["trials"])
    result.update({"big_bytes": big_bytes, "small_bytes": small_bytes, "delay_s": delay_s,
                   "blocks_per_copy": block_count, "forwarder_stats": line.last_stats})
    for t in result["trials"]:
        log(f"  small alone {t['small_alone_s']:.2f} s, overlapped {t['small_overlapped_s']:.2f} s "
            f"(fair {t['fair_s']:.2f}, in order {t['in_order_s']:.2f}); tcp {t['tcp']}")
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("role", choices=("receiver", "sender"))
    parser.add_argument("--host", required=True)
    parser.add_argument("--big", type=int, required=True)
    parser.add_argument("--small", type=int, required=True)
    parser.add_argument("--target-session", default="")
    parser.add_argument("--target-ptr", type=int, default=0)
    parser.add_argument("--delay-s", type=float, default=1.0)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--pause-s", type=float, default=1.0)
    args = parser.parse_args(argv)
    (run_receiver if args.role == "receiver" else run_sender)(args)


if __name__ == "__main__":
    main()
