"""report.md's mechanism studies, F5-F9 (every number computed from the run's data)."""

from __future__ import annotations

from .cluster import Setup

LABELS = {s.value: s.label for s in Setup}


def fmt(value, digits=2):
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def studies(data: dict, paper: dict) -> list:
    """F5-F9's sections."""
    lines = []
    f5 = data["f5"]
    lines += ["## F5: One-Shot vs Catch-Up around the handoff (f5.png)", "",
              "| mode | handoff gap P50 ms | gap P99 ms | relay slot-seconds | main ITL P99 ms |",
              "|---|---|---|---|---|"]
    for mode in ("one-shot", "catch-up"):
        s = f5[mode]["summary"]
        lines.append(f"| {mode} | {fmt(s['handoff_gap_p50_ms'], 1)} | {fmt(s['handoff_gap_p99_ms'], 1)} | "
                     f"{s['relay_busy_request_s']:.0f} | {fmt(s['itl_p99_ms'], 1)} |")
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
                     f"{s['finished_at']} | {s['main_hit']:.3f} | {fmt(s['ttft_p99_s'])} |")
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
        fed_back = cut["main_hit"] < kept["main_hit"] and cut["wan_bytes"] > kept["wan_bytes"]
        lines += ["Against the default, cancelling every relay-first copy: main's DRC hit "
                  f"{compare('main_hit')}; relay slot-s {compare('relay_busy_request_s', 1, 0)}; "
                  f"WAN GB {compare('wan_bytes', 1e9, 0)}. "
                  + ("Main's hit fell and the bytes rose: the next turn of each cut session "
                     "missed at main, shipped its whole context and went to the relay again, a "
                     "mild form of F6's feedback." if fed_back else
                     "Here main's hit did not fall with more bytes, so F6's feedback did not "
                     "show at this load."), ""]
    lines += ["## F8: WAN bandwidth against hit rate, with and without DRC (f8.png)", "",
              "| prefill hit | main DRC hit | Gb/s without DRC | Gb/s with DRC | ratio |", "|---|---|---|---|---|"]
    for r in sorted(data["f8"], key=lambda r: r["prefill_hit"]):
        lines.append(f"| {r['prefill_hit']:.3f} | {r['main_hit']:.3f} | {r['without_drc_gbps']:.1f} | "
                     f"{r['with_drc_gbps']:.2f} | {r['ratio']:.1f}x |")
    near = min(data["f8"], key=lambda r: abs(r["prefill_hit"] - 0.9))
    lines += ["", f"At {100 * near['prefill_hit']:.0f}% prefill hit DRC cuts the line's bytes "
              f"{near['ratio']:.1f}x (report: up to {paper['drc_ratio_at_90']:.0f}x at 90%). "
              "Main's DRC also holds the previous turn's output, so its hit runs slightly above "
              "prefill's.", ""]
    lines += trace_section(data)
    return lines


def trace_section(data: dict) -> list:
    f9 = data["f9"]
    hit = f9[next(iter(f9))]["prefill_hit"]
    lines = [f"## F9: a Mooncake-format trace, {100 * hit:.0f}% token-weighted prefix hit at "
             "prefill, measured (f9.png)", "",
             "| setup | line | P50 s | P90 s | P99 s | WAN GB | finished at | prefill hit |",
             "|---|---|---|---|---|---|---|---|"]
    for key, s in f9.items():
        setup, line = key.split("@")
        lines.append(f"| {LABELS[setup]} | {line} | {fmt(s['ttft_p50_s'])} | "
                     f"{fmt(s['ttft_p90_s'])} | {fmt(s['ttft_p99_s'])} | "
                     f"{s['wan_bytes'] / 1e9:.0f} | {s['finished_at']} | {s['prefill_hit']:.2f} |")
    lines.append("")
    for line in sorted({key.split("@")[1] for key in f9}):
        naive, pdd = f9.get(f"cross_dc_pd@{line}"), f9.get(f"pdd@{line}")
        if naive and pdd:
            cut = 100 * (1 - pdd["ttft_p90_s"] / naive["ttft_p90_s"])
            relay = pdd["finished_at"].get("relay", 0) / max(1, sum(pdd["finished_at"].values()))
            unfinished = {name: s["requests"] - s["finished"] for name, s in
                          (("Naive cross-DC PD", naive), ("PDD", pdd)) if s["finished"] < s["requests"]}
            lines.append(f"On {line}: PDD's TTFT P90 is {cut:.1f}% below naive cross-DC PD's, and "
                         f"{100 * relay:.1f}% of PDD's requests finish at the relay."
                         + "".join(f" {n} left {count} requests unfinished when the run stopped "
                                   "(percentiles are over finished requests)."
                                   for n, count in unfinished.items()))
    lines.append("")
    return lines
