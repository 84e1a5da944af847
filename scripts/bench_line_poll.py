"""What one router line poll costs a PDD prefill: ``/server_info`` (what the router read before
patch 0018) against ``/pdd/line``.

Starts one PDD prefill of the tiny model (SGLang's CPU engine, spawned as ``make demo`` starts
its servers), then, in turn and for the same time, leaves it idle, polls ``/server_info`` and
polls ``/pdd/line`` at ``--rate`` polls per second. Each phase's CPU is read from the prefill's
whole process tree (launcher and HTTP, scheduler, detokenizer: psutil), and the scheduler process
alone; the idle phase's CPU is subtracted, so the figures are the poll's own. Prints a table and
writes ``line_poll.json``.

The prefill has no decode server: its transfer ledger is empty, which is the cheapest case for
``/server_info`` (a busy prefill's ledger keeps up to 8,192 rows).

    .venv/bin/python scripts/bench_line_poll.py [--seconds 20] [--rate 10] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pdd_sglang.dev.testing.cluster import SGLangServer, free_port  # noqa: E402
from pdd_sglang.dev.testing.tiny_model import ensure_tiny_model  # noqa: E402

ENDPOINTS = ("/server_info", "/pdd/line")


def cpu_seconds(processes: list) -> float:
    total = 0.0
    for process in processes:
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def phase(url: str, path, seconds: float, rate: float, tree: list, scheduler) -> dict:
    start_tree, start_scheduler = cpu_seconds(tree), cpu_seconds([scheduler])
    polls, begun = 0, time.monotonic()
    while time.monotonic() - begun < seconds:
        if path is not None:
            with urllib.request.urlopen(url + path, timeout=30) as resp:
                resp.read()
            polls += 1
        time.sleep(1.0 / rate)
    return {"polls": polls, "tree_cpu_s": cpu_seconds(tree) - start_tree,
            "scheduler_cpu_s": cpu_seconds([scheduler]) - start_scheduler}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="per phase")
    parser.add_argument("--rate", type=float, default=10.0, help="polls per second")
    parser.add_argument("--out", type=Path, default=REPO / "out" / "line_poll")
    args = parser.parse_args()
    if args.seconds <= 0 or args.rate <= 0:
        parser.error("--seconds and --rate must be > 0")
    args.out.mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="pdd-line-poll-"))
    # Open (no --api-key): the poller below measures the route alone.
    prefill = SGLangServer("prefill", ensure_tiny_model(), log_dir, fork_children=False,
                           api_key=None,
                           extra_args=("--pdd-role", "prefill", "--disaggregation-bootstrap-port",
                                       str(free_port()), "--disaggregation-transfer-backend",
                                       "mooncake_tcp"))
    try:
        prefill.start()
        prefill.wait_ready()
        launcher = psutil.Process(prefill.process.pid)
        tree = [launcher, *launcher.children(recursive=True)]
        scheduler = max(tree[1:], key=lambda p: p.memory_info().rss)  # the model's process
        time.sleep(2.0)  # start-up's last work done
        idle = phase(prefill.url, None, args.seconds, args.rate, tree, scheduler)
        rows = {}
        for path in ENDPOINTS:
            got = phase(prefill.url, path, args.seconds, args.rate, tree, scheduler)
            polls = max(1, got["polls"])
            rows[path] = {
                "polls": got["polls"],
                "prefill_ms_per_poll": 1e3 * (got["tree_cpu_s"] - idle["tree_cpu_s"]) / polls,
                "scheduler_ms_per_poll":
                    1e3 * (got["scheduler_cpu_s"] - idle["scheduler_cpu_s"]) / polls,
            }
    except Exception:
        print(f"prefill log: {prefill.log_path}", file=sys.stderr)
        raise
    finally:
        prefill.stop()
    result = {"seconds_per_phase": args.seconds, "polls_per_s": args.rate,
              "idle_tree_cpu_s": idle["tree_cpu_s"], "endpoints": rows}
    (args.out / "line_poll.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"prefill CPU per poll, idle subtracted ({args.seconds:.0f} s per phase, "
          f"{args.rate:g} polls/s, no CPU quota):")
    print(f"{'endpoint':<14} {'polls':>6} {'whole prefill ms':>17} {'scheduler ms':>13}")
    for path, row in rows.items():
        print(f"{path:<14} {row['polls']:>6} {row['prefill_ms_per_poll']:>17.2f} "
              f"{row['scheduler_ms_per_poll']:>13.2f}")
    print(f"wrote {args.out / 'line_poll.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
