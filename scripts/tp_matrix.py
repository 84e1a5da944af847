#!/usr/bin/env python3
"""Prefill, relay and main at every combination of TP 1 and TP 2 on the CPU engine (issue 37).

    .venv/bin/python scripts/tp_matrix.py                      # every combination but make test's
    .venv/bin/python scripts/tp_matrix.py --only P2/R1/M2 P1/R2/M1
    .venv/bin/python scripts/tp_matrix.py --all                # make test's (P1/R1/M2) too

One plain SGLang server (no role, ``--reference-tp``) gives the greedy reference for the whole
run; then, one combination at a time (a CPU server holds about 1.3 GB and each TP rank a core
list), PDD's prefill, relay and main at its sizes behind the PDD router, the checks of
:func:`pdd_sglang.dev.testing.mixed_tp.check_combination` (token-exact P->MD, a handoff through the
router, relay-finished, a forced One-Shot and Catch-Up, the next turn's WAN bytes against the
ideal, the KV digest, pools and radix locks back to baseline on every rank) and a SIGTERM that
must close PDD on every rank. It prints one line per combination (PASS, or FAIL and why), writes
every result to ``--out`` (JSON) and exits 0 only if every combination passed. Server logs stay
under ``--log-dir``. ``make test`` runs P1/R1/M2 (``tests/integration/test_tp.py``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "pdd_sglang" / "dev" / "cpu_standin")]

from pdd_sglang.dev import results as published  # noqa: E402
from pdd_sglang.dev.testing.cluster import Cluster, SGLangServer  # noqa: E402
from pdd_sglang.dev.testing.mixed_tp import (TpSizes, check_combination,  # noqa: E402
                                             mixed_tp_cluster, start_router,
                                             stop_and_check_shutdown, tp_args, tp_env)
from pdd_sglang.dev.testing.tiny_model import TinyModelSpec, ensure_tiny_model  # noqa: E402

MAKE_TEST = "P1/R1/M2"  # tests/integration/conftest.py: MAKE_TEST_TP
EVERY = [TpSizes(*sizes).label for sizes in itertools.product((1, 2), repeat=3)]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", metavar="P<tp>/R<tp>/M<tp>",
                   help="these combinations (default: every one of TP 1 and 2 but make test's)")
    p.add_argument("--all", action="store_true", help="make test's combination too")
    p.add_argument("--reference-tp", type=int, default=1, choices=(1, 2),
                   help="the plain server's TP size (CPU TP 2 gives TP 1's greedy tokens)")
    p.add_argument("--log-dir", type=Path, default=REPO / "out" / "tp_matrix" / "logs")
    p.add_argument("--out", type=Path, default=REPO / "out" / "tp_matrix" / "tp_matrix.json")
    published.add_publish_flag(p)
    return p.parse_args(argv)


def combinations(args) -> list[TpSizes]:
    labels = args.only or [label for label in EVERY if args.all or label != MAKE_TEST]
    return [TpSizes.parse(label) for label in labels]


def run_one(sizes: TpSizes, model_path, log_dir: Path, spec, reference) -> dict:
    cluster = mixed_tp_cluster(sizes, model_path, log_dir / sizes.label.replace("/", "-"))
    started = time.monotonic()
    try:
        cluster.start()
        cluster.wait_ready()
        start_router(cluster)
        seen = check_combination(cluster, spec.kv_bytes_per_token, reference)
        stop_and_check_shutdown(cluster)
        return {"result": "PASS", **seen, "seconds": round(time.monotonic() - started)}
    except Exception as err:  # reported, and the next combination runs
        return {"combination": sizes.label, "result": "FAIL", "why": repr(err)[:2000],
                "traceback": traceback.format_exc()[-4000:],
                "seconds": round(time.monotonic() - started)}
    finally:
        if cluster.router is not None:
            cluster.router.stop()
        cluster.stop()


def summary(result: dict) -> str:
    if result["result"] != "PASS":
        return f"{result['combination']}: FAIL ({result['seconds']} s): {result['why'][:300]}"
    wan = "; ".join(f"main {w['main_bytes']} B (ideal {w['ideal_main_bytes']}), relay "
                    f"{w['relay_bytes']} B" for w in result["wan_bytes"])
    return (f"{result['combination']}: PASS ({result['seconds']} s): token-exact (P->MD, "
            f"router handoff {result['router_handoff']}, relay-finished, one-shot "
            f"{result['one-shot']} tokens, catch-up {result['catch-up']} tokens); WAN bytes "
            f"per room = ideal: {wan}; KV digest {result['kv_digest']}; next turn main hit "
            f"{result['next_turn_main_hit']}; pools and locks at baseline on every rank")


def main(argv=None) -> int:
    args = parse_args(argv)
    spec = TinyModelSpec()
    model_path = ensure_tiny_model(spec)
    todo = combinations(args)
    reference = SGLangServer("plain", model_path, args.log_dir, fork_children=True,
                             extra_args=tp_args(args.reference_tp), env=tp_env(args.reference_tp))
    results = []
    with Cluster([reference]):
        for sizes in todo:
            result = run_one(sizes, model_path, args.log_dir, spec, reference)
            results.append(result)
            print(summary(result), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"reference_tp": args.reference_tp, "results": results}
    args.out.write_text(json.dumps(report, indent=1, default=str))
    if args.publish:
        published.publish("tp_matrix", json.loads(json.dumps(report, default=str)))
    passed = sum(r["result"] == "PASS" for r in results)
    print(f"{passed} of {len(results)} combinations passed; results in {args.out}")
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
