"""Reproduce the PDD report's figures F1-F9 with the simulator.

    python scripts/reproduce_figures.py --out out/figures [--quick] [--measured-handoff FILE]

Writes DIR/report.md (each simulated number beside the report's, plus the assumptions),
DIR/f1.png ... DIR/f9.png and DIR/results.json.  Every simulated number is computed by the
simulator; the report's numbers appear only in the "paper" columns.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdd_sglang.dev import results as published  # noqa: E402
from pdd_sglang.sim import experiments as E  # noqa: E402
from pdd_sglang.sim import operating_point as OP  # noqa: E402
from pdd_sglang.sim.microbench import F1_LINE, handoff_microbenchmark  # noqa: E402
from pdd_sglang.sim.profiles import load_link  # noqa: E402
from pdd_sglang.sim import plan  # noqa: E402
from pdd_sglang.sim.cluster import Setup  # noqa: E402
from pdd_sglang.sim.report import write_report  # noqa: E402
from pdd_sglang.sim.workload import TRACE_PATH, generate_agentic  # noqa: E402
from pdd_sglang.sim.cluster import simulate  # noqa: E402
from pdd_sglang.prefill.wan_engine import ONE_SLICE, window_for_line  # noqa: E402
from pdd_sglang.policy.wan_order import BACKGROUND_IN_FLIGHT_S  # noqa: E402

PAPER = {
    "ttft_s": {"same_dc_pd": {"p50": 4.2}, "cross_dc_pd": {"p50": 6.7, "p90": 18.3, "p99": 29.7}},
    "ttft_reduction_pct": 51.5, "bcr_gain_pct": 37.5, "rps_gain_pct": 27.8,
    "cost_saving_pct": (3.5, 7.1), "drc_ratio_at_90": 10.0,
    "handoff": {"kv": {"payload_bytes": 4649e3, "mean_ms": 185.0, "max_ms": 512.6},
                "token_ids": {"payload_bytes": 1.5e3, "mean_ms": 305.0, "max_ms": 321.4,
                              "std_ms": 4.8}},
    "cost_counts": {"baseline": {"gpu_a": 88}, "pdd": {"gpu_a": 43, "gpu_b": 32}},
}


def percentiles(summary) -> dict:
    return {"p50": summary.ttft_p50_s, "p90": summary.ttft_p90_s, "p99": summary.ttft_p99_s}


# --- tasks (run in worker processes; each returns plain data) -----------------------------
def task_f1(quick):
    runs = E.f1_ttft(quick)
    out = {name: {"summary": s.as_dict(), "ttfts": sorted(j.ttft_s for j in c.jobs if j.completions)}
           for name, (s, c) in runs.items()}
    out["hit_bins"] = E.hit_bins_over_time(runs["pdd"][1].jobs, 60.0)
    jobs = runs["pdd"][1].jobs
    out["same_dc_p50_by_quarter"] = [q["ttft_p50_s"] for q in E.quarter_stats(runs["same_dc_pd"][1])]
    out["mean_input_tokens"] = sum(j.request.input_tokens for j in jobs) / len(jobs)
    aware, _ = E.f1_ttft(quick, placement="congestion-aware", setups=(Setup.PDD,))["pdd"]
    out["pdd_congestion_aware"] = {"summary": aware.as_dict()}
    rate = OP.REFERENCE_RATE_PER_S
    fixed, bare = OP.fixed_cost_alternative(OP.operating_point(quick), rate)
    out["fixed_cost_alternative"] = {"rate_per_s": rate, "fixed_s": fixed, "bare_p50_s": bare}
    return out


def task_sweep(quick):
    if quick:
        return OP.sweep(OP.operating_point(True), line_scales=(0.05, 0.25, 1.0, 2.0),
                        load_scales=(0.5, 1.0, 1.15))
    return OP.sweep(OP.operating_point(True))


def task_f3(quick):
    line = load_link(OP.operating_point(quick).base.wan_link)
    return handoff_microbenchmark(trials=100 if quick else 500, link=line,
                                  kv_payload_bytes=OP.REPORT_F3_KV_BYTES)


def task_f5(quick):
    runs = E.handoff_modes(quick)
    example = runs.pop("example_request")
    out = {"example_request": example}
    for name, run in runs.items():
        job = next((j for j in run["tagged"] if j.request.request_id == example), None)
        out[name] = {"summary": run["summary"].as_dict(),
                     "token_times": [job.first_token_s] + job.token_times if job else [],
                     "handed_tokens": job.handed_tokens if job else 0}
    return out


def task_f6(quick):
    runs = E.collapse_study(quick)
    return {name: {"summary": r["summary"].as_dict(), "timeline": r["summary"].timeline,
                   "collapsed": r["collapsed"], "quarters": r["quarters"]}
            for name, r in runs.items()}


def task_f7(quick):
    return {name: s.as_dict() for name, s in E.singular_filter_study(quick).items()}


def task_f8(quick):
    return E.drc_sweep(quick)


def task_f9(quick, trace=None):
    return {name: s.as_dict() for name, s in E.trace_study(quick, trace).items()}


def task_f4(quick):
    point = OP.operating_point(True)
    sla = plan.Sla()
    workload = replace(point.workload, duration_s=150.0 if quick else 300.0)
    if quick:      # one layout per setup: what the operating point runs
        layouts = {"same_dc_pd": (1, point.gpu_a_decode_instances),
                   "same_dc_hetero_pd": (1, 1), "pdd": (1, 1)}
        found = {name: [plan.evaluate(point.base.with_(setup=Setup(name), prefill_instances=p,
                                                       main_instances=d), workload, sla)]
                 for name, (p, d) in layouts.items()}
    else:
        found = plan.plan_setups(point.base, workload, sla, range(1, 3), range(1, 6), range(1, 3))
    best = {name: rows[0] for name, rows in found.items()}
    floors = {name: plan.idle_floor(point.base.with_(setup=Setup(name),
                                                     prefill_instances=r.prefill,
                                                     main_instances=r.main), workload)
              for name, r in best.items()}
    return {"sla": sla.__dict__, "floors": floors, "gains": plan.bcr_gains(best),
            "idle_rate_per_s": plan.IDLE_RATE_PER_S,
            "baseline": [r.__dict__ for r in found["same_dc_pd"]],
            "hetero": [r.__dict__ for r in found["same_dc_hetero_pd"]],
            "pdd": [r.__dict__ for r in found["pdd"]]}


# The prefill's WAN sender at the brief's line (10 Gb/s, 20 ms; configs/links/wan_10g.toml):
# what one copy may keep in flight, as the simulator's per-flow window (rate = min(line share,
# window / RTT)). DECLARED from the sender's code (prefill/wan_engine.py) and MEASURED on the
# emulated line (scripts/bench_wan_line.py): the old rule sent one 4 MiB slice per round trip
# (its window: one slice); the windowed sender keeps four BDPs in flight (slices of two).
BRIEF_LINE_GBPS, BRIEF_LINE_RTT_MS = 10.0, 20.0
SENDER_WINDOWS = {"one_slice": ONE_SLICE.window_bytes,
                  "window": window_for_line(BRIEF_LINE_GBPS, BRIEF_LINE_RTT_MS).window_bytes}


def task_sender_window(quick):
    """PDD and naive cross-DC PD at the operating point on the brief's line, under each rule."""
    point = OP.operating_point(quick)
    # The operating point's load is sized for F1's 200 Gb/s line; on the brief's 10 Gb/s line it
    # runs at the same share of the line: the arrival rate scaled by the lines' rates.
    scale = load_link("wan_10g").bytes_per_s / load_link(point.base.wan_link).bytes_per_s
    workload = replace(point.workload, rate_per_s=point.workload.rate_per_s * scale)
    requests, warmup = generate_agentic(workload)
    out = {"load_scale": scale}
    for rule, window in SENDER_WINDOWS.items():
        for setup in (Setup.PDD, Setup.CROSS_DC_PD):
            config = point.cluster(setup, wan_link="wan_10g", wan_window_bytes=float(window))
            summary, _ = simulate(config, requests, warmup)
            out[f"{setup.value}/{rule}"] = dict(percentiles(summary), window_bytes=window,
                                                wan_bytes=summary.wan_bytes)
    return out


