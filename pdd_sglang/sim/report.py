"""report.md for reproduce_figures.py: simulated numbers beside the paper's, and assumptions."""

from __future__ import annotations

from pathlib import Path

ASSUMPTIONS = """\
- CALIBRATED: effective prefill MFU 0.135 (the only fitted parameter; see F1). Everything else
  below is sourced or assumed a priori.
- Hardware (configs/hardware): GPU-A = H800-class (989 TFLOPS BF16, 80 GB, 3.35 TB/s), GPU-B =
  H200-class (same compute, 141 GB, 4.8 TB/s), 16 GPUs per instance (a 1T-class FP8 model needs
  two 80 GB nodes). Decode attention efficiency 0.5 (FlashMLA: 580 TFLOPS on H800), decode HBM
  efficiency 0.8, 2 ms per decode step overhead, 90% of HBM usable. Prices $2.00 (A) and $2.50
  (B) per GPU-hour: assumptions.
- Prefill runs DP attention + EP (SGLang's deployment of MLA models): each of an instance's 16
  GPUs prefills one request's attention at a time (FLOPs per (query, context) pair, 2.5e6 for
  Kimi-K2's expanded MLA, so a 90%-hit 64K request's attention over its cached 58K context costs
  ~1e15 FLOPs on ONE GPU); the linear/MoE layers (2 x 32B FLOPs per new token) use the whole
  instance, shared by the requests in flight. Decode: roofline max(memory, compute) per step,
  MoE weights touched grow with the batch's tokens up to all weights, MLA absorbed attention
  (8.5e6 FLOPs per pair). No separate EP all-to-all cost (folded into the calibrated MFU).
- Model (configs/models): Kimi-K2-like 1T MoE, 32B active, 50 KB of KV per token (the brief);
  the compressed-KV profile (4.4 KB/token, from the brief's 23 GB per 80 x 64K) is provided
  for the planner but not used in these figures.
- Links (configs/links): RDMA 40 GB/s per prefill GPU (one 400 Gb/s NIC; a request's KV leaves
  through its GPU's NIC); WAN 10 Gb/s (1.125 GB/s goodput),
  RTT 20 ms, uniform jitter up to 5 ms; flows share the line fairly (processor sharing). Control
  messages (ready, token ids, acks) pay one-way delay + jitter + their fair share of the rate.
- Caches: block-granular (512 tokens) LRU prefix caches; 16M tokens at prefill and at main's DRC
  (HBM plus a host-memory tier); main caches prompt + output, prefill caches the prompt.
- Decode admission reserves input + output tokens of KV; main may hold at most 256 requests,
  the relay 32 (it is sized for hiding, not for whole conversations).
- Workload (F1-F8): agentic sessions of 15-45 turns, 15-45 s think time, first context
  20-34K tokens growing by the previous output plus a tool result (100-1200 tokens, or
  4-14K with probability 0.15); 3% singular one-shot documents (56-72K in, <= 32 out). Outputs:
  72% uniform in 16-499, the rest 500-2000. Sessions already running at time 0 have their
  earlier turns pre-loaded into the caches (steady state). F1 load 3.3 req/s.
- The first token is computed by prefill and reaches the user when the decoding server that
  emits it holds the KV (relay: after RDMA; main: after the WAN copy plus one-way delay back
  to the router, which sits in datacenter A with prefill and relay).
- Handoff: main's "ready" crosses the WAN, then token ids (15 bytes each); main recomputes them
  in an extend riding in its next forward pass and emits the next token. If the relay has not
  started (it is backlogged) when main is ready, main serves the request directly.
- Policy: pdd_sglang.policy defaults: hide_wan_below_s 0.5 s, catch-up threshold and chunk 64
  tokens, relay load watermark 0.7, reactive singular filter on (main's WAN copy cancelled
  only for >= 32768 uncached tokens with <= 32 output tokens), predictive off.
- Goodput for BCR: highest request rate (doubling then 4 bisection steps, 150-300 simulated
  seconds per trial) with TTFT P90 <= 15 s (assumption: half the brief's ~30 s total budget), decode ITL P90 <= 30 ms and nothing left
  unfinished. The cost study uses the 100 Gb/s line ($0.66/h, an assumption).
- F2's seven bins are our choice (<10, 10-50, 50-80, 80-90, 90-95, 95-99, >=99 %): the brief
  names seven bins without listing them.
"""


