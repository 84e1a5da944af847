#!/usr/bin/env python3
"""Benchmark the WAN emulator: measured rate, RTT and jitter against the set values, and the
forwarder's ceiling (the same line with no rate limit).

    sudo python3 scripts/wan_check.py                       # 100 Mbit/s, 40 ms, +-4 ms
    sudo python3 scripts/wan_check.py --rate-mbit 200 --rtt-ms 20 --jitter-ms 0
    sudo python3 scripts/wan_check.py --no-ceiling --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pdd_sglang.dev.wan_emulator import WanLine, check_prerequisites, measure  # noqa: E402
from pdd_sglang.dev.wan_emulator.__main__ import format_report, run_checks  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate-mbit", type=float, default=100.0)
    parser.add_argument("--rtt-ms", type=float, default=40.0)
    parser.add_argument("--jitter-ms", type=float, default=4.0)
    parser.add_argument("--seconds", type=float, default=5.0, help="each bulk transfer")
    parser.add_argument("--no-ceiling", action="store_true", help="skip the unlimited-rate run")
    parser.add_argument("--json", default=None, help="also write all figures to this file")
    args = parser.parse_args()
    check_prerequisites()

    figures = {}
    print(f"== line as set ({args.rate_mbit:g} Mbit/s, {args.rtt_ms:g} ms, +-{args.jitter_ms:g} ms)")
    with WanLine(args.rate_mbit, args.rtt_ms, args.jitter_ms) as line:
        figures["line"] = run_checks(line, bulk_seconds=args.seconds)
        figures["line"]["bulk_b_to_a"] = measure.bulk_rate(line, seconds=args.seconds, src="b",
                                                           dst="a")
    print(format_report(figures["line"]))
    back = figures["line"]["bulk_b_to_a"]
    print(f"bulk TCP B->A: steady goodput {back['steady_goodput_mbit']:.1f} Mbit/s")

    if not args.no_ceiling:
        figures["ceiling"] = {}
        for rtt in (args.rtt_ms, 2.0):
            with WanLine(0, rtt, 0) as line:
                bulk = measure.bulk_rate(line, seconds=args.seconds)
            figures["ceiling"][f"rtt_{rtt:g}ms"] = bulk
            print(f"== forwarder ceiling (no rate limit, RTT {rtt:g} ms): steady goodput "
                  f"{bulk['steady_goodput_mbit']:.0f} Mbit/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