# Main-bound KV coded on the WAN (issue 36), at the same point as task_sender_window: a lossless
# and an FP8 ratio from the literature, each profile naming its source (configs/codecs/).
WAN_CODECS = {"raw": None, "lossless": "lossless_zipnn", "fp8": "fp8_e4m3"}


def task_wan_codec(quick):
    """PDD at the operating point on the brief's line with main's copies raw and coded."""
    from pdd_sglang.sim.profiles import load_codec
    point = OP.operating_point(quick)
    scale = load_link("wan_10g").bytes_per_s / load_link(point.base.wan_link).bytes_per_s
    workload = replace(point.workload, rate_per_s=point.workload.rate_per_s * scale)
    requests, warmup = generate_agentic(workload)
    window = float(SENDER_WINDOWS["window"])
    out = {"load_scale": scale}
    for label, codec in WAN_CODECS.items():
        config = point.cluster(Setup.PDD, wan_link="wan_10g", wan_window_bytes=window,
                               wan_codec=codec)
        summary, _ = simulate(config, requests, warmup)
        profile = load_codec(codec) if codec else None
        out[label] = dict(percentiles(summary), wan_bytes=summary.wan_bytes,
                          ratio=profile.ratio if profile else 1.0,
                          source=profile.source if profile else "",
                          relay_busy_request_s=summary.relay_busy_request_s)
    return out


