#!/usr/bin/env python3
"""Faults lose nothing: a steady load through the PDD router while each fault is injected in turn.

    python scripts/fault_suite.py --out DIR [--quick]
    python scripts/fault_suite.py --soak MINUTES [--seed N] [--out DIR] [--quick]

Real prefill, relay and main SGLang servers (the tiny CPU model) and the router, with main behind
the emulated WAN line (needs root, like make demo). Faults: the relay dies, main dies before and
after the handoff, prefill dies, the WAN line stalls past the transfer timeout. --quick runs the
first, the second and the stall. Writes DIR/faults.json: faults.{name}.{sent, completed, errored,
lost, leaked_slots, recovery_s, first_token_after_s, line_floor_s} and the details behind them.
Exit status 1 if any request was lost or any KV slot leaked.

--soak MINUTES: the chaos soak instead (pdd_sglang/dev/faults/soak.py): multi-turn load for that
long while seeded random faults strike one at a time, every answer then checked token for token
against a plain server. Writes DIR/soak.json (default DIR out/soak) and DIR/soak_detail.json;
exit status 1 unless nothing was lost, mismatched, leaked or dead. With --quick or --only the
suite's faults run first on the same servers, with the soak's flags (and DIR/faults.json is
written as well).
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

from pdd_sglang.dev import results as published  # noqa: E402
from pdd_sglang.dev.faults import faults  # noqa: E402
from pdd_sglang.dev.faults.checks import bar  # noqa: E402
from pdd_sglang.dev.faults.soak import run_soak  # noqa: E402
from pdd_sglang.dev.faults.suite import run_suite  # noqa: E402
from pdd_sglang.dev.wan_emulator import check_prerequisites  # noqa: E402


def _raise_exit(signum, frame):
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None,
                        help="default out/faults, with --soak out/soak")
    parser.add_argument("--quick", action="store_true", help="three faults, shorter phases")
    parser.add_argument("--only", nargs="+", choices=[f.name for f in faults.ALL], default=None)
    parser.add_argument("--soak", type=float, default=None, metavar="MINUTES",
                        help="the chaos soak, this many minutes of load")
    parser.add_argument("--reference-url", default=None,
                        help="--soak: a running plain server to check answers against "
                             "(default: start one of the pristine wheel)")
    parser.add_argument("--rate-mbit", type=float, default=20.0)
    parser.add_argument("--rtt-ms", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--logs", type=Path, default=None,
                        help="the servers' and the router's logs (default: a new folder in /tmp)")
    published.add_publish_flag(parser)
    args = parser.parse_args(argv)
    args.out = args.out or REPO / "out" / ("soak" if args.soak is not None else "faults")
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
    args.out.mkdir(parents=True, exist_ok=True)
    bad = False

    def suite(cluster=None) -> None:
        nonlocal bad
        report = run_suite(chosen, log_dir, rate_mbit=args.rate_mbit, rtt_ms=args.rtt_ms,
                           warmup_s=4.0 if args.quick else 10.0,
                           after_s=3.0 if args.quick else 10.0, seed=args.seed,
                           progress=lambda text: print(text, flush=True), cluster=cluster)
        (args.out / "faults.json").write_text(json.dumps(report, indent=2))
        bad |= _print_suite(report)
        print(f"wrote {args.out / 'faults.json'} ({report['duration_s']} s)", flush=True)
        if args.publish:
            published.publish("faults", report)

    if args.soak is None:
        suite()
        return 1 if bad else 0
    report, detail = run_soak(log_dir, minutes=args.soak, seed=args.seed,
                              rate_mbit=args.rate_mbit, rtt_ms=args.rtt_ms,
                              reference_url=args.reference_url,
                              before=suite if args.quick or args.only else None,
                              progress=lambda text: print(text, flush=True))
    (args.out / "soak.json").write_text(json.dumps(report, indent=2))
    (args.out / "soak_detail.json").write_text(json.dumps(detail, indent=2))
    if args.publish:
        published.publish("soak", report, files={"soak_detail.json": args.out / "soak_detail.json"})
    failures = bar(report)
    print(f"\nsoak {args.soak:g} min, seed {args.seed}: {report['requests']} requests, "
          f"{report['completed']} completed, {report['errored']} errored, {report['lost']} lost; "
          f"token mismatches {report['token_mismatches']} (near-ties "
          f"{report['token_near_ties']}, not counted), digest mismatches "
          f"{report['digest_mismatches']}; leaked slots {report['leaked_slots']}, locks "
          f"{report['leaked_locks']}, rooms {report['leaked_rooms']}; dead threads "
          f"{len(report['dead_threads'])}; faults {report['faults']}; recovery s "
          f"{report['recovery_s']}")
    print("soak: " + ("PASS" if not failures else "FAIL: " + "; ".join(failures)))
    print(f"wrote {args.out / 'soak.json'}")
    return 1 if bad or failures else 0


def _print_suite(report: dict) -> bool:
    """The suite's table; whether any fault lost a request or leaked a slot."""
    print(f"\n{'fault':26} {'sent':>5} {'done':>5} {'error':>5} {'lost':>5} {'leaked':>7} "
          f"{'recovery s':>10} {'1st token s':>11} {'line floor s':>12}")
    bad = False
    for name, row in report["faults"].items():
        if "error" in row:
            print(f"{name:26} not measured: {row['error']}")
            bad = True
            continue
        print(f"{name:26} {row['sent']:5} {row['completed']:5} {row['errored']:5} "
              f"{row['lost']:5} {row['leaked_slots']:7} {str(row['recovery_s']):>10} "
              f"{str(row.get('first_token_after_s')):>11} {str(row.get('line_floor_s')):>12}")
        bad |= row["lost"] > 0 or row["leaked_slots"] != 0
    return bad


if __name__ == "__main__":
    sys.exit(main())
