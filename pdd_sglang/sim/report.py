"""report.md for reproduce_figures.py: the operating point, F1-F4 and the assumptions.

Every number in the text is computed here from results.json, the run's data or the profiles in
configs/; the report's own numbers come only from the `paper` dict, labelled as the report's.
F5-F9 are written by report_studies.py.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from .operating_point import CONFIG, QUANTILES
from .profiles import InstanceCost, load_hardware, load_link, load_model
from .report_studies import LABELS, fmt as _fmt, studies


def _pct(value) -> str:
    return "-" if value is None else f"{value:.1f}%"


def operating_point_section(results: dict) -> list:
    op = results["operating_point"]
    lines = ["## The operating point (configs/operating_point.toml, configs/links/wan_f1.toml)", "",
             f"Offered load **{op['rate_per_s']:.3f} req/s** (FITTED: same_dc_pd's TTFT P50 to the "
             f"report's {op['checks'][0]['target']} s); line **{op['line_gbps']:.0f} Gb/s** with a "
             f"per-flow window of **{op['window_bytes'] / 1e6:.0f} MB** ({op['per_flow_gbps']:.1f} "
             "Gb/s per flow at the line's RTT; both FITTED on a grid to the report's naive cross-DC "
             "percentiles) and a per-transfer fixed cost of "
             f"**{1000 * op['per_transfer_fixed_s']:.0f} ms** (CALIBRATED from F3's incremental-KV "
             "point). `python -m pdd_sglang.sim.operating_point --fit` prints each fit beside its "
             "target.", "",
             f"The other way to land the same-DC median, a fixed latency before prefill, would "
             f"need {op['fixed_cost_alternative']['fixed_s']:.2f} s per request at "
             f"{op['fixed_cost_alternative']['rate_per_s']} req/s (where the median is "
             f"{op['fixed_cost_alternative']['bare_p50_s']:.2f} s without it); no such cost is "
             f"known, so the load is fitted instead: the report's {op['checks'][0]['target']} s "
             "median is read as "
             "queueing for prefill at a load it does not state.", "",
             "Same-DC PD's TTFT P50 in each quarter of the run (by arrival): "
             + " / ".join(f"{v:.2f}" for v in op["same_dc_p50_by_quarter"])
             + " s: the median is queueing for prefill near saturation, so it moves with the "
             "workload's bursts.", "",
             f"Prompts average {op['mean_input_tokens'] / 1000:.1f}K tokens with a token-weighted "
             f"prefix hit of {100 * op['prefill_hit']:.1f}% at prefill (the report's F1: 64K "
             "total length, about 90% hit).", "",
             "| condition | simulated | report | allowed | met |", "|---|---|---|---|---|"]
    for row in op["checks"]:
        lines.append(f"| {row['quantity']} | {row['simulated']:.2f} | {row['target']} | "
                     f"±{100 * row['tolerance']:.0f}% | {'yes' if row['within'] else '**no**'} |")
    lines.append("")
    return lines


def f1_section(data: dict, results: dict, paper: dict) -> list:
    ttft = results["ttft_s"]
    lines = ["## F1: TTFT at the operating point (f1.png)", "",
             "| setup | P50 s | P90 s | P99 s | report P50 | report P90 | report P99 |",
             "|---|---|---|---|---|---|---|"]
    for name, value in ttft.items():
        ref = paper["ttft_s"].get(name, {})
        lines.append(f"| {LABELS[name]} | " + " | ".join(_fmt(value[q]) for q in QUANTILES)
                     + " | " + " | ".join(_fmt(ref.get(q)) for q in QUANTILES) + " |")
    aware = results["operating_point"]["pdd_congestion_aware"]
    lines.append("| PDD, congestion-aware placement | "
                 + " | ".join(_fmt(aware[q]) for q in QUANTILES) + " | - | - | - |")
    total = results["ttft_reduction_pct"]
    mech = results["ttft_reduction_pct_by_mechanism"]
    bound = {q: 100 * (1 - ttft["same_dc_pd"][q] / ttft["cross_dc_pd"][q]) for q in QUANTILES}
    target = paper["ttft_reduction_pct"]
    lines += ["", "PDD's TTFT cut against naive cross-DC PD, and its split: *DRC* is naive -> "
              "cross_dc_pd_drc, *relay* is cross_dc_pd_drc -> PDD (relay, handoff and filter on "
              "top of DRC); the two add up to the total. *Bound* is the cut PDD would get by "
              "matching same-DC PD, which it cannot beat (its prefill is the same).", "",
              "| percentile | total cut | from DRC | from the relay | bound (= same-DC) | report |",
              "|---|---|---|---|---|---|"]
    for q in QUANTILES:
        lines.append(f"| {q.upper()} | {_pct(total[q])} | {_pct(mech['drc'][q])} | "
                     f"{_pct(mech['relay'][q])} | {_pct(bound[q])} | {target}% |")
    best = max(QUANTILES, key=lambda q: total[q])
    aware_cut = {q: 100 * (1 - aware[q] / ttft["cross_dc_pd"][q]) for q in QUANTILES}
    compute_p99 = results["operating_point"]["ttft_parts_s"]["same_dc_pd"]["prefill_compute"]["p99"]
    lines += ["", verdict(total, mech, bound, target, best, aware_cut, compute_p99), ""]
    lines += [tail_verdict(total, mech, bound, target, ttft, paper), ""]
    lines += ttft_parts(results)
    return lines


def verdict(total: dict, mech: dict, bound: dict, target: float, best: str,
            aware_cut: dict, same_dc_compute_p99: float) -> str:
    """Which mechanism falls short of the report's cut, and by how much (computed)."""
    if total[best] >= target:
        return (f"PDD's cut reaches the report's {target}% at {best.upper()} "
                f"({total[best]:.1f}%).")
    parts = [f"**The model does not reach the report's {target}%.** The largest cut is "
             f"{total[best]:.1f}% at {best.upper()}, {target - total[best]:.1f} points short."]
    gap_to_bound = bound[best] - total[best]
    if bound[best] < target:
        parts.append(f"Even a PDD as fast as same-DC PD would cut only {bound[best]:.1f}% there: "
                     f"{target - bound[best]:.1f} points of the shortfall lie in the baselines "
                     "(same-DC's own TTFT is too close to naive cross-DC's), not in a mechanism.")
    parts.append(f"DRC alone earns {mech['drc'][best]:.1f} points and the relay "
                 f"{mech['relay'][best]:.1f} more; PDD stops {gap_to_bound:.1f} points short of "
                 "the same-DC bound.")
    parts.append("With congestion-aware placement (the live line state in policy.LineState) "
                 f"the cut is {aware_cut[best]:.1f}% at {best.upper()}, so "
                 f"{aware_cut[best] - total[best]:+.1f} points of that gap are requests the "
                 "idle-line prediction sent straight to main while the line was busy.")
    lowest = min(QUANTILES, key=lambda q: bound[q])
    parts.append(f"At {lowest.upper()} the bound itself is {bound[lowest]:.1f}%: prefill compute "
                 f"alone reaches {same_dc_compute_p99:.1f} s at P99 in every setup (cold "
                 "prefills of compacted sessions and singular documents), which no placement "
                 "of decode shortens.")
    return " ".join(parts)