# A background copy's window (issue 34): what the copy a request waits for pays behind one, at
# the same point as task_sender_window, on the classed line (sim/wan_lines.py) with the router
# placing from an idle line (P->MD wherever the suffix's copy alone is short), so P->MD copies
# arrive behind handoffs' (relay-covered) and relay-finished (cache-only) ones. DECLARED from the
# sender's code: the full window (the sender before the bound) against
# policy.wan_order.BACKGROUND_IN_FLIGHT_S.
BACKGROUND_IN_FLIGHT = {"full_window": None, "background_bound": BACKGROUND_IN_FLIGHT_S}


def task_background_window(quick):
    """PDD's P->MD copies at the operating point on the brief's line, under each bound."""
    from pdd_sglang.policy import Pipeline
    from pdd_sglang.sim.records import percentile
    point = OP.operating_point(quick)
    line = load_link("wan_10g")
    scale = line.bytes_per_s / load_link(point.base.wan_link).bytes_per_s
    workload = replace(point.workload, rate_per_s=point.workload.rate_per_s * scale)
    requests, warmup = generate_agentic(workload)
    out = {"load_scale": scale}
    for label, in_flight_s in BACKGROUND_IN_FLIGHT.items():
        config = point.cluster(Setup.PDD, wan_link="wan_10g", wan_line="classed",
                               wan_window_bytes=float(SENDER_WINDOWS["window"]),
                               wan_background_in_flight_s=in_flight_s)
        summary, cluster = simulate(config, requests, warmup)
        p_md = [j for j in cluster.jobs if j.completions and j.pipeline is Pipeline.PREFILL_MAIN]
        # the copy's floor: its bytes alone on the line, one way, the transfer's fixed cost
        floors = [j.wan_bytes / line.bytes_per_s + line.rtt_s / 2 + line.per_transfer_fixed_s
                  for j in p_md]
        waits = [j.stages()["kv_and_first_token"] for j in p_md]
        over = [w / f for w, f in zip(waits, floors) if f > 0]
        out[label] = dict(percentiles(summary), in_flight_s=in_flight_s, p_md=len(p_md),
                          requests=sum(1 for j in cluster.jobs if j.completions),
                          p_md_wait_p50_s=percentile(waits, 50),
                          p_md_wait_p90_s=percentile(waits, 90),
                          p_md_wait_over_floor_p90=percentile(over, 90),
                          sent_by_class=dict(cluster.wan.sent_by_class),
                          dropped_cache_only_bytes=cluster.wan.dropped_cache_only_bytes)
    return out


TASKS = {"f4": task_f4, "f6": task_f6, "f1": task_f1, "f9": task_f9, "sweep": task_sweep,
         "f7": task_f7, "f5": task_f5, "f8": task_f8, "f3": task_f3,
         "sender_window": task_sender_window, "wan_codec": task_wan_codec,
         "background_window": task_background_window}


# --- results.json ---------------------------------------------------------------------------
def paper_cost(counts: dict, gpu_b_premium: float | None = None) -> float:
    """$/h of the report's GPU counts at our prices (GPU-B at `gpu_b_premium` x GPU-A's price
    when given), plus the line for the layout that has one."""
    from pdd_sglang.sim.profiles import load_hardware, load_link
    prices = {name: load_hardware(name).cost_per_gpu_hour for name in counts}
    if gpu_b_premium is not None and "gpu_b" in prices:
        prices["gpu_b"] = load_hardware("gpu_a").cost_per_gpu_hour * gpu_b_premium
    total = sum(prices[name] * n for name, n in counts.items())
    return total + (load_link(F1_LINE).cost_per_hour if "gpu_b" in counts else 0.0)


