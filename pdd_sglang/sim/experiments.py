"""The computations behind figures F1-F9 (plots and the report live in scripts/)."""

from __future__ import annotations

import math
from dataclasses import replace

from ..policy import PolicyConfig
from .cluster import ClusterConfig, Setup, simulate
from . import operating_point as op
from .operating_point import QUANTILES
from .workload import TRACE_PATH, AgenticConfig, generate_agentic, ideal_prefix_hits, read_trace

HIT_BINS = [(0.0, 0.10), (0.10, 0.50), (0.50, 0.80), (0.80, 0.90), (0.90, 0.95),
            (0.95, 0.99), (0.99, 1.01)]
HIT_BIN_LABELS = ["<10%", "10-50%", "50-80%", "80-90%", "90-95%", "95-99%", ">=99%"]
SETUPS_F1 = (Setup.SAME_DC_PD, Setup.SAME_DC_HETERO_PD, Setup.CROSS_DC_PD,
             Setup.CROSS_DC_PD_DRC, Setup.PDD)


def ttft_reductions(ttft: dict) -> tuple:
    """PDD's TTFT cut against naive cross-DC PD, in % of cross_dc_pd, and its split by mechanism:
    drc = cross_dc_pd -> cross_dc_pd_drc, relay = cross_dc_pd_drc -> pdd (relay, handoff and
    filter on top of DRC).  The two add up to the total by construction.  ttft maps a setup's
    name to {p50, p90, p99} in seconds."""
    naive, drc, pdd = ttft["cross_dc_pd"], ttft["cross_dc_pd_drc"], ttft["pdd"]
    total = {q: 100 * (naive[q] - pdd[q]) / naive[q] for q in QUANTILES}
    by_mechanism = {"drc": {q: 100 * (naive[q] - drc[q]) / naive[q] for q in QUANTILES},
                    "relay": {q: 100 * (drc[q] - pdd[q]) / naive[q] for q in QUANTILES}}
    return total, by_mechanism


def study_point(quick: bool) -> tuple:
    """The cluster and workload of the mechanism studies (F5-F9): 2 P + 1 RLD (GPU-A), 1 MD
    (GPU-B), the 10 Gb/s line, the generator's default sessions at 3.3 req/s.  They show how a
    mechanism behaves, not the report's headline numbers (F1 has its own operating point)."""
    workload = AgenticConfig(rate_per_s=3.3, duration_s=600.0 if quick else 1800.0)
    return ClusterConfig(), workload


def f1_ttft(quick: bool, placement: str = "idle-line", setups=SETUPS_F1) -> dict:
    """Every F1 setup at the declared operating point (configs/operating_point.toml)."""
    point = op.operating_point(quick)
    requests, warmup = generate_agentic(point.workload)
    out = {}
    for setup in setups:
        summary, cluster = simulate(point.cluster(setup, placement=placement), requests, warmup)
        out[setup.value] = (summary, cluster)
    return out