def tail_verdict(total: dict, mech: dict, bound: dict, target: float, ttft: dict,
                 paper: dict) -> str:
    """The report's claim at P90 and P99, where the issue asks for it, split into what the
    baselines allow and what the mechanisms leave."""
    parts = []
    for q in ("p90", "p99"):
        short = target - total[q]
        if short <= 0:
            parts.append(f"At {q.upper()} PDD's cut, {total[q]:.1f}%, reaches the report's {target}%.")
            continue
        needed = (1 - target / 100) * paper["ttft_s"]["cross_dc_pd"][q]
        parts.append(
            f"At {q.upper()} the cut is {total[q]:.1f}%, {short:.1f} points short: "
            f"{max(0.0, target - bound[q]):.1f} of them because same-DC PD itself is only "
            f"{bound[q]:.1f}% below naive cross-DC, {max(0.0, bound[q] - total[q]):.1f} because "
            f"PDD stays above same-DC (DRC {mech['drc'][q]:.1f} and relay {mech['relay'][q]:.1f} "
            f"points earned). Against the report's own naive {q.upper()} of "
            f"{paper['ttft_s']['cross_dc_pd'][q]} s, a {target}% cut means a PDD {q.upper()} of "
            f"{needed:.1f} s; simulated same-DC PD, which PDD cannot beat, has "
            f"{ttft['same_dc_pd'][q]:.1f} s.")
    return " ".join(parts)


