"""F1's operating point: every input declared in configs/operating_point.toml and
configs/links/wan_f1.toml, and the fits that choose its free values against the report.

    python -m pdd_sglang.sim.operating_point --fit [--quick]

prints, each with its target, the values to copy into those files:
  1. the line's per_transfer_fixed_s, from F3's incremental-KV point (4649 KB in 185 ms on
     average): F3's mean without a fixed cost, subtracted from 185 ms (a fixed cost after the
     last byte adds to every trial alike);
  2. the offered load, putting same_dc_pd's TTFT P50 at the report's 4.2 s (bisection; a
     prefill at the cited MFUs takes well under a second at the median hit, so the report's
     4.2 s is queueing for prefill at a load it does not state).  For comparison it also prints
     the fixed cost that would do the same at the declared reference load;
  3. the line's rate and per-flow window, on a grid: naive cross-DC PD's TTFT P50/P90/P99
     closest to the report's 6.7 / 18.3 / 29.7 s (the largest relative error smallest).
Context lengths, hit skew, instance counts and every hardware number are declared, never fitted.
"""

from __future__ import annotations

import argparse
import tomllib
from dataclasses import dataclass, replace

from .cluster import ClusterConfig, Setup, simulate
from .microbench import handoff_microbenchmark
from .profiles import CONFIG_ROOT, load_link
from .workload import AgenticConfig, generate_agentic

CONFIG = CONFIG_ROOT / "operating_point.toml"

# The report's numbers used as targets (and only as targets).
QUANTILES = ("p50", "p90", "p99")
REPORT_SAME_DC_P50_S = 4.2
REPORT_CROSS_DC_S = {"p50": 6.7, "p90": 18.3, "p99": 29.7}
REPORT_F3_KV_BYTES = 4649e3
REPORT_F3_KV_MEAN_S = 0.185
REFERENCE_RATE_PER_S = 3.3       # where the fixed-cost alternative to the load fit is shown
SAME_DC_TOLERANCE = 0.10          # the acceptance band for the operating point
CROSS_DC_TOLERANCE = 0.25


def load_config() -> dict:
    with open(CONFIG, "rb") as handle:
        return tomllib.load(handle)


@dataclass(frozen=True)
class OperatingPoint:
    workload: AgenticConfig
    base: ClusterConfig
    gpu_a_decode_instances: int

    def cluster(self, setup: Setup, **changes) -> ClusterConfig:
        """The cluster of `setup` at this point: same_dc_pd decodes on GPU-A instances."""
        decode = (self.gpu_a_decode_instances if setup is Setup.SAME_DC_PD
                  else self.base.main_instances)
        return self.base.with_(setup=setup, main_instances=decode).with_(**changes)


def operating_point(quick: bool, config: dict | None = None) -> OperatingPoint:
    config = config or load_config()
    workload = dict(config["workload"])
    quick_duration = workload.pop("quick_duration_s")
    if quick:
        workload["duration_s"] = quick_duration
    cluster = dict(config["cluster"])
    gpu_a_decode = cluster.pop("gpu_a_decode_instances")
    base = ClusterConfig(**cluster)
    return OperatingPoint(AgenticConfig(**workload), base, gpu_a_decode)


def percentiles(summary) -> dict:
    return {"p50": summary.ttft_p50_s, "p90": summary.ttft_p90_s, "p99": summary.ttft_p99_s}


def checks(ttft: dict) -> list:
    """(quantity, simulated, target, tolerance, within) for the operating point's conditions."""
    rows = [("same_dc_pd TTFT P50 s", ttft["same_dc_pd"]["p50"], REPORT_SAME_DC_P50_S,
             SAME_DC_TOLERANCE)]
    rows += [(f"cross_dc_pd TTFT {q.upper()} s", ttft["cross_dc_pd"][q], REPORT_CROSS_DC_S[q],
              CROSS_DC_TOLERANCE) for q in QUANTILES]
    return [(name, sim, target, tol, abs(sim / target - 1) <= tol)
            for name, sim, target, tol in rows]


def fit_transfer_fixed_s(link) -> tuple:
    """(per_transfer_fixed_s, F3 KV mean in s without it) on `link` (a LinkProfile)."""
    bare = replace(link, per_transfer_fixed_s=0.0)
    mean_s = handoff_microbenchmark(trials=200, link=bare,
                                    kv_payload_bytes=REPORT_F3_KV_BYTES)["kv"]["mean_ms"] / 1000
    return max(0.0, REPORT_F3_KV_MEAN_S - mean_s), mean_s


def same_dc_p50(point: OperatingPoint, rate: float, **changes) -> float:
    requests, warmup = generate_agentic(replace(point.workload, rate_per_s=rate))
    summary, _ = simulate(point.cluster(Setup.SAME_DC_PD, **changes), requests, warmup)
    return summary.ttft_p50_s


def fit_load(point: OperatingPoint, low: float, high: float, steps: int = 14) -> tuple:
    """(rate, same_dc_pd P50 there): bisection for P50 = the report's 4.2 s (P50 rises with
    load; the generator draws the same sessions at any rate, so the curve is smooth enough)."""
    for _ in range(steps):
        middle = (low + high) / 2
        if same_dc_p50(point, middle) > REPORT_SAME_DC_P50_S:
            high = middle
        else:
            low = middle
    return low, same_dc_p50(point, low)


