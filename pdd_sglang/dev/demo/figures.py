"""The demo's figures: ttft.png (distribution, TTFT against main's uncached suffix) and stages.png
(where each setup's TTFT goes, stage by stage, for all requests and for the slowest tenth)."""

from __future__ import annotations

from pathlib import Path

from pdd_sglang.dev.demo.report import STAGES

COLORS = {"same_dc_pd": "tab:blue", "cross_dc_pd": "tab:red", "pdd": "tab:green",
          "pdd_idle_line": "tab:olive", "pdd_congestion_aware": "tab:olive"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _ok_rows(setup: dict) -> list:
    return [r for r in setup["rows"] if r["error"] is None and r["ttft_s"] is not None]


def plot_ttft(setups: dict, line_info: dict, path: Path) -> None:
    plt = _plt()
    fig, (cdf, scatter) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, setup in setups.items():
        rows = _ok_rows(setup)
        values = sorted(r["ttft_s"] for r in rows)
        if not values:
            continue
        color = COLORS.get(name, "tab:gray")
        ys = [(i + 1) / len(values) for i in range(len(values))]
        cdf.step(values, ys, where="post", color=color, label=name)
        for q, style in ((90, ":"), (99, "--")):
            cdf.axvline(setup[f"ttft_p{q}_s"], color=color, linestyle=style, linewidth=0.8)
        scatter.scatter([r["prompt_tokens"] - (r["cached_tokens"] or 0) for r in rows],
                        [r["ttft_s"] for r in rows], s=12, color=color, label=name, alpha=0.7)
    cdf.set_xscale("log")
    cdf.set_xlabel("TTFT at the client (s, log)")
    cdf.set_ylabel("fraction of requests")
    cdf.set_title("TTFT distribution (dotted P90, dashed P99)")
    cdf.legend(loc="lower right")
    scatter.set_xlabel("tokens main decode lacked (prompt - main's cache hit)")
    scatter.set_ylabel("TTFT (s)")
    scatter.set_title("the WAN copy grows with the uncached suffix")
    scatter.legend(loc="upper left")
    fig.suptitle(f"load point: main decode behind a {line_info['rate_mbit']:g} Mbit/s line, RTT "
                 f"{line_info['rtt_ms']:g} ms +-{line_info['jitter_ms']:g} ms; KV "
                 f"{line_info['kv_bytes_per_token']} B/token")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _groups(setups: dict) -> list[tuple[str, list]]:
    """One bar per setup, and for PDD one per outcome too."""
    groups = []
    for name, setup in setups.items():
        rows = [r for r in _ok_rows(setup) if r.get("stages")]
        groups.append((name, rows))
        if name.startswith("pdd"):
            for outcome in ("handoff_one_shot", "handoff_catch_up", "relay_finished", "main"):
                chosen = [r for r in rows if r["outcome_kind"] == outcome]
                if chosen:
                    groups.append((f"{name}\n{outcome}", chosen))
    return groups


def plot_stages(setups: dict, path: Path) -> None:
    plt = _plt()
    groups = _groups(setups)
    fig, axes = plt.subplots(2, 1, figsize=(max(10, 1.2 * len(groups)), 9))
    cmap = plt.get_cmap("tab10")
    for ax, slowest in zip(axes, (False, True)):
        labels = []
        for x, (label, rows) in enumerate(groups):
            if slowest and rows:
                cut = sorted(r["ttft_s"] for r in rows)[int(0.9 * (len(rows) - 1))]
                rows = [r for r in rows if r["ttft_s"] >= cut]
            labels.append(f"{label}\n(n={len(rows)})")
            bottom = 0.0
            for i, stage in enumerate(STAGES):
                mean = sum(r["stages"][stage] for r in rows) / len(rows) if rows else 0.0
                ax.bar(x, mean, bottom=bottom, color=cmap(i), label=stage if x == 0 else None)
                bottom += mean
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_ylabel("seconds (mean per stage; the bar's height is the mean TTFT)")
        ax.set_title("slowest 10% of requests" if slowest else "all requests")
    axes[0].legend(loc="upper left", fontsize=8)
    fig.suptitle("load point: where each setup's TTFT goes")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_frontier(table: dict, path: Path) -> None:
    """frontier.png: PDD's TTFT P50 and P99 against the relay's busy share, one point per TTFT
    budget (labelled with its multiple of same-DC's P50); same-DC and naive cross-DC PD as
    reference lines (no relay)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(10, 5))
    points = sorted((p for p in table["points"] if p["relay_busy_share"] is not None),
                    key=lambda p: p["relay_busy_share"])
    for q, marker in (("p50", "o"), ("p99", "s")):
        xs = [p["relay_busy_share"] for p in points]
        ys = [p[f"ttft_{q}_s"] for p in points]
        ax.plot(xs, ys, marker=marker, color="tab:green", linestyle="-" if q == "p50" else "--",
                label=f"PDD TTFT {q.upper()}")
        if q == "p50":
            for p in points:
                ax.annotate(f"{p['budget_x']:g}x", (p["relay_busy_share"], p["ttft_p50_s"]),
                            textcoords="offset points", xytext=(4, -12), fontsize=8)
    for name, color in (("same_dc_pd", "tab:blue"), ("cross_dc_pd", "tab:red")):
        ref = table["references"].get(name)
        if not ref:
            continue
        for q, style in (("p50", "-"), ("p99", "--")):
            if ref[f"ttft_{q}_s"] is not None:
                ax.axhline(ref[f"ttft_{q}_s"], color=color, linestyle=style, linewidth=0.8,
                           label=f"{name} {q.upper()}")
    ax.set_xlabel("relay's busy share (relay decode tokens / all decode tokens)")
    ax.set_ylabel("TTFT at the client (s)")
    shares = [p["relay_busy_share"] for p in points]
    ax.set_xlim(0, max(shares + [0.1]) * 1.15)
    ax.set_title("load point: TTFT against relay capacity, one point per TTFT budget "
                 "(x same-DC P50)", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
