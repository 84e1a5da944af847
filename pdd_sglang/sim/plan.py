"""Capacity planner: search P / RLD / MD counts for the best benefit-cost ratio (BCR).

BCR = goodput within the SLA / hardware cost, where goodput is the highest request rate at
which the simulated cluster still meets the SLA (TTFT and ITL percentiles, nothing dropped).

    python -m pdd_sglang.sim.plan --sla-ttft-p90 15 --sla-itl-p90-ms 30 --wan wan_100g
"""

from __future__ import annotations

import argparse
import itertools
from dataclasses import dataclass, replace

from .cluster import ClusterConfig, Setup, simulate
from .profiles import load_hardware, load_link
from .workload import AgenticConfig, generate_agentic, read_trace


@dataclass(frozen=True)
class Sla:
    """Assumption: the brief keeps total latency under about 30 s and says P90/P99 matter; a
    TTFT P90 of 15 s leaves half of that to decode. (The paper's own naive cross-DC P90 is
    18.3 s, so a tighter TTFT bound would reject its baseline outright.)"""
    ttft_p90_s: float = 15.0
    itl_p90_ms: float = 30.0


@dataclass(frozen=True)
class PlanResult:
    setup: str
    prefill: int
    relay: int
    main: int
    gpus: dict
    cost_per_hour: float
    goodput_rps: float
    bcr_requests_per_dollar: float

    def label(self) -> str:
        if not self.relay:
            return f"{self.prefill}P + {self.main}D"
        return f"{self.prefill}P + {self.relay}RLD + {self.main}MD"


def gpu_counts(cfg: ClusterConfig) -> dict:
    counts: dict = {}
    roles = [(cfg.prefill_hardware, cfg.prefill_instances),
             (cfg.decode_hardware, cfg.main_instances)]
    if cfg.setup.has_relay:
        roles.append((cfg.relay_hardware, cfg.relay_instances))
    for hardware_name, instances in roles:
        hardware = load_hardware(hardware_name)
        counts[hardware_name] = counts.get(hardware_name, 0) + instances * hardware.gpus_per_instance
    return counts


def cost_per_hour(cfg: ClusterConfig) -> float:
    total = sum(load_hardware(name).cost_per_gpu_hour * count
                for name, count in gpu_counts(cfg).items())
    if cfg.setup.behind_wan:
        total += load_link(cfg.wan_link).cost_per_hour
    return total


@dataclass(frozen=True)
class TraceWorkload:
    """A Mooncake-format trace as the planner's workload: its first duration_s seconds, replayed
    at another request rate by compressing or stretching its arrival times."""
    path: str
    duration_s: float = 240.0

    def requests(self) -> list:
        requests = read_trace(self.path, max_duration_s=self.duration_s)
        if len(requests) < 2:
            raise ValueError(f"{self.path}: fewer than 2 requests in its first {self.duration_s} s")
        return requests


def workload_at(workload, rate: float) -> tuple:
    """(requests, warmup) of a workload offered at `rate` requests per second."""
    if isinstance(workload, TraceWorkload):
        requests = workload.requests()
        native = len(requests) / max(requests[-1].arrival_s, 1e-9)
        stretch = native / rate
        return [replace(r, arrival_s=r.arrival_s * stretch) for r in requests], []
    return generate_agentic(replace(workload, rate_per_s=rate))


def meets_sla(cfg: ClusterConfig, workload, rate: float, sla: Sla) -> bool:
    requests, warmup = workload_at(workload, rate)
    summary, _ = simulate(cfg.with_(drain_limit_s=120.0), requests, warmup)
    return (summary.finished == summary.requests
            and summary.ttft_p90_s <= sla.ttft_p90_s
            and summary.itl_p90_ms <= sla.itl_p90_ms)


def goodput(cfg: ClusterConfig, workload: AgenticConfig, sla: Sla,
            start_rps: float = 1.0, refinements: int = 4) -> float:
    """Highest rate (req/s) meeting the SLA: halve or double from start_rps to bracket it,
    then bisect. 0 when even start_rps / 2**refinements fails."""
    if meets_sla(cfg, workload, start_rps, sla):
        low, high = start_rps, start_rps * 2
        while meets_sla(cfg, workload, high, sla):
            low, high = high, high * 2
            if high > 256:
                return low
    else:
        low, high = 0.0, start_rps
        for _ in range(refinements):
            if meets_sla(cfg, workload, high / 2, sla):
                low = high / 2
                break
            high /= 2
        if low == 0.0:
            return 0.0
    for _ in range(refinements):
        middle = (low + high) / 2
        if meets_sla(cfg, workload, middle, sla):
            low = middle
        else:
            high = middle
    return low