def _fmt(value, digits=2):
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _ratio(sim, ref) -> str:
    if sim is None or ref in (None, 0):
        return "-"
    return f"{sim / ref:.2f}"


def calibration_and_validation(results: dict, paper: dict) -> list:
    """The one calibrated parameter, then every other paper number as a validation point."""
    ttft = results["ttft_s"]
    cal = results.get("calibration", {})
    lines = ["### Calibration (an assumption, not a result)", "",
             f"Exactly one parameter is fitted: the **effective prefill efficiency (MFU) = "
             f"{cal.get('prefill_mfu', float('nan')):g}** in configs/hardware/gpu_a.toml, chosen "
             "(bisection, `reproduce_figures.py --calibrate`) so that same-DC PD's simulated TTFT "
             "P50 on F1's workload equals the paper's 4.2 s. The same-DC P50 above is therefore "
             "fitted, not predicted. A physically measured prefill MFU is about 0.49 (LMSYS "
             "large-scale EP, DeepSeek-V3 on H100); with 0.45 our same-DC P50 would be "
             f"{_fmt(cal.get('p50_at_physical_mfu_s'))} s. The 3x gap is what the model leaves out "
             "(DP-attention ranks in lockstep behind the slowest rank, EP all-to-all, host-tier "
             "prefix loads) and the paper's unstated load; the offered load (3.3 req/s) and every "
             "other number are unchanged by the fit.", "",
             "### Validation points (simulated beside the paper, ratio = sim / paper)", "",
             "| quantity | simulated | paper | ratio |", "|---|---|---|---|"]
    rows = [("same-DC PD TTFT P50 s (CALIBRATED)", ttft["same_dc_pd"]["p50"], 4.2)]
    for q in ("p50", "p90", "p99"):
        rows.append((f"naive cross-DC PD TTFT {q.upper()} s", ttft["cross_dc_pd"][q],
                     paper["ttft_s"]["cross_dc_pd"][q]))
    red = results["ttft_reduction_pct"]
    for q in ("p50", "p90", "p99"):
        rows.append((f"PDD TTFT reduction vs cross-DC, {q.upper()} %", red[q],
                     paper["ttft_reduction_pct"]))
    rows.append(("BCR gain %", results["bcr"]["gain_pct"], paper["bcr_gain_pct"]))
    base_rps, pdd_rps = results["bcr"]["baseline_goodput_rps"], results["bcr"]["pdd_goodput_rps"]
    rows.append(("goodput (RPS within SLA) gain %",
                 100 * (pdd_rps / base_rps - 1) if base_rps else None, paper["rps_gain_pct"]))
    drc = results["wan_bytes_ratio_drc"]
    if drc:
        key = min(drc, key=lambda k: abs(float(k) - 0.90))
        rows.append((f"DRC WAN-bytes ratio at hit {key}", drc[key], paper["drc_ratio_at_90"]))
    h = results["handoff"]
    for kind in ("kv", "token_ids"):
        for metric in ("payload_bytes", "mean_ms", "max_ms", "std_ms"):
            ref = paper["handoff"][kind].get(metric)
            if ref is not None:
                rows.append((f"handoff {kind} {metric}", h[kind][metric], ref))
    for name, sim, ref in rows:
        lines.append(f"| {name} | {_fmt(sim)} | {_fmt(ref)} | {_ratio(sim, ref)} |")
    wan_p50 = ttft["cross_dc_pd"]["p50"] - ttft["same_dc_pd"]["p50"]
    lines += ["", f"**What disagrees.** The WAN's share of naive cross-DC TTFT: simulated P50 "
              f"{wan_p50:+.2f} s over same-DC against the paper's +2.5 s. With prefill at its "
              "calibrated speed, queueing for prefill (and cold 20-72K prefills whose attention runs "
              "on one GPU) dominates every percentile, while a 90%-hit suffix crosses a 10 Gb/s line "
              "in well under a second; so PDD, which hides only the WAN part, gains little here "
              "(reduction far below -51.5%). Either the paper's line carries much less than 10 Gb/s "
              "of goodput per request, or its WAN path has fixed costs we do not model (F3 points "
              "the same way: its token-id handoff takes 305 ms against our ~50 ms). We did not tune "
              "the line to close this gap.", "",
              "The paper's TTFT reduction (-51.5%) does not name its percentile; we list all three. "
              "Collapse of P->RLD-only (F6) is a yes/no validation point.", ""]
    return lines


