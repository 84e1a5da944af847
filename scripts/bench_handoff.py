#!/usr/bin/env python3
"""The handoff microbenchmark over the emulated WAN line: N handed tokens as incremental KV
(real Mooncake TCP write) vs as token IDs (real PDD control channel) plus main's recompute (one
EXTEND on a real SGLang server, tiny model on CPU). Writes DIR/handoff.json; prints a table last.

    sudo python3 scripts/bench_handoff.py --out out/handoff               # 50 trials, ~3 min
    sudo python3 scripts/bench_handoff.py --out out/handoff --quick       # 10 trials, no server
    sudo python3 scripts/bench_handoff.py --out DIR --rate-mbit 200 --rtt-ms 20 --trials 100

Needs root (network namespaces). Everything it starts (line, peers, SGLang server) is stopped
on every exit path, Ctrl-C included.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pdd_sglang.dev.wan_emulator import check_prerequisites  # noqa: E402
from pdd_sglang.dev.wan_emulator.handoff_bench import format_table, run  # noqa: E402


def _raise_exit(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through run()'s finally like Ctrl-C does


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="directory for handoff.json and logs")
    parser.add_argument("--trials", type=int, default=None, help="counted trials (default 50; "
                        "--quick: 10)")
    parser.add_argument("--warmup", type=int, default=2, help="uncounted trials first")
    parser.add_argument("--rate-mbit", type=float, default=100.0)
    parser.add_argument("--rtt-ms", type=float, default=40.0)
    parser.add_argument("--jitter-ms", type=float, default=4.0, help="round trips stay within "
                        "RTT +- this")
    parser.add_argument("--tokens", type=int, default=100, help="handed tokens")
    parser.add_argument("--prefix-tokens", type=int, default=2048,
                        help="main's cached prefix the recompute extends")
    parser.add_argument("--no-server", action="store_true",
                        help="skip the SGLang server: token IDs without recompute")
    parser.add_argument("--quick", action="store_true", help="10 trials, no SGLang server")
    args = parser.parse_args(argv)
    trials = args.trials if args.trials is not None else (10 if args.quick else 50)
    if trials < 2:
        parser.error("--trials must be at least 2 (a standard deviation needs two)")
    check_prerequisites()
    signal.signal(signal.SIGTERM, _raise_exit)
    signal.signal(signal.SIGHUP, _raise_exit)
    try:
        result = run(args.out, trials=trials, warmup=args.warmup, rate_mbit=args.rate_mbit,
                     rtt_ms=args.rtt_ms, jitter_ms=args.jitter_ms, tokens=args.tokens,
                     prefix_tokens=args.prefix_tokens, server=not (args.no_server or args.quick),
                     log=lambda text: print(text, file=sys.stderr, flush=True))
    except KeyboardInterrupt:
        print("interrupted; the line, the peers and the server are stopped", file=sys.stderr)
        return 130
    path = args.out / "handoff.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}", file=sys.stderr)
    print(format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
