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
    """DECLARED: the brief keeps total latency under about 30 s and says P90/P99 matter; a
    TTFT P90 of 15 s leaves half of that to decode.  It must sit above the idle floor (the
    TTFT and ITL a setup shows at a light load, idle_floor()), or goodput measures only whether
    a setup's floor is under the bound; the planner prints the floors.  ITL P90 35 ms: above
    the EP-bound decode step (about 21 ms), below GPU-A decode with a full batch at 64K."""
    ttft_p90_s: float = 15.0
    itl_p90_ms: float = 35.0


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


IDLE_RATE_PER_S = 0.5     # the light load an idle floor is measured at


def idle_floor(cfg: ClusterConfig, workload, rate: float = IDLE_RATE_PER_S) -> tuple:
    """(TTFT P90 s, ITL P90 ms) at a light load: what no amount of hardware improves."""
    requests, warmup = workload_at(workload, rate)
    summary, _ = simulate(cfg.with_(drain_limit_s=120.0), requests, warmup)
    return summary.ttft_p90_s, summary.itl_p90_ms


def plan_setups(base: ClusterConfig, workload, sla: Sla, prefill_range, gpu_a_decode_range,
                gpu_b_decode_range, progress=None) -> dict:
    """Best layout (and all, best first) of same_dc_pd (GPU-A decode), same_dc_hetero_pd and
    pdd (GPU-B decode, one relay) on the same prefill hardware and line."""
    return {
        "same_dc_pd": search(base.with_(setup=Setup.SAME_DC_PD), workload, sla, prefill_range,
                             [0], gpu_a_decode_range, progress),
        "same_dc_hetero_pd": search(base.with_(setup=Setup.SAME_DC_HETERO_PD), workload, sla,
                                    prefill_range, [0], gpu_b_decode_range, progress),
        "pdd": search(base.with_(setup=Setup.PDD), workload, sla, prefill_range, [1],
                      gpu_b_decode_range, progress),
    }


def bcr_gains(best: dict) -> dict:
    """PDD's BCR gain in % against each same-DC setup (None where a baseline has no goodput)."""
    ours = best["pdd"].bcr_requests_per_dollar
    return {name: (100 * (ours / best[name].bcr_requests_per_dollar - 1)
                   if best[name].bcr_requests_per_dollar else None)
            for name in ("same_dc_pd", "same_dc_hetero_pd")}


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
    from .operating_point import operating_point
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sla-ttft-p90", type=float, default=Sla.ttft_p90_s)
    parser.add_argument("--sla-itl-p90-ms", type=float, default=Sla.itl_p90_ms)
    parser.add_argument("--duration", type=float, default=240.0, help="simulated s per trial")
    parser.add_argument("--trace", help="plan for a Mooncake-format jsonl trace (replayed at each "
                        "trial rate) instead of the operating point's agentic workload")
    parser.add_argument("--max-prefill", type=int, default=2)
    parser.add_argument("--max-gpu-a-decode", type=int, default=5)
    parser.add_argument("--max-gpu-b-decode", type=int, default=2)
    args = parser.parse_args(argv)
    point = operating_point(True)
    sla = Sla(args.sla_ttft_p90, args.sla_itl_p90_ms)
    workload = (TraceWorkload(args.trace, args.duration) if args.trace
                else replace(point.workload, duration_s=args.duration))
    report = lambda r: print(f"  {r.setup:18s} {r.label():24s} {r.goodput_rps:6.2f} req/s", flush=True)
    best = plan_setups(point.base, workload, sla, range(1, args.max_prefill + 1),
                       range(1, args.max_gpu_a_decode + 1), range(1, args.max_gpu_b_decode + 1),
                       report)
    best = {name: results[0] for name, results in best.items()}
    print(f"\nSLA: TTFT P90 <= {sla.ttft_p90_s} s, ITL P90 <= {sla.itl_p90_ms} ms; line "
          f"{point.base.wan_link}; idle floors (TTFT P90 s, ITL P90 ms at {IDLE_RATE_PER_S} req/s):")
    for name, result in best.items():
        floor = idle_floor(point.base.with_(setup=Setup(name), prefill_instances=result.prefill,
                                            main_instances=result.main), workload)
        print(f"  {name:18s} {floor[0]:.2f} s, {floor[1]:.1f} ms")
    print()
    print(format_table(list(best.values())))
    for name, gain in bcr_gains(best).items():
        print(f"BCR gain of the best PDD layout over the best {name} layout: "
              + ("n/a (no goodput)" if gain is None else f"{gain:+.1f}%"))


if __name__ == "__main__":
    main()