def ttft_parts(results: dict) -> list:
    op = results["operating_point"]
    parts = op["ttft_parts_s"]
    lines = ["Where TTFT goes (per-request percentiles, s): *before prefill* is the dispatch "
             "latency plus waiting for a prefill lane; *after prefill* is waiting for decode "
             "admission plus the KV copy and delivery.", "",
             "| setup | before prefill P50 / P99 | prefill compute P50 / P99 | after prefill P50 / P99 "
             "| decode admission wait P99 |", "|---|---|---|---|---|"]
    for name, p in parts.items():
        lines.append(f"| {LABELS[name]} | {_fmt(p['prefill_queue']['p50'])} / "
                     f"{_fmt(p['prefill_queue']['p99'])} | {_fmt(p['prefill_compute']['p50'])} / "
                     f"{_fmt(p['prefill_compute']['p99'])} | {_fmt(p['after_prefill']['p50'])} / "
                     f"{_fmt(p['after_prefill']['p99'])} | "
                     f"{_fmt(op['decode_admission_wait_p99_s'][name])} |")
    same = parts["same_dc_pd"]
    dominant = {q: max(same, key=lambda k: same[k][q]) for q in ("p50", "p99")}
    names = {"prefill_queue": "waiting before prefill", "prefill_compute": "prefill compute",
             "after_prefill": "the time after prefill"}
    lines += ["", f"In same-DC PD the largest part at P50 is {names[dominant['p50']]} "
              f"({_fmt(same[dominant['p50']]['p50'])} s) and at P99 {names[dominant['p99']]} "
              f"({_fmt(same[dominant['p99']]['p99'])} s). (Percentiles of parts do not add up to "
              "the percentile of the whole.)", ""]
    return lines


def sweep_section(data: dict) -> list:
    lines = []
    for axis, unit in (("line", "line Gb/s"), ("load", "req/s")):
        rows = data["sweep"][axis]
        names = list(rows)
        lines += [f"TTFT P90 (s) against {unit}, everything else at the operating point "
                  f"({data['sweep']['duration_s']:.0f} s of arrivals):", "",
                  f"| {unit} | " + " | ".join(LABELS[n] for n in names) + " |",
                  "|---|" + "---|" * len(names)]
        for i, point in enumerate(rows[names[0]]):
            lines.append(f"| {point[0]:.3g} | " + " | ".join(_fmt(rows[n][i][2]) for n in names) + " |")
        cuts = [(rows["cross_dc_pd"][i][0], 100 * (1 - rows["pdd"][i][2] / rows["cross_dc_pd"][i][2]))
                for i in range(len(rows["pdd"]))]
        best = max(cuts, key=lambda c: c[1])
        worst = min(cuts, key=lambda c: c[1])
        lines += ["", f"PDD's P90 cut against naive cross-DC PD across this sweep: largest "
                  f"{best[1]:.1f}% at {best[0]:.3g} {unit}, smallest {worst[1]:.1f}% at "
                  f"{worst[0]:.3g} {unit}.", ""]
    return lines


def f2_f3_section(data: dict, results: dict, paper: dict, measured) -> list:
    f1 = data["f1"]
    bins = ["<10%", "10-50%", "50-80%", "80-90%", "90-95%", "95-99%", ">=99%"]
    shares = [100 * sum(r[1][i] for r in f1["hit_bins"]) / max(1, len(f1["hit_bins"]))
              for i in range(len(bins))]
    lines = ["## F2: hit-rate distribution over time (f2.png)", "",
             "Shares of requests per prefix-hit bin at prefill, averaged over the run: "
             + ", ".join(f"{label} {share:.1f}%" for label, share in zip(bins, shares))
             + f"; {sum(shares[5:]):.1f}% of requests hit above 95%. Token-weighted hit "
             f"{f1['pdd']['summary']['prefill_hit']:.3f} at prefill, "
             f"{f1['pdd']['summary']['main_hit']:.3f} at main's DRC in PDD.", ""]
    sim = data["f3"]
    op = results["operating_point"]
    lines += [f"## F3: handing over {sim['tokens']} tokens (f3.png)", "",
              "| path | payload | mean ms | max ms | std ms | report mean | report max |"
              + (" measured mean | measured max |" if measured else ""),
              "|---|---|---|---|---|---|---|" + ("---|---|" if measured else "")]
    for kind in ("kv", "token_ids"):
        ref = paper["handoff"][kind]
        row = (f"| {kind} | {sim[kind]['payload_bytes'] / 1e3:.1f} KB | {sim[kind]['mean_ms']:.1f} | "
               f"{sim[kind]['max_ms']:.1f} | {sim[kind]['std_ms']:.1f} | {ref['mean_ms']} | "
               f"{ref['max_ms']} |")
        if measured:
            row += f" {_fmt(measured[kind].get('mean_ms'), 1)} | {_fmt(measured[kind].get('max_ms'), 1)} |"
        lines.append(row)
    lines += ["", f"The KV path's mean is the calibration point: the line's per-transfer fixed "
              f"cost ({1000 * op['per_transfer_fixed_s']:.0f} ms) is the report's "
              f"{paper['handoff']['kv']['mean_ms']} ms less what the line gives without it, so "
              "this row agrees by construction. The token-id path is not fitted: "
              f"{sim['token_ids']['mean_ms']:.1f} ms against the report's "
              f"{paper['handoff']['token_ids']['mean_ms']} ms (one-way delay, waiting for main's "
              "next step and the extend; whatever else the report's path pays is not modelled)."
              + (" Measured: scripts/bench_handoff.py's real handoff on the CPU demo (a tiny "
                 "model on CPUs), shown for its shape, not its scale." if measured else
                 " No measured handoff file was given (--measured-handoff)."), ""]
    return lines


