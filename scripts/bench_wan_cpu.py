#!/usr/bin/env python3
"""CPU that prefill (and main) burn per second while a WAN copy is on the line (issue 16, item 1).

Real servers over the emulated slow line: a PDD prefill in cluster A and a PDD main in cluster B
(tiny model on CPU, Mooncake TCP), one P->MD request whose prompt KV takes seconds to cross. The
script samples the CPU time of each server's whole process tree (/proc, every thread) and the
line's byte counter every --sample-s; a sample counts as "copy in flight" when the line carried
at least a quarter of its rate in it, so prefill's forward (before the first bytes) and the idle
time after are left out. It runs twice, on fresh servers: ``blocking`` (Mooncake's synchronous
batch call, the behaviour before, via --pdd-debug-wan-blocking-wait) and ``async`` (the WAN
engine's asynchronous submit and back-off wait). Writes DIR/wan_cpu.json; prints a table.

    sudo python3 scripts/bench_wan_cpu.py --out out/wan_cpu
    sudo python3 scripts/bench_wan_cpu.py --out DIR --rate-mbit 20 --prompt-tokens 2000

Needs root (network namespaces). Hold /tmp/pdd-servers.lock on a shared machine. Goal: async
prefill <= 0.05 core while idle-waiting on the line. Figures are only fair on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pdd_sglang.dev.testing.cluster import Cluster, free_port  # noqa: E402
from pdd_sglang.dev.testing.pd_client import generate_fanout  # noqa: E402
from pdd_sglang.dev.testing.processes import tree_cpu_s, tree_threads  # noqa: E402
from pdd_sglang.dev.testing.tiny_model import WAN_DEMO_MODEL, ensure_tiny_model  # noqa: E402
from pdd_sglang.dev.testing.wan_cluster import NetnsServer  # noqa: E402
from pdd_sglang.dev.wan_emulator import WanLine, check_prerequisites  # noqa: E402

TRANSPORT = ("--disaggregation-transfer-backend", "mooncake_tcp")


def busiest_threads(before: dict, after: dict, seconds: float, top: int = 6) -> list:
    """The threads that used the most CPU between two ``tree_threads`` snapshots (cores)."""
    rows = [(after[k][0], (after[k][1] - before.get(k, (None, 0.0))[1]) / seconds)
            for k in after]
    return [{"thread": name, "cores": round(cores, 3)}
            for name, cores in sorted(rows, key=lambda r: -r[1])[:top]]


def run_mode(mode: str, out: Path, args) -> dict:
    line = WanLine(args.rate_mbit, args.rtt_ms, 0.0, seed=1)
    line.start(log_path=str(out / f"{mode}-wan.log"))
    model = ensure_tiny_model(WAN_DEMO_MODEL)
    bootstrap_port = free_port()
    common = dict(model_path=model, log_dir=out / mode, max_total_tokens=16384)
    debug = ("--pdd-debug-wan-blocking-wait",) if mode == "blocking" else ()
    prefill = NetnsServer("prefill", host=line.address("a"), netns=line.namespace("a"),
                          exec_prefix=tuple(line.exec_prefix("a")),
                          extra_args=("--pdd-role", "prefill", "--disaggregation-bootstrap-port",
                                      str(bootstrap_port), *debug, *TRANSPORT), **common)
    main = NetnsServer("main", host=line.address("b"), netns=line.namespace("b"),
                       exec_prefix=tuple(line.exec_prefix("b")),
                       extra_args=("--pdd-role", "main", *TRANSPORT), **common)
    rng = random.Random(7)
    try:
        with Cluster([prefill, main]):
            def ask(tokens: int) -> None:
                body = {"input_ids": [rng.randrange(10, 1000) for _ in range(tokens)],
                        "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
                generate_fanout(prefill, [main], body, bootstrap_port, "prefill_main",
                                timeout_s=300)

            ask(32)  # warm-up: sessions and the WAN engine's connection are set up
            samples = []
            done = threading.Event()
            worker = threading.Thread(target=lambda: (ask(args.prompt_tokens), done.set()))

            def sample() -> tuple:
                return (time.monotonic(), tree_cpu_s(prefill.process.pid),
                        tree_cpu_s(main.process.pid), line.counters("a")["tx_bytes"])

            idle_start = sample()
            time.sleep(args.idle_s)
            idle_end = sample()
            worker.start()
            samples.append(sample())
            snapshots = []  # per-thread CPU of prefill while the line carries the copy
            while not done.is_set() and worker.is_alive():
                time.sleep(args.sample_s)
                samples.append(sample())
                rate = (samples[-1][3] - samples[-2][3]) / (samples[-1][0] - samples[-2][0])
                if rate >= 0.25 * args.rate_mbit * 1e6 / 8:
                    snapshots.append((samples[-1][0], tree_threads(prefill.process.pid)))
            worker.join()
            main.wait_idle(60)
            prefill.wait_idle(60)
    finally:
        line.stop()
    rate_bytes_s = args.rate_mbit * 1e6 / 8
    in_flight = [(b, a) for a, b in zip(samples, samples[1:])
                 if (b[3] - a[3]) / (b[0] - a[0]) >= 0.25 * rate_bytes_s]
    wall = sum(b[0] - a[0] for b, a in in_flight)

    def per_s(index: int, pairs) -> float | None:
        span = sum(b[0] - a[0] for b, a in pairs)
        return sum(b[index] - a[index] for b, a in pairs) / span if span > 0 else None

    idle = [(idle_end, idle_start)]
    threads = (busiest_threads(snapshots[0][1], snapshots[-1][1], snapshots[-1][0] - snapshots[0][0])
               if len(snapshots) > 1 else [])
    return {"prefill_busiest_threads_in_flight": threads, "in_flight_s": wall, "line_bytes": samples[-1][3] - samples[0][3],
            "prefill_cores_in_flight": per_s(1, in_flight), "main_cores_in_flight": per_s(2, in_flight),
            "prefill_cores_idle": per_s(1, idle), "main_cores_idle": per_s(2, idle)}


def main_cli(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--rate-mbit", type=float, default=20.0)
    parser.add_argument("--rtt-ms", type=float, default=40.0)
    parser.add_argument("--prompt-tokens", type=int, default=2000,
                        help="prompt of the measured request (tiny model: 8 KB of KV a token)")
    parser.add_argument("--idle-s", type=float, default=3.0, help="idle baseline before it")
    parser.add_argument("--sample-s", type=float, default=0.25)
    parser.add_argument("--modes", default="blocking,async")
    args = parser.parse_args(argv)
    check_prerequisites()
    args.out.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]
    result = {"rate_mbit": args.rate_mbit, "rtt_ms": args.rtt_ms,
              "prompt_tokens": args.prompt_tokens, "loadavg_1m_before": load, "modes": {}}
    for mode in args.modes.split(","):
        print(f"running {mode} ...", file=sys.stderr, flush=True)
        result["modes"][mode] = run_mode(mode, args.out, args)
    path = args.out / "wan_cpu.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}", file=sys.stderr)
    print(f"{'mode':10} {'in flight s':>11} {'prefill cores':>13} {'(idle)':>7} "
          f"{'main cores':>10} {'(idle)':>7}")
    for mode, row in result["modes"].items():
        print(f"  {mode}: prefill's busiest threads in flight: "
              + ", ".join(f"{t['thread']} {t['cores']:.3f}" for t in row["prefill_busiest_threads_in_flight"]))

        def fmt(v):
            return "   n/a" if v is None else f"{v:6.3f}"
        print(f"{mode:10} {row['in_flight_s']:11.1f} {fmt(row['prefill_cores_in_flight']):>13} "
              f"{fmt(row['prefill_cores_idle']):>7} {fmt(row['main_cores_in_flight']):>10} "
              f"{fmt(row['main_cores_idle']):>7}")
    return 0


if __name__ == "__main__":
    sys.exit(main_cli())