def fixed_cost_alternative(point: OperatingPoint, rate: float) -> tuple:
    """(fixed latency before prefill putting same_dc_pd's P50 at 4.2 s at `rate`, P50 without
    it): a constant delay before prefill shifts every TTFT by itself."""
    bare = same_dc_p50(point, rate, dispatch_latency_s=0.0)
    return max(0.0, REPORT_SAME_DC_P50_S - bare), bare


def fit_line(point: OperatingPoint, rates, windows, progress=print) -> list:
    """Rows (bytes_per_s, window_bytes, fixed_s, cross-DC percentiles, worst relative error),
    best first."""
    requests, warmup = generate_agentic(point.workload)
    line = load_link(point.base.wan_link)
    rows = []
    for rate in rates:
        for window in windows:
            candidate = replace(line, bytes_per_s=rate, window_bytes=window)
            fixed, _ = fit_transfer_fixed_s(candidate)
            cfg = point.cluster(Setup.CROSS_DC_PD, wan_bandwidth_scale=rate / line.bytes_per_s,
                                wan_window_bytes=window)
            # the fixed cost belongs to the candidate line: run it through a profile override
            summary, _ = simulate(cfg.with_(wan_transfer_fixed_s=fixed), requests, warmup)
            ttft = percentiles(summary)
            error = max(abs(ttft[q] / REPORT_CROSS_DC_S[q] - 1) for q in QUANTILES)
            rows.append((rate, window, fixed, ttft, error))
            progress(f"  line {rate * 8 / 1e9:5.0f} Gb/s, window {window / 1e6:4.0f} MB, fixed "
                     f"{fixed * 1000:4.0f} ms: cross_dc_pd P50/P90/P99 "
                     f"{ttft['p50']:.2f}/{ttft['p90']:.2f}/{ttft['p99']:.2f} s, worst error "
                     f"{100 * error:.0f}%")
    rows.sort(key=lambda row: row[4])
    return rows


SWEEP_SETUPS = (Setup.SAME_DC_PD, Setup.CROSS_DC_PD, Setup.CROSS_DC_PD_DRC, Setup.PDD)


def sweep(point: OperatingPoint, line_scales=(0.05, 0.125, 0.25, 0.5, 1.0, 2.0),
          load_scales=(0.5, 0.75, 1.0, 1.15)):
    """F1's right panel: TTFT percentiles of each setup against line rate and against load,
    around the operating point.  {"line": {setup: [(Gb/s, p50, p90, p99)]}, "load": {...}}."""
    out = {"line": {s.value: [] for s in SWEEP_SETUPS},
           "load": {s.value: [] for s in SWEEP_SETUPS},
           "duration_s": point.workload.duration_s}
    requests, warmup = generate_agentic(point.workload)
    line = load_link(point.base.wan_link)
    for scale in line_scales:
        for setup in SWEEP_SETUPS:
            summary, _ = simulate(point.cluster(setup, wan_bandwidth_scale=scale), requests, warmup)
            t = percentiles(summary)
            out["line"][setup.value].append((line.bytes_per_s * scale * 8 / 1e9,
                                             t["p50"], t["p90"], t["p99"]))
    for scale in load_scales:
        workload = replace(point.workload, rate_per_s=point.workload.rate_per_s * scale)
        requests, warmup = generate_agentic(workload)
        for setup in SWEEP_SETUPS:
            summary, _ = simulate(point.cluster(setup), requests, warmup)
            t = percentiles(summary)
            out["load"][setup.value].append((workload.rate_per_s, t["p50"], t["p90"], t["p99"]))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Fit F1's operating point (see module docstring)")
    parser.add_argument("--fit", action="store_true", required=True)
    parser.add_argument("--quick", action="store_true", help="the --quick duration")
    parser.add_argument("--reference-rate", type=float, default=REFERENCE_RATE_PER_S,
                        help="req/s for the fixed-cost alternative, and the bisection's low end")
    parser.add_argument("--max-rate", type=float, default=8.0)
    parser.add_argument("--rates-gbps", default="100,150,200,300")
    parser.add_argument("--windows-mb", default="8,16,24,32,48")
    args = parser.parse_args(argv)
    point = operating_point(args.quick)
    reference = point.workload.rate_per_s
    fixed, bare = fixed_cost_alternative(point, args.reference_rate)
    print(f"(not used) at {args.reference_rate} req/s same_dc_pd P50 is {bare:.2f} s with no "
          f"fixed latency before prefill; {fixed:.2f} s of it would land 4.2 s")
    rate, p50 = fit_load(point, args.reference_rate, args.max_rate)
    print(f"[workload] rate_per_s = {rate:.4f}   # same_dc_pd P50 {p50:.2f} s, target "
          f"{REPORT_SAME_DC_P50_S} s (was {reference})")
    point = replace(point, workload=replace(point.workload, rate_per_s=rate))
    rates = [float(x) * 1e9 / 8 for x in args.rates_gbps.split(",")]
    windows = [float(x) * 1e6 for x in args.windows_mb.split(",")]
    best = fit_line(point, rates, windows)[0]
    rate, window, fixed, ttft, error = best
    print(f"wan_f1.toml: bytes_per_s = {rate:.4g}; window_bytes = {window:.4g}; "
          f"per_transfer_fixed_s = {fixed:.3f}   # cross_dc_pd P50/P90/P99 "
          f"{ttft['p50']:.2f}/{ttft['p90']:.2f}/{ttft['p99']:.2f} s against 6.7/18.3/29.7, "
          f"worst error {100 * error:.0f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
