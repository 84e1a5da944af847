#!/usr/bin/env python3
"""Faults lose nothing: a steady load through the PDD router while each fault is injected in turn.

    python scripts/fault_suite.py --out DIR [--quick]

Real prefill, relay and main SGLang servers (the tiny CPU model) and the router, with main behind
the emulated WAN line (needs root, like make demo). Faults: the relay dies, main dies before and
after the handoff, prefill dies, the WAN line stalls past the transfer timeout. --quick runs the
first, the second and the stall. Writes DIR/faults.json:
faults.{name}.{sent,completed,errored,lost,leaked_slots,recovery_s} and the details behind them.
Exit status 1 if any request was lost or any KV slot leaked.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pdd_sglang.dev.faults import faults  # noqa: E402
from pdd_sglang.dev.faults.suite import run_suite  # noqa: E402
from pdd_sglang.dev.wan_emulator import check_prerequisites  # noqa: E402


def _raise_exit(signum, frame):
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "out" / "faults")
    parser.add_argument("--quick", action="store_true", help="three faults, shorter phases")
    parser.add_argument("--only", nargs="+", choices=[f.name for f in faults.ALL], default=None)
    parser.add_argument("--rate-mbit", type=float, default=20.0)
    parser.add_argument("--rtt-ms", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--logs", type=Path, default=None,
                        help="the servers' and the router's logs (default: a new folder in /tmp)")
    args = parser.parse_args(argv)
    try:
        check_prerequisites()
    except (PermissionError, FileNotFoundError) as err:
        print(f"fault suite: cannot emulate the WAN line here: {err}", file=sys.stderr)
        return 2
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_exit)
    chosen = faults.QUICK if args.quick else faults.ALL
    if args.only:
        chosen = [f for f in faults.ALL if f.name in args.only]
    log_dir = args.logs or Path(tempfile.mkdtemp(prefix="pdd-faults-logs-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    report = run_suite(chosen, log_dir, rate_mbit=args.rate_mbit, rtt_ms=args.rtt_ms,
                       warmup_s=4.0 if args.quick else 10.0, after_s=3.0 if args.quick else 10.0,
                       seed=args.seed, progress=lambda text: print(text, flush=True))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "faults.json").write_text(json.dumps(report, indent=2))
    print(f"\n{'fault':26} {'sent':>5} {'done':>5} {'error':>5} {'lost':>5} {'leaked':>7} "
          f"{'recovery s':>10}")
    bad = False
    for name, row in report["faults"].items():
        if "error" in row:
            print(f"{name:26} not measured: {row['error']}")
            bad = True
            continue
        print(f"{name:26} {row['sent']:5} {row['completed']:5} {row['errored']:5} "
              f"{row['lost']:5} {row['leaked_slots']:7} {str(row['recovery_s']):>10}")
        bad |= row["lost"] > 0 or row["leaked_slots"] != 0
    print(f"wrote {args.out / 'faults.json'} ({report['duration_s']} s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
