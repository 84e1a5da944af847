"""Draw F1-F9 from the data reproduce_figures.py computed (matplotlib, imported lazily)."""

from __future__ import annotations

from pathlib import Path

from .cluster import Setup
from .experiments import HIT_BIN_LABELS


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(fig, out: Path, name: str) -> None:
    fig.tight_layout()
    fig.savefig(out / name, dpi=110)
    _plt().close(fig)


def draw_all(out: Path, data: dict, results: dict, paper: dict, measured) -> None:
    plt = _plt()
    names = list(results["ttft_s"])
    labels = {s.value: s.label for s in Setup}

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.25
    for i, q in enumerate(("p50", "p90", "p99")):
        left.bar([x + i * width for x in range(len(names))],
                 [results["ttft_s"][n][q] for n in names], width, label=f"TTFT {q.upper()}")
    starred = False
    for x, name in enumerate(names):
        for q, value in paper["ttft_s"].get(name, {}).items():
            left.plot(x + ("p50", "p90", "p99").index(q) * width, value, "k*", ms=9,
                      label=None if starred else "report")
            starred = True
    left.set_xticks([x + width for x in range(len(names))],
                    [_wrap(labels[n]) for n in names], fontsize=8)
    left.set_ylabel("TTFT (s)")
    left.set_yscale("log")
    left.set_title("F1: TTFT at the operating point")
    left.legend()
    for name, rows in data["sweep"]["line"].items():
        right.plot([r[0] for r in rows], [r[2] for r in rows], "o-",
                   label=f"{labels[name]}, TTFT P90")
    right.axvline(results["operating_point"]["line_gbps"], color="grey", ls=":",
                  label="operating point")
    right.set_xlabel("line rate (Gb/s)")
    right.set_ylabel("TTFT P90 (s)")
    right.set_xscale("log")
    right.set_yscale("log")
    right.set_title("TTFT P90 against line rate")
    right.legend(fontsize=7)
    _save(fig, out, "f1.png")

    fig, ax = plt.subplots(figsize=(8, 4))
    rows = data["f1"]["hit_bins"]
    times = [r[0] / 60 for r in rows]
    stacks = list(zip(*[r[1] for r in rows]))
    ax.stackplot(times, stacks, labels=HIT_BIN_LABELS)
    ax.set_xlabel("minute")
    ax.set_ylabel("share of requests")
    ax.set_title("F2: prefix-hit distribution over time (prefill cache), agentic workload")
    ax.legend(loc="center left", bbox_to_anchor=(1, 0.5))
    _save(fig, out, "f2.png")

    fig, ax = plt.subplots(figsize=(8, 4))
    kinds = ["kv", "token_ids"]
    sim = data["f3"]
    ax.bar([0, 1], [sim[k]["mean_ms"] for k in kinds], 0.35, yerr=[sim[k]["std_ms"] for k in kinds],
           label="simulated mean ± std")
    ax.plot([0, 1], [sim[k]["max_ms"] for k in kinds], "rv", label="simulated max")
    ax.bar([0.4, 1.4], [paper["handoff"][k]["mean_ms"] for k in kinds], 0.35, label="report mean")
    ax.plot([0.4, 1.4], [paper["handoff"][k]["max_ms"] for k in kinds], "k^", label="report max")
    if measured:
        ax.plot([0.2, 1.2], [measured[k]["mean_ms"] for k in kinds], "gs", ms=10, label="measured mean")
    ax.set_xticks([0.2, 1.2], [f"incremental KV ({sim['kv']['payload_bytes'] / 1e6:.1f} MB)",
                               f"token ids + recompute ({sim['token_ids']['payload_bytes'] / 1e3:.1f} KB)"])
    ax.set_ylabel("latency (ms)")
    ax.set_title("F3: handing over 100 tokens")
    ax.legend()
    _save(fig, out, "f3.png")

    fig, ax = plt.subplots(figsize=(8, 4))
    f4 = data["f4"]
    rows = [(labels[r["setup"]] + "\n" + _layout(r), r["bcr_requests_per_dollar"])
            for key in ("baseline", "hetero", "pdd") for r in f4.get(key, [])[:1]]
    ax.bar([r[0] for r in rows], [r[1] for r in rows])
    ax.set_ylabel("BCR (requests per dollar within SLA)")
    gains = [results["bcr"]["gain_pct"], results["bcr"].get("gain_vs_hetero_pct")]
    shown = ["n/a" if g is None else f"{g:+.1f}%" for g in gains]
    ax.set_title(f"F4: BCR of PDD vs same-DC PD {shown[0]}, vs same-DC with GPU-B decode "
                 f"{shown[1]} (report +{paper['bcr_gain_pct']}%)", fontsize=10)
    ax.tick_params(axis="x", labelsize=8)
    _save(fig, out, "f4.png")

    fig, ax = plt.subplots(figsize=(9, 4))
    for mode in ("one-shot", "catch-up"):
        times = data["f5"][mode]["token_times"]
        gaps = [1000 * (b - a) for a, b in zip(times, times[1:])]
        ax.plot(range(2, len(gaps) + 2), gaps, label=f"{mode} (handed {data['f5'][mode]['handed_tokens']})")
    ax.set_xlabel("output token index")
    ax.set_ylabel("inter-token latency at the router (ms)")
    ax.set_yscale("log")
    ax.set_title(f"F5: ITL around the handoff, request {data['f5']['example_request']}")
    ax.legend()
    _save(fig, out, "f5.png")

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for name in ("pdd", "prld_only"):
        timeline = data["f6"][name]["timeline"]
        top.plot([r[0] for r in timeline], [r[1] for r in timeline], label=f"{labels[name]}: requests waiting for the relay")
        bottom.plot([r[0] for r in timeline], [r[3] for r in timeline], label=f"{labels[name]}: relay utilisation")
    top.set_ylabel("requests waiting")
    top.legend()
    bottom.set_ylabel("utilisation")
    bottom.set_xlabel("time (s)")
    top.set_title("F6: P->RLD-only collapses, PDD stays stable")
    bottom.legend()
    _save(fig, out, "f6.png")

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    variants = list(data["f7"])
    left.bar(variants, [data["f7"][v]["wan_bytes"] / 1e9 for v in variants])
    left.set_ylabel("WAN GB")
    right.bar(variants, [data["f7"][v]["relay_busy_request_s"] for v in variants])
    right.set_ylabel("relay slot-seconds")
    left.set_title("F7: singular filter, WAN bytes")
    right.set_title("relay load")
    for axis in (left, right):
        axis.tick_params(axis="x", labelrotation=20)
    _save(fig, out, "f7.png")

    fig, ax = plt.subplots(figsize=(8, 4))
    rows = sorted(data["f8"], key=lambda r: r["prefill_hit"])
    hits = [100 * r["prefill_hit"] for r in rows]
    ax.plot(hits, [r["without_drc_gbps"] for r in rows], "o-", label="without DRC")
    ax.plot(hits, [r["with_drc_gbps"] for r in rows], "o-", label="with DRC")
    ax.set_yscale("log")
    ax.set_xlabel("token-weighted prefix hit (%)")
    ax.set_ylabel("mean WAN Gb/s")
    ax.set_title("F8: WAN bandwidth needed against hit rate")
    ax.legend()
    _save(fig, out, "f8.png")

    fig, ax = plt.subplots(figsize=(15, 4.8))
    keys = list(data["f9"])
    for i, q in enumerate(("p50", "p90", "p99")):
        ax.bar([x + i * 0.25 for x in range(len(keys))], [data["f9"][k][f"ttft_{q}_s"] for k in keys],
               0.25, label=f"TTFT {q.upper()}")
    ax.set_xticks([x + 0.25 for x in range(len(keys))],
                  [_wrap(labels[k.split("@")[0]]) + "\n@ " + k.split("@")[1] for k in keys],
                  fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("TTFT (s)")
    hit = data["f9"][keys[0]]["prefill_hit"]
    ax.set_title(f"F9: {results.get('trace_file', 'trace')}, {100 * hit:.0f}% prefix hit (measured)")
    ax.legend()
    _save(fig, out, "f9.png")


def _wrap(label: str) -> str:
    """A setup's label over lines short enough to sit under one bar group."""
    return label.replace(" (", "\n(").replace(", ", ",\n").replace(" + ", "\n+ ")


def _layout(result: dict) -> str:
    gpus = ", ".join(f"{n} {k}" for k, n in sorted(result["gpus"].items()))
    return gpus