def f4_section(data: dict, results: dict, paper: dict, quick: bool) -> list:
    f4 = data["f4"]
    sla = f4["sla"]
    floors = "; ".join(f"{LABELS[name]} {ttft:.2f} s and {itl:.1f} ms"
                       for name, (ttft, itl) in f4["floors"].items())
    lines = ["## F4: BCR and cost (f4.png)", "",
             f"SLA (DECLARED): TTFT P90 <= {sla['ttft_p90_s']} s and ITL P90 <= "
             f"{sla['itl_p90_ms']} ms, nothing left unfinished; goodput is the highest offered "
             f"load meeting it. Idle floors (TTFT P90 and ITL P90 at {f4['idle_rate_per_s']} req/s "
             "on each best "
             f"layout): {floors}. "
             + ("The SLA is above every floor, so goodput measures capacity, not the floor."
                if all(t < sla["ttft_p90_s"] and i < sla["itl_p90_ms"]
                       for t, i in f4["floors"].values())
                else "**The SLA is not above every floor**: a setup failing at idle gets no "
                     "goodput at any size."), "",
             "| setup | layout | GPUs | $/h | goodput req/s | BCR req/$ |",
             "|---|---|---|---|---|---|"]
    for key in ("baseline", "hetero", "pdd"):
        for r in f4.get(key, [])[:1]:
            gpus = ", ".join(f"{n} x {k}" for k, n in sorted(r["gpus"].items()))
            layout = (f"{r['prefill']}P + {r['relay']}RLD + {r['main']}MD" if r["relay"]
                      else f"{r['prefill']}P + {r['main']}D")
            lines.append(f"| {LABELS[r['setup']]} | {layout} | {gpus} | {r['cost_per_hour']:.2f} | "
                         f"{r['goodput_rps']:.2f} | {r['bcr_requests_per_dollar']:.0f} |")
    bcr = results["bcr"]
    lines += ["", f"BCR gain of PDD against same-DC PD (GPU-A): {_pct(bcr['gain_pct'])}; against "
              f"same-DC PD with GPU-B decode: {_pct(bcr.get('gain_vs_hetero_pct'))} (report: up to "
              f"+{paper['bcr_gain_pct']}%).", ""]
    costs = results["cost"]["paper_counts_at_our_prices"]
    lines += ["The report's layouts at our prices (arithmetic, not simulation):", "",
              "| layout | $/h |", "|---|---|"]
    for key, row in costs.items():
        gpus = " + ".join(f"{n} {k}" for k, n in row["gpus"].items())
        lines.append(f"| {gpus}{' + line' if key == 'pdd' else ''} | {row['per_hour']:.2f} |")
    saving = 100 * (1 - costs["pdd"]["per_hour"] / costs["baseline"]["per_hour"])
    low, high = paper["cost_saving_pct"]
    by_premium = results["cost"]["saving_pct_by_gpu_b_premium"]
    lines += ["", f"PDD's layout is {saving:.1f}% cheaper per hour at these prices; with GPU-B "
              + ", ".join(f"{100 * (float(k) - 1):.0f}% dearer than GPU-A: {v:.1f}%"
                          for k, v in by_premium.items())
              + f" (report: {low}-{high}% for 20-30% dearer).", ""]
    return lines