def write_report(out: Path, data: dict, results: dict, paper: dict, quick: bool, measured) -> None:
    lines = ["# PDD simulator: the report's figures, simulated", "",
             f"Mode: {'quick' if quick else 'full'}. Every simulated number below is computed by "
             "`pdd_sglang.sim` from the profiles in `configs/`; the paper column is the PDD "
             "report's number (from the brief), never an input.", ""]
    ttft = results["ttft_s"]
    lines += ["## F1: TTFT at 64K, ~90% hit (f1.png)", "",
              "| setup | P50 sim | P50 paper | P90 sim | P90 paper | P99 sim | P99 paper |",
              "|---|---|---|---|---|---|---|"]
    for name in ttft:
        ref = paper["ttft_s"].get(name, {})
        lines.append(f"| {name} | " + " | ".join(
            f"{_fmt(ttft[name][q])} | {_fmt(ref.get(q))}" for q in ("p50", "p90", "p99")) + " |")
    red = results["ttft_reduction_pct"]
    f1 = data["f1"]
    lines += ["", f"TTFT reduction of PDD against naive cross-DC PD: P50 {red['p50']:.1f}%, "
              f"P90 {red['p90']:.1f}%, P99 {red['p99']:.1f}% (paper: -51.5%, percentile not "
              "stated).", "",
              f"Prefill-side token-weighted hit {f1['pdd']['summary']['prefill_hit']:.3f}; "
              f"main's DRC hit in PDD {f1['pdd']['summary']['main_hit']:.3f}; pipelines "
              f"{f1['pdd']['summary']['by_pipeline']}; finished at {f1['pdd']['summary']['finished_at']}.",
              ""]
    lines += calibration_and_validation(results, paper)
    lines += ["Load sweep (TTFT P90, s):", "", "| req/s | " + " | ".join(data["sweep"]) + " |",
              "|---|" + "---|" * len(data["sweep"])]
    rates = [r[0] for r in next(iter(data["sweep"].values()))]
    for i, rate in enumerate(rates):
        lines.append(f"| {rate} | " + " | ".join(_fmt(data["sweep"][n][i][1]) for n in data["sweep"]) + " |")
    lines += ["", "## F2: hit-rate distribution over time (f2.png)", "",
              "Shares per bin, averaged over the run: " + ", ".join(
                  f"{label} {100 * sum(r[1][i] for r in f1['hit_bins']) / max(1, len(f1['hit_bins'])):.1f}%"
                  for i, label in enumerate(["<10%", "10-50%", "50-80%", "80-90%", "90-95%", "95-99%", ">=99%"])),
              "(the brief: 70-80% of requests above 95%).", ""]
    h = results["handoff"]
    source = "measured" if measured else "simulated (no measured microbenchmark JSON given)"
    lines += [f"## F3: handing over 100 tokens (f3.png), {source}", "",
              "| path | payload sim | payload paper | mean ms sim | mean paper | max ms sim | max paper | std ms sim | std paper |",
              "|---|---|---|---|---|---|---|---|---|"]
    for kind in ("kv", "token_ids"):
        ref = paper["handoff"][kind]
        lines.append(f"| {kind} | {h[kind]['payload_bytes']:.0f} B | {ref['payload_bytes']:.0f} B | "
                     f"{_fmt(h[kind]['mean_ms'], 1)} | {ref['mean_ms']} | {_fmt(h[kind]['max_ms'], 1)} | "
                     f"{ref['max_ms']} | {_fmt(h[kind]['std_ms'], 1)} | {ref.get('std_ms', '-')} |")
    lines += ["", "The simulated latencies are one-way delay (10 ms) + jitter + fair-share transfer "
              "(KV) or waiting for main's next forward pass + the extend (token ids). The paper's "
              "305 ms mean for token ids (std 4.8 ms) suggests a fixed cost of about 300 ms in its "
              "path (RTT, scheduling or polling) that the brief does not explain and we do not "
              "model; our GPU copy of the KV is a roofline (microseconds) against the paper's "
              "24.5 ms. The qualitative point holds: the token-id payload is 3,000x smaller and "
              "its latency depends on main's step, not on WAN congestion.", ""]
    f4 = data["f4"]
    b, p = f4["baseline"][0], f4["pdd"][0]
    paper_costs = results["cost"]["paper_counts_at_our_prices"]
    saving = 100 * (1 - paper_costs["pdd"]["per_hour"] / paper_costs["baseline"]["per_hour"])
    lines += ["## F4: BCR and cost (f4.png)", "",
              "| | layout | GPUs | $/h | goodput req/s | BCR req/$ |", "|---|---|---|---|---|---|",
              f"| same-DC PD | {b['prefill']}P + {b['main']}D | {b['gpus']} | {b['cost_per_hour']:.2f} | "
              f"{b['goodput_rps']:.2f} | {b['bcr_requests_per_dollar']:.0f} |",
              f"| PDD | {p['prefill']}P + {p['relay']}RLD + {p['main']}MD | {p['gpus']} | "
              f"{p['cost_per_hour']:.2f} | {p['goodput_rps']:.2f} | {p['bcr_requests_per_dollar']:.0f} |",
              "", f"Simulated BCR gain {_fmt(results['bcr']['gain_pct'], 1)}% (paper up to +37.5%); "
              f"goodput gain {100 * (p['goodput_rps'] / max(b['goodput_rps'], 1e-9) - 1):+.1f}% "
              "(paper +27.8% RPS within SLA).", "",
              f"The paper's counts at our prices: 88 GPU-A = ${paper_costs['baseline']['per_hour']:.2f}/h; "
              f"43 GPU-A + 32 GPU-B + line = ${paper_costs['pdd']['per_hour']:.2f}/h, i.e. "
              f"{saving:.1f}% cheaper (paper: 3.5-7.1% with GPU-B 20-30% dearer). This row is "
              "arithmetic on the paper's counts, not a simulation. Our instances are 16 GPUs, so the "
              "simulated layouts cannot match 43/32 exactly; the planner "
              "(`python -m pdd_sglang.sim.plan`) searches instance counts." + (
                  " Quick mode evaluates one layout per setup (1P + 2D against 1P + 1RLD + 1MD) "
                  "with 150 s trials; the full run searches 1-3 instances per role." if quick else ""),
              ""]
    f5 = data["f5"]
    lines += ["## F5: One-Shot vs Catch-Up around the handoff (f5.png)", "",
              "| mode | handoff gap P50 ms | gap P99 ms | relay slot-seconds | main ITL P99 ms |",
              "|---|---|---|---|---|"]
    for mode in ("one-shot", "catch-up"):
        s = f5[mode]["summary"]
        lines.append(f"| {mode} | {_fmt(s['handoff_gap_p50_ms'], 1)} | {_fmt(s['handoff_gap_p99_ms'], 1)} | "
                     f"{s['relay_busy_request_s']:.0f} | {_fmt(s['itl_p99_ms'], 1)} |")
    lines += ["", "Every handoff forced into one mode. The gap is the time between the relay's last "
              "token and main's first at the router; it includes one WAN round trip in both modes. "
              "The brief: One-Shot frees the relay at once with a small stall; Catch-Up keeps each "
              "step imperceptible at a little more relay time.", ""]
    f6 = data["f6"]
    lines += ["## F6: P->RLD-only collapse (f6.png)", "",
              f"Collapsed: P->RLD-only **{f6['prld_only']['collapsed']}**, PDD **{f6['pdd']['collapsed']}** "
              "(criterion: relay backlog above its slot count at the last arrival and last-quarter "
              "median TTFT >= 10x the first quarter's).", "",
              "| quarter | relay share P->RLD-only | TTFT P50 P->RLD-only | relay share PDD | TTFT P50 PDD |",
              "|---|---|---|---|---|"]
    for i in range(4):
        a, c = f6["prld_only"]["quarters"][i], f6["pdd"]["quarters"][i]
        lines.append(f"| {i + 1} | {a['relay_share']:.2f} | {a['ttft_p50_s']:.2f} | "
                     f"{c['relay_share']:.2f} | {c['ttft_p50_s']:.2f} |")
    lines += ["", f"Main's DRC hit: P->RLD-only {f6['prld_only']['summary']['main_hit']:.3f} over "
              "the few requests still reaching main, against prefill's "
              f"{f6['prld_only']['summary']['prefill_hit']:.3f}: sessions finished at the relay never "
              "reach main, their next turn misses there, goes to the relay again, and the relay's "
              "share climbs until it saturates (the brief's positive feedback).", ""]
    lines += ["## F7: singular filter (f7.png)", "",
              "| variant | WAN GB | relay slot-s | finished at | main hit | TTFT P99 s |", "|---|---|---|---|---|---|"]
    for name, s in data["f7"].items():
        lines.append(f"| {name} | {s['wan_bytes'] / 1e9:.1f} | {s['relay_busy_request_s']:.0f} | "
                     f"{s['finished_at']} | {s['main_hit']:.3f} | {_fmt(s['ttft_p99_s'])} |")
    f7 = data["f7"]
    lines += ["", "Variants: *off*, the relay holds every request it finishes until main holds "
              "the prompt and a handoff aligns main's cache; *reactive* (the default, the "
              "router's rule `policy.cancel_wan_copy`), a relay-first finish drops the handoff "
              "and frees the relay, main's WAN copy is cancelled only for singular traffic "
              "(uncached >= singular_min_uncached_tokens and output <= singular_max_new_tokens), "
              "any other copy lands and main caches the prompt; *reactive+predictive*, singular "
              "requests are also sent to the relay alone up front; *cancel-all*, every "
              "relay-first copy is cancelled (serving's rule before the filter).", ""]
    if "cancel-all" in f7 and "reactive" in f7:
        cut, kept = f7["cancel-all"], f7["reactive"]
        def compare(key, scale=1.0, digits=3):
            side = "higher" if cut[key] > kept[key] else "not higher"
            return f"{cut[key] / scale:.{digits}f} against {kept[key] / scale:.{digits}f} ({side})"
        lines += ["Against the default, cancelling every relay-first copy: main's DRC hit "
                  f"{compare('main_hit')}; relay slot-s {compare('relay_busy_request_s', 1, 0)}; "
                  f"WAN GB {compare('wan_bytes', 1e9, 0)}. Where main's hit falls and bytes "
                  "rise, the next turn of each cut session missed at main, shipped its whole "
                  "context and went to the relay again: a mild form of F6's feedback, the "
                  "collapse also measured on the real CPU demo.", ""]
    lines += ["## F8: WAN bandwidth against hit rate, with and without DRC (f8.png)", "",
              "| prefill hit | main DRC hit | Gb/s without DRC | Gb/s with DRC | ratio |", "|---|---|---|---|---|"]
    for r in sorted(data["f8"], key=lambda r: r["prefill_hit"]):
        lines.append(f"| {r['prefill_hit']:.3f} | {r['main_hit']:.3f} | {r['without_drc_gbps']:.1f} | "
                     f"{r['with_drc_gbps']:.2f} | {r['ratio']:.1f}x |")
    lines += ["", "Paper: up to 10x less WAN bandwidth at 90% average hit. Main's DRC also holds "
              "the previous turn's output, so its hit runs slightly above prefill's.", ""]
    lines += ["## F9: the public conversation trace (f9.png)", "",
              "| setup @ line | P50 | P90 | P99 | WAN GB | finished at | prefill hit |", "|---|---|---|---|---|---|---|"]
    for name, s in data["f9"].items():
        lines.append(f"| {name} | {_fmt(s['ttft_p50_s'])} | {_fmt(s['ttft_p90_s'])} | {_fmt(s['ttft_p99_s'])} | "
                     f"{s['wan_bytes'] / 1e9:.0f} | {s['finished_at']} | {s['prefill_hit']:.2f} |")
    lines += ["", "At 37% hit the 10 Gb/s line cannot carry naive cross-DC PD at all (its queue "
              "grows without bound). PDD keeps TTFT low there only by finishing many requests at "
              "the relay, which is the regime the brief warns about: low hit erodes main's cache "
              "alignment. With a 100 Gb/s line the WAN copy is short and PDD's benefit shrinks "
              "to nothing: it matches naive cross-DC.", "",
              "## Assumptions", "", ASSUMPTIONS]
    (out / "report.md").write_text("\n".join(lines))
