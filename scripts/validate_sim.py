"""Validate the simulator against a real CPU run (item 6 of issue 6).

    python scripts/validate_sim.py --measured out/demo/demo.json

The simulator is configured like the CPU demo cluster described in
configs/hardware/cpu_demo.toml ([cluster] table: instance counts, model, links, workload size),
runs the same small agentic workload, and prints simulated against measured TTFT percentiles
and their ratio for each setup.

Measured file format (what `make demo` of issue 7 writes as demo.json):

    {"setups": {"same_dc_pd":  {"ttft_p50_s": 0.41, "ttft_p90_s": 0.9, "ttft_p99_s": 1.3, ...},
                "cross_dc_pd": {...},
                "pdd":         {...}},
     "workload": {"requests": 60, "rate_per_s": 0.5, "seed": 7}}     # optional override

Only setups present in the file are compared. Nothing here invents measured numbers: without
the file the script stops with a message.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdd_sglang.sim.cluster import ClusterConfig, Setup, simulate  # noqa: E402
from pdd_sglang.sim.profiles import load_table  # noqa: E402
from pdd_sglang.sim.workload import AgenticConfig, generate_agentic  # noqa: E402

QUANTILES = ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s")


def demo_workload(table: dict, override: dict) -> AgenticConfig:
    scale = table["context_scale"]
    rate = override.get("rate_per_s", table["rate_per_s"])
    requests = override.get("requests", table["requests"])
    base = AgenticConfig()
    scaled = {name: max(1, int(getattr(base, name) * scale)) for name in (
        "system_prompt_tokens", "first_context_min", "first_context_max", "small_delta_min",
        "small_delta_max", "big_delta_min", "big_delta_max", "singular_input_min",
        "singular_input_max")}
    scaled["system_prompt_tokens"] = max(512, scaled["system_prompt_tokens"])
    out_scale = table["output_scale"]
    scaled["short_output_max"] = max(17, int(base.short_output_max * out_scale))
    scaled["long_output_max"] = max(scaled["short_output_max"], int(base.long_output_max * out_scale))
    return replace(base, rate_per_s=rate, duration_s=requests / rate,
                   turns_min=table["turns_min"], turns_max=table["turns_max"],
                   seed=override.get("seed", table["seed"]), **scaled)


def demo_cluster(table: dict, setup: Setup) -> ClusterConfig:
    return ClusterConfig(setup=setup, model=table["model"], prefill_hardware="cpu_demo",
                         relay_hardware="cpu_demo", main_hardware="cpu_demo",
                         wan_link=table["wan_link"], rdma_link=table["rdma_link"],
                         prefill_instances=table["prefill_instances"],
                         relay_instances=table["relay_instances"],
                         main_instances=table["main_instances"],
                         relay_max_running=table["max_running"],
                         main_max_running=table["max_running"],
                         prefill_cache_tokens=1_000_000, main_cache_tokens=1_000_000)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measured", type=Path, required=True,
                        help="demo.json from the real CPU run (see the module docstring)")
    args = parser.parse_args(argv)
    if not args.measured.is_file():
        print(f"validate_sim: no measured file at {args.measured}. Run the real CPU demo first "
              "(`make demo`, issue 7) and pass its demo.json; this script never makes up "
              "measured numbers.", file=sys.stderr)
        return 2
    measured = json.loads(args.measured.read_text())
    if "setups" not in measured:
        print("validate_sim: the measured file has no 'setups' object", file=sys.stderr)
        return 2
    table = load_table("hardware", "cpu_demo", "cluster")
    workload = demo_workload(table, measured.get("workload", {}))
    requests, warmup = generate_agentic(workload)
    print(f"workload: {len(requests)} requests at {workload.rate_per_s} req/s (seed {workload.seed})")
    print(f"{'setup':12s} {'quantile':11s} {'simulated':>10s} {'measured':>10s} {'sim/meas':>9s}")
    for name, numbers in measured["setups"].items():
        summary, _ = simulate(demo_cluster(table, Setup(name)), requests, warmup)
        for quantile in QUANTILES:
            if quantile not in numbers:
                continue
            sim_value = getattr(summary, quantile)
            real = float(numbers[quantile])
            ratio = sim_value / real if real > 0 else float("nan")
            print(f"{name:12s} {quantile:11s} {sim_value:10.3f} {real:10.3f} {ratio:9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