def assumptions() -> list:
    """The declared inputs, read back from configs/ (so the text cannot drift from them)."""
    a, b = load_hardware("gpu_a"), load_hardware("gpu_b")
    model = load_model("moe_1t_50kb")
    line = load_link("wan_f1")
    rdma = load_link("rdma_intra_dc")
    with open(CONFIG, "rb") as handle:
        config = tomllib.load(handle)
    w = config["workload"]
    cost_a = InstanceCost(a, model)
    cost_b = InstanceCost(b, model)
    return [
        "## Assumptions (read from configs/)", "",
        f"- Model: {model.name}: {model.total_params / 1e12:.2f}T parameters, "
        f"{model.active_params / 1e9:.0f}B active, {model.kv_bytes_per_token / 1e3:.0f} KB of KV "
        f"per token, {model.moe_layers} MoE layers.",
        f"- GPU-A: {a.name}, {a.gpus_per_instance} per instance, {a.peak_flops / 1e12:.0f} TFLOPS, "
        f"{a.hbm_bytes / 1e9:.0f} GB at {a.hbm_bytes_per_s / 1e12:.2f} TB/s, "
        f"${a.cost_per_gpu_hour:.2f}/GPU-h; KV room {cost_a.kv_capacity_tokens / 1e6:.1f}M tokens "
        "per instance after the weights.",
        f"- GPU-B: {b.name}, {b.hbm_bytes / 1e9:.0f} GB at {b.hbm_bytes_per_s / 1e12:.2f} TB/s, "
        f"${b.cost_per_gpu_hour:.2f}/GPU-h; KV room {cost_b.kv_capacity_tokens / 1e6:.1f}M tokens.",
        f"- Prefill: linear/MoE layers at MFU {a.prefill_mfu} (CITED), attention on one GPU per "
        f"request (DP attention) at MFU {a.prefill_attention_mfu} (CITED), chunks of "
        f"{a.chunked_prefill_tokens} tokens each paying {1000 * a.prefill_overhead_s:.0f} ms "
        f"(DECLARED), {1000 * a.dispatch_latency_s:.0f} ms before prefill per request (DECLARED). "
        f"A cold 64K prompt takes {cost_a.prefill_seconds(65536, 0):.2f} s on an idle instance; "
        f"a 90%-hit one {cost_a.prefill_seconds(6554, 58982):.2f} s.",
        f"- Decode: roofline (HBM efficiency {a.memory_efficiency}, decode MFU {a.decode_mfu}), "
        f"at least {model.moe_layers} x {1e6 * a.ep_layer_latency_s:.0f} us of EP dispatch + "
        f"combine per step (CITED), plus {1000 * a.step_overhead_s:.0f} ms: one request at 64K "
        f"steps in {1000 * cost_a.forward_seconds(1, 65536):.1f} ms on GPU-A, 100 at 55K in "
        f"{1000 * cost_b.forward_seconds(100, 100 * 55000):.1f} ms on GPU-B.",
        f"- F1's line: {line.bytes_per_s * 8 / 1e9:.0f} Gb/s, RTT {1000 * line.rtt_s:.0f} ms, "
        f"jitter up to {1000 * line.jitter_s:.0f} ms, window {line.window_bytes / 1e6:.0f} MB, "
        f"{1000 * line.per_transfer_fixed_s:.0f} ms per transfer; flows share it fairly up to "
        f"their window. Intra-DC RDMA: {rdma.bytes_per_s / 1e9:.0f} GB/s per prefill GPU.",
        f"- Workload: agentic sessions starting at {w['first_context_min'] // 1000}-"
        f"{w['first_context_max'] // 1000}K tokens, compacted at {w['max_context_tokens']} tokens; "
        f"tool results of {w['small_delta_min']}-{w['small_delta_max']} tokens, or "
        f"{w['big_delta_min']}-{w['big_delta_max']} with probability {w['big_delta_probability']}; "
        f"{100 * w['singular_fraction']:.0f}% singular documents; seed {w['seed']}.",
        "- Policy: pdd_sglang.policy defaults (the router's), idle-line placement unless stated.",
        ""]