def evaluate(cfg: ClusterConfig, workload: AgenticConfig, sla: Sla) -> PlanResult:
    rps = goodput(cfg, workload, sla)
    cost = cost_per_hour(cfg)
    relay = cfg.relay_instances if cfg.setup.has_relay else 0
    return PlanResult(cfg.setup.value, cfg.prefill_instances, relay, cfg.main_instances,
                      gpu_counts(cfg), cost, rps, rps * 3600.0 / cost if cost else 0.0)


def search(base: ClusterConfig, workload: AgenticConfig, sla: Sla, prefill_range,
           relay_range, main_range, progress=None) -> list:
    """Every combination of counts, best BCR first (ties: fewer GPUs, then lower counts)."""
    results = []
    relays = relay_range if base.setup.has_relay else [0]
    for prefill, relay, main in itertools.product(prefill_range, relays, main_range):
        cfg = base.with_(prefill_instances=prefill, relay_instances=max(relay, 1),
                         main_instances=main)
        results.append(evaluate(cfg, workload, sla))
        if progress:
            progress(results[-1])
    results.sort(key=lambda r: (-r.bcr_requests_per_dollar, sum(r.gpus.values()),
                                r.prefill, r.relay, r.main))
    return results


def format_table(results) -> str:
    lines = ["| setup | layout | GPUs | cost $/h | goodput req/s | BCR req/$ |",
             "|---|---|---|---|---|---|"]
    for r in results:
        gpus = ", ".join(f"{n} x {name}" for name, n in sorted(r.gpus.items()))
        lines.append(f"| {r.setup} | {r.label()} | {gpus} | {r.cost_per_hour:.2f} | "
                     f"{r.goodput_rps:.2f} | {r.bcr_requests_per_dollar:.0f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="moe_1t_50kb")
    parser.add_argument("--hardware-a", default="gpu_a", help="P and RLD (and same-DC decode)")
    parser.add_argument("--hardware-b", default="gpu_b", help="MD")
    parser.add_argument("--wan", default="wan_100g")
    parser.add_argument("--sla-ttft-p90", type=float, default=Sla.ttft_p90_s)
    parser.add_argument("--sla-itl-p90-ms", type=float, default=30.0)
    parser.add_argument("--duration", type=float, default=240.0, help="simulated s per trial")
    parser.add_argument("--trace", help="plan for a Mooncake-format jsonl trace (replayed at each "
                        "trial rate) instead of the agentic generator")
    parser.add_argument("--max-prefill", type=int, default=3)
    parser.add_argument("--max-relay", type=int, default=1)
    parser.add_argument("--max-main", type=int, default=3)
    args = parser.parse_args(argv)
    sla = Sla(args.sla_ttft_p90, args.sla_itl_p90_ms)
    workload = (TraceWorkload(args.trace, args.duration) if args.trace
                else AgenticConfig(duration_s=args.duration))
    common = dict(model=args.model, wan_link=args.wan, prefill_hardware=args.hardware_a,
                  relay_hardware=args.hardware_a)
    baseline = ClusterConfig(setup=Setup.SAME_DC_PD, main_hardware=args.hardware_a, **common)
    pdd = ClusterConfig(setup=Setup.PDD, main_hardware=args.hardware_b, **common)
    prefills = range(1, args.max_prefill + 1)
    mains = range(1, args.max_main + 1)
    report = lambda r: print(f"  {r.setup:12s} {r.label():24s} {r.goodput_rps:6.2f} req/s", flush=True)
    best_base = search(baseline, workload, sla, prefills, [0], mains, report)
    best_pdd = search(pdd, workload, sla, prefills, range(1, args.max_relay + 1), mains, report)
    print(f"\nSLA: TTFT P90 <= {sla.ttft_p90_s} s, ITL P90 <= {sla.itl_p90_ms} ms; "
          f"model {args.model}, line {args.wan}\n")
    print(format_table([best_base[0], best_pdd[0]]))
    gain = best_pdd[0].bcr_requests_per_dollar / max(best_base[0].bcr_requests_per_dollar, 1e-9)
    print(f"\nBCR gain of the best PDD layout over the best same-DC PD layout: {100 * (gain - 1):+.1f}%")


if __name__ == "__main__":
    main()