def build_results(data: dict, measured_handoff: dict | None) -> dict:
    f1 = data["f1"]
    ttft = {s.value: percentiles_from(f1[s.value]["summary"]) for s in E.SETUPS_F1}
    reduction, by_mechanism = E.ttft_reductions(ttft)
    f4 = data["f4"]
    best_base, best_pdd = f4["baseline"][0], f4["pdd"][0]
    gain = f4["gains"]["same_dc_pd"]
    ratios = {f"{row['prefill_hit']:.2f}": row["ratio"] for row in data["f8"]}
    handoff = measured_handoff or {k: {m: data["f3"][k][m] for m in
                                       ("payload_bytes", "mean_ms", "max_ms", "std_ms")}
                                   for k in ("kv", "token_ids")}
    point = OP.operating_point(False)
    line = load_link(point.base.wan_link)
    operating = {
        "checks": [dict(zip(("quantity", "simulated", "target", "tolerance", "within"), row))
                   for row in OP.checks(ttft)],
        "rate_per_s": point.workload.rate_per_s,
        "line_gbps": line.bytes_per_s * 8 / 1e9, "window_bytes": line.window_bytes,
        "per_flow_gbps": line.per_flow_bytes_per_s * 8 / 1e9,
        "per_transfer_fixed_s": line.per_transfer_fixed_s,
        "ttft_parts_s": {name: f1[name]["summary"]["ttft_parts_s"] for name in ttft},
        "decode_admission_wait_p99_s": {name: f1[name]["summary"]["decode_admission_wait_p99_s"]
                                        for name in ttft},
        "pdd_congestion_aware": percentiles_from(f1["pdd_congestion_aware"]["summary"]),
        "fixed_cost_alternative": f1["fixed_cost_alternative"],
        "prefill_hit": f1["same_dc_pd"]["summary"]["prefill_hit"],
        "mean_input_tokens": f1["mean_input_tokens"],
        "same_dc_p50_by_quarter": f1["same_dc_p50_by_quarter"],
    }
    return {
        "operating_point": operating,
        "ttft_s": ttft,
        "ttft_reduction_pct": reduction,
        "ttft_reduction_pct_by_mechanism": by_mechanism,
        "bcr": {"baseline": best_base["bcr_requests_per_dollar"],
                "pdd": best_pdd["bcr_requests_per_dollar"], "gain_pct": gain,
                "gain_vs_hetero_pct": f4["gains"]["same_dc_hetero_pd"],
                "hetero": f4["hetero"][0]["bcr_requests_per_dollar"],
                "idle_floors": f4["floors"], "sla": f4["sla"],
                "baseline_goodput_rps": best_base["goodput_rps"],
                "pdd_goodput_rps": best_pdd["goodput_rps"]},
        "cost": {"baseline": {"gpus": best_base["gpus"], "per_hour": best_base["cost_per_hour"]},
                 "pdd": {"gpus": best_pdd["gpus"], "per_hour": best_pdd["cost_per_hour"]},
                 "paper_counts_at_our_prices": {
                     "baseline": {"gpus": PAPER["cost_counts"]["baseline"],
                                  "per_hour": paper_cost(PAPER["cost_counts"]["baseline"])},
                     "pdd": {"gpus": PAPER["cost_counts"]["pdd"],
                             "per_hour": paper_cost(PAPER["cost_counts"]["pdd"])}},
                 "saving_pct_by_gpu_b_premium": {
                     f"{premium:.2f}": 100 * (1 - paper_cost(PAPER["cost_counts"]["pdd"], premium)
                                              / paper_cost(PAPER["cost_counts"]["baseline"]))
                     for premium in (1.2, 1.25, 1.3)}},
        "wan_bytes_ratio_drc": ratios,
        "handoff": handoff,
        "handoff_source": "measured" if measured_handoff else "simulated",
        "prld_only": {"collapsed": data["f6"]["prld_only"]["collapsed"],
                      "pdd_collapsed": data["f6"]["pdd"]["collapsed"],
                      "quarters": data["f6"]["prld_only"]["quarters"]},
        "singular_filter": {name: {"wan_bytes": s["wan_bytes"],
                                   "relay_busy_request_s": s["relay_busy_request_s"],
                                   "finished_at": s["finished_at"], "main_hit": s["main_hit"],
                                   "ttft_p99_s": s["ttft_p99_s"]}
                            for name, s in data["f7"].items()},
        "sender_window": data["sender_window"],
        "wan_codec": data["wan_codec"],
        "background_window": data["background_window"],
        "trace": {name: dict(percentiles_from(s), wan_bytes=s["wan_bytes"],
                             finished_at=s["finished_at"], prefill_hit=s["prefill_hit"])
                  for name, s in data["f9"].items()},
    }


