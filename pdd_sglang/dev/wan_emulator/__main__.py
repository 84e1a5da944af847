"""CLI for the WAN emulator: ``python -m pdd_sglang.dev.wan_emulator up|down|list|cleanup|check``.

``up`` leaves a detached line running and records it in /run/pdd-wan/<pid>.json so that
``down`` (or ``cleanup``) can remove it later; ``check`` starts a temporary line and measures it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

from pdd_sglang.dev.wan_emulator import measure, netns
from pdd_sglang.dev.wan_emulator.line import WanLine

STATE_DIR = "/run/pdd-wan"


def _line_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rate-mbit", type=float, default=100.0, help="per direction; 0 = unlimited")
    parser.add_argument("--rtt-ms", type=float, default=40.0)
    parser.add_argument("--jitter-ms", type=float, default=0.0, help="round trip stays within RTT +- this")
    parser.add_argument("--queue-ms", type=float, default=None, help="line buffer (default: one RTT)")
    parser.add_argument("--mtu", type=int, default=1500)
    parser.add_argument("--no-realtime", action="store_true", help="forwarder at normal priority")


def _make_line(args, detached: bool = False) -> WanLine:
    return WanLine(args.rate_mbit, args.rtt_ms, args.jitter_ms, queue_ms=args.queue_ms,
                   mtu=args.mtu, detached=detached,
                   realtime=not args.no_realtime)


def cmd_up(args) -> int:
    os.makedirs(STATE_DIR, exist_ok=True)
    line = _make_line(args, detached=True).start(log_path=args.log)
    info = line.describe()
    with open(os.path.join(STATE_DIR, f"{line.forwarder_pid}.json"), "w") as f:
        json.dump(info, f, indent=1)
    print(json.dumps(info, indent=1))
    return 0


def _forwarder_pids(args) -> list[int]:
    if args.all:
        return sorted({int(netns.NAME_PATTERN.match(n).group(1)) for n in netns.list_ours()})
    return [args.pid]


def cmd_down(args) -> int:
    for pid in _forwarder_pids(args):
        names = [f"pddA-{pid}", f"pddB-{pid}"]
        if any(netns.owner_alive(n) for n in names):
            os.kill(pid, signal.SIGTERM)
            # The forwarder removes its namespaces before it exits, so wait for the process
            # itself: "down" returning means nothing of the line is left.
            deadline = time.monotonic() + 10
            while netns.owner_alive(names[0]) and time.monotonic() < deadline:
                time.sleep(0.05)
            if netns.owner_alive(names[0]):
                os.kill(pid, signal.SIGKILL)
                deadline = time.monotonic() + 5
                while netns.owner_alive(names[0]) and time.monotonic() < deadline:
                    time.sleep(0.05)
        for name in names:
            netns.destroy(name)
        try:
            os.remove(os.path.join(STATE_DIR, f"{pid}.json"))
        except FileNotFoundError:
            pass
        print(f"line {pid}: down")
    return 0


def cmd_list(args) -> int:
    for name in netns.list_ours():
        print(f"{name}\t{'up' if netns.owner_alive(name) else 'stale (forwarder gone)'}")
    return 0


def cmd_cleanup(args) -> int:
    removed = netns.cleanup_stale()
    print("removed: " + (" ".join(removed) if removed else "nothing"))
    return 0


def cmd_check(args) -> int:
    with _make_line(args) as line:
        report = run_checks(line, bulk_seconds=args.seconds)
    print(format_report(report))
    if args.json:
        print(json.dumps(report, indent=1))
    return 0


def run_checks(line: WanLine, bulk_seconds: float = 4.0, rtt_count: int = 50) -> dict:
    rtts = measure.round_trips(line, count=rtt_count)
    probes = measure.one_way_probes(line)
    report = {"line": line.describe(), "rtt_ms": measure.summarize(rtts),
              "one_way_ms": measure.summarize(probes["delays_ms"]),
              "probes": {k: probes[k] for k in ("sent", "received", "reordered", "kernel_sent")}}
    if line.rate_mbit > 0 or bulk_seconds > 0:
        report["bulk_a_to_b"] = measure.bulk_rate(line, seconds=bulk_seconds, src="a", dst="b")
    return report


def format_report(report: dict) -> str:
    line = report["line"]
    rtt = report["rtt_ms"]
    one_way = report["one_way_ms"]
    rows = [f"set:      rate {line['rate_mbit']:g} Mbit/s, RTT {line['rtt_ms']:g} ms, "
            f"jitter +-{line['jitter_ms']:g} ms (queue {line['queue_bytes']} B, MTU {line['mtu']})",
            f"RTT:      mean {rtt['mean']:.2f} ms  p50 {rtt['p50']:.2f}  min {rtt['min']:.2f}  "
            f"max {rtt['max']:.2f}  std {rtt['std']:.2f}  (n={rtt['n']}, 64 B TCP ping-pong)",
            f"one-way:  mean {one_way['mean']:.2f} ms  min {one_way['min']:.2f}  "
            f"max {one_way['max']:.2f}  (set {line['rtt_ms'] / 2:g} +- {line['jitter_ms'] / 2:g}); "
            f"received {report['probes']['received']}/{report['probes']['sent']}, "
            f"reordered {report['probes']['reordered']}"]
    bulk = report.get("bulk_a_to_b")
    if bulk:
        ratio = (f" = {bulk['steady_goodput_mbit'] / line['rate_mbit']:.1%} of set"
                 if line["rate_mbit"] else " (unlimited line: forwarder ceiling)")
        rows.append(f"bulk TCP: steady goodput {bulk['steady_goodput_mbit']:.1f} Mbit/s{ratio}; "
                    f"whole transfer {bulk['goodput_mbit']:.1f} Mbit/s "
                    f"({bulk['bytes'] / 1e6:.1f} MB in {bulk['seconds']:.1f} s)")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdd_sglang.dev.wan_emulator", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start a detached line and print its namespaces/addresses")
    _line_args(up)
    up.add_argument("--log", default=None, help="forwarder stderr log file")
    down = sub.add_parser("down", help="stop a line started with 'up'")
    target = down.add_mutually_exclusive_group(required=True)
    target.add_argument("--pid", type=int, help="forwarder pid printed by 'up'")
    target.add_argument("--all", action="store_true", help="every pdd line on this machine")
    sub.add_parser("list", help="list lines and stale leftovers")
    sub.add_parser("cleanup", help="remove leftovers of killed runs")
    check = sub.add_parser("check", help="start a temporary line and measure rate/RTT/jitter")
    _line_args(check)
    check.add_argument("--seconds", type=float, default=4.0, help="bulk transfer duration")
    check.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    handler = {"up": cmd_up, "down": cmd_down, "list": cmd_list, "cleanup": cmd_cleanup,
               "check": cmd_check}[args.command]
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