def hit_bins_over_time(jobs, window_s: float) -> list:
    """Fraction of requests per prefix-hit bin (prefill's cache) in each time window."""
    windows: dict = {}
    for job in jobs:
        hit = job.prefill_cached_tokens / job.request.input_tokens
        index = next(i for i, (low, high) in enumerate(HIT_BINS) if low <= hit < high)
        counts = windows.setdefault(int(job.request.arrival_s // window_s), [0] * len(HIT_BINS))
        counts[index] += 1
    rows = []
    for key in sorted(windows):
        total = sum(windows[key])
        rows.append((key * window_s, [c / total for c in windows[key]]))
    return rows


def handoff_modes(quick: bool) -> dict:
    """F5: the same run with every handoff forced ONE_SHOT, then forced CATCH_UP."""
    cfg, workload = study_point(True)
    workload = replace(workload, duration_s=300.0 if quick else 900.0)
    requests, warmup = generate_agentic(workload)
    hits = ideal_prefix_hits(requests, warmup)
    traced = [r.request_id for r, h in zip(requests, hits) if h < 0.5 and r.output_tokens > 800]
    forced = {
        "one-shot": PolicyConfig(catch_up_threshold_tokens=10 ** 9),
        "catch-up": PolicyConfig(catch_up_threshold_tokens=0, relay_load_watermark=10.0),
    }
    out = {}
    for name, policy_cfg in forced.items():
        summary, cluster = simulate(cfg.with_(setup=Setup.PDD, policy=policy_cfg),
                                    requests, warmup, traced_ids=traced)
        tagged = [j for j in cluster.jobs if j.request.request_id in traced
                  and not math.isnan(j.handoff_gap_s) and len(j.token_times) > 50]
        out[name] = {"summary": summary, "tagged": tagged}
    common = sorted(set(j.request.request_id for j in out["one-shot"]["tagged"])
                    & set(j.request.request_id for j in out["catch-up"]["tagged"]))
    out["example_request"] = common[0] if common else None
    return out


def collapse_study(quick: bool) -> dict:
    """F6: the excluded P->RLD-only pipeline against PDD on the same cluster and workload."""
    cfg, workload = study_point(True)
    workload = replace(workload, rate_per_s=3.0, duration_s=900.0 if quick else 1800.0)
    requests, warmup = generate_agentic(workload)
    out = {}
    for setup in (Setup.PDD, Setup.RELAY_ONLY):
        summary, cluster = simulate(cfg.with_(setup=setup), requests, warmup)
        out[setup.value] = {"summary": summary, "collapsed": detect_collapse(cluster),
                            "quarters": quarter_stats(cluster)}
    return out


def quarter_stats(cluster) -> list:
    jobs = sorted(cluster.jobs, key=lambda j: j.request.arrival_s)
    size = max(1, len(jobs) // 4)
    rows = []
    for i in range(4):
        part = jobs[i * size:(i + 1) * size]
        done = sorted(j.ttft_s for j in part if j.completions)
        rows.append({"relay_share": sum(j.relay is not None and not j.relay_abandoned
                                        for j in part) / len(part),
                     "ttft_p50_s": done[len(done) // 2] if done else math.inf,
                     "unfinished": sum(1 for j in part if not j.completions)})
    return rows


def detect_collapse(cluster) -> bool:
    """Collapsed: the relay's admission queue at the last arrival exceeds its slot count and
    keeps the last quarter's median TTFT at least 10x the first quarter's."""
    if not cluster.relays:
        return False
    at_end = [row for row in cluster.timeline if row[0] <= cluster.last_arrival_s]
    backlog = at_end[-1][1] if at_end else 0
    quarters = quarter_stats(cluster)
    slots = sum(r.max_running for r in cluster.relays)
    return backlog > slots and quarters[3]["ttft_p50_s"] >= 10 * quarters[0]["ttft_p50_s"]


# Cancels main's copy whenever the relay answers first, whatever the request: serving's rule
# before policy.cancel_wan_copy, kept in F7 to show what the singular thresholds prevent.
CANCEL_EVERY_RELAY_FIRST_COPY = PolicyConfig(singular_min_uncached_tokens=0,
                                             singular_max_new_tokens=2 ** 31)


def singular_filter_study(quick: bool) -> dict:
    """F7: no filter (the relay holds each request until main is aligned), the reactive filter
    (default: relay-first finishes drop the handoff, only singular copies are cancelled),
    reactive plus predictive, and cancelling every relay-first copy."""
    cfg, workload = study_point(True)
    workload = replace(workload, duration_s=600.0 if quick else 1800.0)
    requests, warmup = generate_agentic(workload)
    variants = {
        "off": PolicyConfig(singular_reactive=False),
        "reactive": PolicyConfig(),
        "reactive+predictive": PolicyConfig(singular_predictive=True),
        "cancel-all": CANCEL_EVERY_RELAY_FIRST_COPY,
    }
    return {name: simulate(cfg.with_(setup=Setup.PDD, policy=p), requests, warmup)[0]
            for name, p in variants.items()}


def drc_sweep(quick: bool) -> list:
    """F8: WAN bytes of cross-DC PD with and without DRC across hit rates.

    Without DRC every prompt crosses whole, so its bytes are the prompt sizes; with DRC
    (cross_dc_pd_drc) they are what the simulated link carried."""
    cfg, workload = study_point(True)
    workload = replace(workload, rate_per_s=2.0, duration_s=300.0 if quick else 900.0)
    shapes = [dict(turns_min=1, turns_max=3, big_delta_probability=0.9),
              dict(turns_min=3, turns_max=8, big_delta_probability=0.6),
              dict(turns_min=6, turns_max=15, big_delta_probability=0.4),
              dict(turns_min=10, turns_max=30, big_delta_probability=0.3),
              dict(),
              dict(turns_min=30, turns_max=60, big_delta_probability=0.03, singular_fraction=0.01)]
    rows = []
    for shape in shapes:
        requests, warmup = generate_agentic(replace(workload, **shape))
        summary, _ = simulate(cfg.with_(setup=Setup.CROSS_DC_PD_DRC, wan_link="wan_100g"),
                              requests, warmup)
        seconds = max(summary.duration_s, 1.0)
        rows.append({"prefill_hit": summary.prefill_hit, "main_hit": summary.main_hit,
                     "with_drc_gbps": summary.wan_bytes * 8 / seconds / 1e9,
                     "without_drc_gbps": summary.wan_bytes_without_drc * 8 / seconds / 1e9,
                     "ratio": summary.wan_bytes_without_drc / max(summary.wan_bytes, 1.0)})
    return rows


def trace_study(quick: bool, trace_path=None, progress=None) -> dict:
    """F9: a Mooncake-format trace (default: the public conversation trace) on the F1 cluster,
    10 and 100 Gb/s lines.  Its hit rate is measured by the run, not assumed."""
    requests = read_trace(trace_path or TRACE_PATH, max_duration_s=600.0 if quick else None)
    if not requests:
        raise ValueError(f"{trace_path}: no requests")
    cfg, _ = study_point(True)
    out = {}
    for line in ("wan_10g", "wan_100g"):
        for setup in SETUPS_F1:
            summary, _ = simulate(cfg.with_(setup=setup, wan_link=line), requests,
                                  progress=progress)
            out[f"{setup.value}@{line}"] = summary
    return out