def percentiles_from(summary: dict) -> dict:
    return {"p50": summary["ttft_p50_s"], "p90": summary["ttft_p90_s"],
            "p99": summary["ttft_p99_s"]}


VALIDATION_KEYS = ("calibration", "profiles", "points")  # validate_sim.py's validation_detail.json


def read_validation(parser: argparse.ArgumentParser, path: Path) -> dict:
    """--validation's file, checked before the minutes of simulation, not after them."""
    try:
        detail = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        parser.error(f"--validation {path}: {err}")
    if not isinstance(detail, dict) or not all(k in detail for k in VALIDATION_KEYS):
        parser.error(f"--validation {path}: not a validation_detail.json from "
                     f"scripts/validate_sim.py (it needs {', '.join(VALIDATION_KEYS)}; the "
                     "validation.json beside it holds only the ratios)")
    return detail


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--quick", action="store_true", help="shorter runs (< 2 min, 2 cores)")
    parser.add_argument("--measured-handoff", type=Path,
                        help="handoff.json from scripts/bench_handoff.py (or any JSON with "
                             "{kv: {...}, token_ids: {...}}: payload_bytes, mean_ms, max_ms, "
                             "std_ms)")
    parser.add_argument("--trace", type=Path,
                        help="a Mooncake-format jsonl trace for F9 (timestamp ms, input_length, "
                             "output_length, hash_ids of 512-token blocks); default: "
                             "the public conversation trace")
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--validation", type=Path,
                        help="validation_detail.json from scripts/validate_sim.py: adds the "
                             "simulator-against-the-CPU-demo table to report.md")
    published.add_publish_flag(parser)
    args = parser.parse_args(argv)
    if args.publish and args.quick:
        parser.error("--publish: the current result is a full run, not --quick")
    validation = read_validation(parser, args.validation) if args.validation else None
    args.out.mkdir(parents=True, exist_ok=True)
    measured = json.loads(args.measured_handoff.read_text()) if args.measured_handoff else None
    if measured is not None and "handoff" in measured:
        measured = measured["handoff"]  # scripts/bench_handoff.py's handoff.json
    started = time.time()
    data = {}
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        extra = {"f9": {"trace": args.trace}}
        futures = {name: pool.submit(task, args.quick, **extra.get(name, {}))
                   for name, task in TASKS.items()}
        for name, future in futures.items():
            data[name] = future.result()
            print(f"  {name} done at {time.time() - started:.0f} s", flush=True)
    results = build_results(data, measured)
    results["trace_file"] = (args.trace or TRACE_PATH).name
    (args.out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    from pdd_sglang.sim.figures import draw_all
    draw_all(args.out, data, results, PAPER, measured)
    write_report(args.out, data, results, PAPER, args.quick, measured)
    if validation is not None:
        from pdd_sglang.sim.validation import report_section
        report = args.out / "report.md"
        section = report_section(validation)
        report.write_text(report.read_text() + "\n" + "\n".join(section))
    print(f"wrote {args.out}/report.md, results.json and f1-f9 PNGs in {time.time() - started:.0f} s")
    if args.publish:
        publish_figures(args.out)
    return 0


def publish_figures(out: Path) -> None:
    """results.json as docs/results/figures.json, with the line it ran on and the report's figures
    it is compared with."""
    line = load_link(OP.operating_point(False).base.wan_link)
    results = json.loads((out / "results.json").read_text())
    published.publish("figures", {**results, "line": {
        "rate_mbit": line.bytes_per_s * 8 / 1e6, "rtt_ms": line.rtt_s * 1e3}, "paper": {
        "ttft_reduction_pct": PAPER["ttft_reduction_pct"], "bcr_gain_pct": PAPER["bcr_gain_pct"]}})


if __name__ == "__main__":
    sys.exit(main())