def sender_window_section(runs: dict | None) -> list:
    """PDD and naive cross-DC PD on the brief's line under the WAN sender's old and new rule."""
    if not runs:
        return []
    lines = ["## The WAN sender's window at the brief's line (10 Gb/s, 20 ms)", "",
             f"The operating point's load scaled by the lines' rates (x{runs['load_scale']:.3f}); "
             "one copy moves at most its window per RTT. `one_slice`: the sender before issue 34 "
             "(one 4 MiB slice per round trip); `window`: slices of four bandwidth-delay products, twelve "
             "more in flight (`prefill/wan_engine.py`, measured by `scripts/bench_wan_line.py`).",
             "", "| setup | rule | window MB | TTFT P50 s | P90 s | P99 s |", "|---|---|---|---|---|---|"]
    for key, run in runs.items():
        if key == "load_scale":
            continue
        setup, rule = key.split("/")
        lines.append(f"| {setup} | {rule} | {run['window_bytes'] / 1e6:.1f} | {run['p50']:.2f} | "
                     f"{run['p90']:.2f} | {run['p99']:.2f} |")
    return lines + [""]


def wan_codec_section(runs: dict | None) -> list:
    """PDD on the brief's line with main's KV raw, losslessly coded and FP8 (issue 36)."""
    if not runs:
        return []
    lines = ["## Main's KV coded on the WAN, at the brief's line (10 Gb/s, 20 ms)", "",
             f"As the section above (load x{runs['load_scale']:.3f}, the windowed sender). Each "
             "codec's ratio is from the literature, its coding declared free on a GPU "
             "(`configs/codecs/`); lossless codes a copy only where that shortens it (auto), FP8 "
             "every copy. The simulator does not model FP8's effect on the tokens.", "",
             "| codec | ratio | TTFT P50 s | P90 s | P99 s | WAN GB | source |",
             "|---|---|---|---|---|---|---|"]
    for label, run in runs.items():
        if label == "load_scale":
            continue
        lines.append(f"| {label} | {run['ratio']:.2f} | {run['p50']:.2f} | {run['p90']:.2f} | "
                     f"{run['p99']:.2f} | {run['wan_bytes'] / 1e9:.0f} | {run['source'] or '-'} |")
    return lines + [""]


def background_window_section(runs: dict | None) -> list:
    """PDD's P->MD copies on the brief's line behind background copies, by their window."""
    if not runs:
        return []
    lines = ["## The copy a request waits for behind a background copy, at the brief's line", "",
             f"As the sections above (load x{runs['load_scale']:.3f}, the windowed sender), on the "
             "classed line (`sim/wan_lines.py`): a P->MD copy that takes the line from a "
             "background copy (a handoff's, or a cache-only one) gets it at that copy's next "
             "slice and shares it with that copy's window in flight. `full_window`: the window "
             "every copy keeps (16 round trips, 0.32 s); "
             "`background_bound`: a background copy keeps at most "
             "`policy.wan_order.BACKGROUND_IN_FLIGHT_S` of the line. A P->MD copy's wait is its "
             "first token less its prefill's end; its floor, its bytes alone on the line plus one "
             "way and the transfer's fixed cost.", "",
             "| bound | P->MD / requests | P->MD wait P50 s | P90 s | P90 over floor | "
             "TTFT P50 s | P90 s | P99 s | cache-only GB sent | dropped |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for label, run in runs.items():
        if label == "load_scale":
            continue
        lines.append(
            f"| {label} | {run['p_md']} / {run['requests']} | {run['p_md_wait_p50_s']:.3f} | "
            f"{run['p_md_wait_p90_s']:.3f} | {run['p_md_wait_over_floor_p90']:.2f} | "
            f"{run['p50']:.2f} | {run['p90']:.2f} | {run['p99']:.2f} | "
            f"{run['sent_by_class']['cache_only'] / 1e9:.0f} | "
            f"{run['dropped_cache_only_bytes'] / 1e9:.1f} |")
    return lines + [""]


def write_report(out: Path, data: dict, results: dict, paper: dict, quick: bool, measured) -> None:
    lines = ["# PDD simulator: the report's figures, simulated", "",
             f"Mode: {'quick' if quick else 'full'}. Every simulated number is computed by "
             "`pdd_sglang.sim` from the profiles in `configs/`; report columns are the PDD "
             "report's numbers, used only as targets.", ""]
    lines += operating_point_section(results)
    lines += f1_section(data, results, paper)
    lines += sweep_section(data)
    lines += f2_f3_section(data, results, paper, measured)
    lines += f4_section(data, results, paper, quick)
    lines += studies(data, paper)
    lines += sender_window_section(data.get("sender_window"))
    lines += wan_codec_section(data.get("wan_codec"))
    lines += background_window_section(data.get("background_window"))
    lines += assumptions()
    (out / "report.md").write_text("\n".join(lines))
