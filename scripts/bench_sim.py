"""Benchmark: simulate the whole public conversation trace (12,031 requests, ~59 minutes).

    python scripts/bench_sim.py [--setup pdd] [--wan wan_100g]

Prints the wall-clock seconds (target: under 60 s on one core) and the run's TTFT summary.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tqdm import tqdm  # noqa: E402

from pdd_sglang.sim.cluster import ClusterConfig, Setup, simulate  # noqa: E402
from pdd_sglang.sim.workload import TRACE_PATH, read_trace  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default=str(TRACE_PATH))
    parser.add_argument("--setup", default="pdd", choices=[s.value for s in Setup])
    parser.add_argument("--wan", default="wan_100g",
                        help="the 10 Gb/s line cannot carry this 37%%-hit trace; 100 Gb/s can")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    requests = read_trace(args.trace)
    horizon = requests[-1].arrival_s
    bar = tqdm(total=round(horizon), unit="sim-s", desc=f"{args.setup}", mininterval=1.0)

    def progress(now):
        bar.n = min(round(now), bar.total)
        bar.refresh()
    summary, cluster = simulate(ClusterConfig(setup=Setup(args.setup), wan_link=args.wan),
                                requests, progress=progress)
    bar.close()
    elapsed = time.perf_counter() - started
    print(f"requests {summary.requests}, finished {summary.finished}, events "
          f"{cluster.sim.events_fired}; TTFT P50/P90/P99 {summary.ttft_p50_s:.2f}/"
          f"{summary.ttft_p90_s:.2f}/{summary.ttft_p99_s:.2f} s; WAN {summary.wan_bytes / 1e9:.0f} GB")
    print(f"wall-clock seconds: {elapsed:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
