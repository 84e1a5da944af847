"""The current result of each bench, in ``docs/results/``, and the docs rendered from them.

A bench script run with ``--publish`` writes its result as ``docs/results/<name>.json``
(overwriting the one before: git keeps the past), stamped with the date and the machine, and
renders the docs again. ``scripts/render_results.py`` renders them alone; ``--check`` says whether
the docs agree with the files, as ``tests/unit/test_results_docs.py`` does. What is rendered: the
README's results table (one line per area) and the tables of ``docs/results.md``, each between
the markers below, so that no figure in them is typed by hand. The goals beside the figures are
the issues' goals, kept here with the code that compares them.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "docs" / "results"
README = REPO / "README.md"
PAGE = REPO / "docs" / "results.md"
BEGIN = "<!-- results: rendered by scripts/render_results.py from docs/results/; do not edit -->"
END = "<!-- results: end -->"

# The issues' goals that the JSON files do not carry.
RELAY_DEATH_SLACK_S = 2.0     # a fault's recovery: the line floor of one request's copy + this
WAN_LINE_FILL_GOAL = 0.9      # one packed copy fills this share of the line at every point
ROUTER_X, ROUTER_TTFT_MIN_MS = 1.5, 100.0   # added TTFT P99 at 256 streams: 1.5x sglang-router's
ROUTER_ITL_MS = 10.0          # added ITL P99 at 256 streams (or 1.5x sglang-router's, if more)
ROUTER_CPU_MS = {"p_md": 2.0, "p_rld_md": 2.5}   # CPU per request at saturation
CODEC_GPU_LINE_GB_S = 12.5    # a 100 Gbit/s line, in bytes of KV per second


def add_publish_flag(parser) -> None:
    parser.add_argument("--publish", action="store_true",
                        help="also write this run as the current result in docs/results/ and "
                             "render the README's and docs/results.md's tables from it")


def machine() -> str:
    """The stamp's machine: CPU cores and the GPU, if ``nvidia-smi`` names one."""
    gpus = []
    if shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, check=False).stdout
        gpus = [line.strip() for line in out.splitlines() if line.strip()]
    gpu = f"{len(gpus)}x {gpus[0]}" if gpus else "no GPU"
    return f"{os.cpu_count()} cores, {gpu}"


def publish(name: str, report: dict, files: Optional[dict] = None) -> Path:
    """Write ``report`` as ``docs/results/<name>.json`` (and ``files``: {name in docs/results/:
    source path}), then render the docs from the results. A report the docs cannot be rendered
    from (a run without what its area reads) is refused, and the current file kept."""
    stamped = {**report, "run": {"date": datetime.datetime.now(datetime.timezone.utc)
                                 .strftime("%Y-%m-%d"), "machine": machine()}}
    path = RESULTS / f"{name}.json"
    before = path.read_bytes() if path.exists() else None
    path.write_text(json.dumps(stamped, indent=2) + "\n")
    try:
        areas()
    except (KeyError, TypeError, ValueError, IndexError) as err:
        if before is None:
            path.unlink()
        else:
            path.write_bytes(before)
        raise ValueError(f"{path.relative_to(REPO)}: not published, the docs cannot be rendered "
                         f"from this run ({type(err).__name__}: {err}); the current one is kept")
    for target, source in (files or {}).items():
        if Path(source).exists():
            shutil.copyfile(source, RESULTS / target)
        else:
            print(f"publish: {source} is missing; docs/results/{target} left as it was")
    changed = render(write=True)
    print(f"published {path.relative_to(REPO)}; rendered {', '.join(changed) or 'no change'}")
    return path


# --- one area per file -------------------------------------------------------------------------

@dataclass
class Area:
    """One row of the README's table and one section of docs/results.md."""
    name: str
    file: str
    script: str
    method: str          # the heading of its method in docs/measurements.md
    ran: str
    on: str
    figure: str
    goal: str
    date: str
    detail: list = field(default_factory=list)   # the results page's table, as lines


def _x(value) -> str:
    return "-" if value is None else f"x{value:.2f}"


def _pct(value) -> str:
    return "-" if value is None else f"{100 * value:.0f} %"


def _line(line: dict) -> str:
    return f"{line['rate_mbit']:g} Mbit/s x {line['rtt_ms']:g} ms"


def _date(report: dict) -> str:
    return report.get("run", {}).get("date") or str(report.get("date", "-"))[:10]


def _machine(report: dict) -> str:
    return report.get("run", {}).get("machine", "unknown machine")


def _verdict(misses: list) -> str:
    return "**met**" if not misses else "**missed**: " + ", ".join(misses)


def _table(header: list, rows: list) -> list:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(str(c) for c in row) + " |" for row in rows)]


def _demo_on(d: dict) -> str:
    return f"{_machine(d)}; tiny Llama, CPU engine; {_line(d['line'])}"


DEMO_CHECKS = {"pdd_p50": "PDD's P50", "pdd_p99": "PDD's P99", "cross_dc_p99": "naive's P99",
               "handoffs": "handoffs", "no_errors": "errors", "no_leaks": "leaks",
               "idle_line_p_to_md_wait": "idle-line P->MD wait"}


def _setup_rows(setups: dict) -> list:
    return [[name, f"{s['ttft_p50_s']:.3f}", f"{s['ttft_p90_s']:.3f}", f"{s['ttft_p99_s']:.3f}",
             f"{s['itl_p50_ms']:.1f}", f"{s.get('wan_bytes', 0) / 1e6:.1f}",
             _pct(s.get("relay_busy_share")), s["requests"], s["errors"]]
            for name, s in setups.items()]


SETUP_HEADER = ["setup", "TTFT P50 s", "P90 s", "P99 s", "ITL P50 ms", "WAN MB",
                "relay's share of decode", "requests", "errors"]


STAGES = ("router_to_prefill", "registration_wait", "prefill_queue", "prefill_forward",
          "kv_and_first_token", "router_to_client")


def _excess(bar: dict) -> list:
    """Where PDD's TTFT went beyond same-DC's, by stage: percentiles, and the same requests
    paired (the means add up to the TTFT's)."""
    by_stage, paired = bar.get("pdd_excess_by_stage"), bar.get("pdd_excess_paired")
    if not by_stage or not paired:
        return []
    rows = [[stage, f"{by_stage.get(stage, {}).get('p50_s', 0):+.3f}",
             f"{by_stage.get(stage, {}).get('p99_s', 0):+.3f}",
             f"{paired['stage_diff_mean_s'].get(stage, 0):+.3f}"] for stage in STAGES]
    return ["", f"PDD less same-DC PD at the load point, s ({paired['pairs']} requests paired: TTFT "
            f"{paired['ttft_diff_p50_s']:+.3f} at the median, {paired['ttft_diff_mean_s']:+.3f} on "
            "average):", "", *_table(["stage", "P50", "P99", "paired mean"], rows)]


def demo_area(d: dict) -> Area:
    bar, w = d["bar"], d["workload"]
    misses = [label for key, label in DEMO_CHECKS.items() if bar["checks"].get(key) is False]
    figure = (f"PDD's TTFT P50 {_x(bar['pdd_over_same_dc_p50'])}, P99 "
              f"{_x(bar['pdd_over_same_dc_p99'])} of same-DC PD's; naive cross-DC's P99 "
              f"{_x(bar['cross_dc_over_same_dc_p99'])}; handoffs {_pct(bar['pdd_handoff_share'])}; "
              f"idle-line P->MD wait over copy P90 "
              f"{_x(bar.get('idle_line_p_to_md_wait_over_alone_p90'))}")
    goal = (f"PDD <= {_x(bar['pdd_bound'])} (P50, P99), naive >= {_x(bar['cross_dc_bound'])}, "
            f"handoffs >= {_pct(bar['handoff_share_bound'])}, idle-line wait <= "
            f"{_x(bar.get('idle_line_wait_bound'))}, no error or leak: " + _verdict(misses))
    m = d["model"]
    ran = (f"`make demo`: the tiny Llama ({m['num_hidden_layers']} layers, {m['dtype']}); "
           f"{w['conversations']} agentic conversations of {w['turns']} turns, "
           f"{w['concurrency']} at a time ({w['requests_per_setup']} requests a setup), through "
           f"same-DC PD, naive cross-DC PD and PDD (by a TTFT budget of "
           f"{_x(d['ttft_budget']['slo_x_of_same_dc_p50'])} same-DC's P50), each SGLang server "
           f"under a quota of {d['cpu_budget']['server_cores']:g} core")
    detail = ["Load point:", "", *_table(SETUP_HEADER, _setup_rows(d["setups"])), "",
              "Latency point (one conversation at a time):", "",
              *_table(SETUP_HEADER, _setup_rows(d["latency_setups"])), *_excess(bar)]
    return Area("TTFT against same-datacenter PD", "demo.json", "scripts/demo.py",
                "The demo (`make demo`)", ran, _demo_on(d), figure, goal, _date(d), detail)


LABELS = {"ttft_p50_s": "TTFT P50", "ttft_p90_s": "TTFT P90", "ttft_p99_s": "TTFT P99",
          "itl_p50_ms": "ITL P50", "wan_bytes": "WAN bytes"}


def validation_area(v: dict) -> Area:
    from pdd_sglang.sim.validation import BANDS
    bound = [(setup, q, r) for setup, ratios in v["load"].items()
             for q, r in ratios.items() if q in BANDS]
    met = [(s, q) for s, q, r in bound if BANDS[q][0] <= r <= BANDS[q][1]]
    missed = [f"{s}'s {LABELS.get(q, q)} {r:.2f}" for s, q, r in bound if (s, q) not in met]
    grouped: dict = {}
    for q, band in BANDS.items():
        grouped.setdefault(band, []).append(LABELS.get(q, q))
    bands = ", ".join(f"{' / '.join(qs)} within {lo:g}-{hi:g}" for (lo, hi), qs in grouped.items())
    quantities = [q for q in LABELS if any(q in ratios for ratios in v["load"].values())]
    detail = []
    for point in ("latency", "load"):
        rows = [[s, *(f"{r[q]:.2f}" if q in r else "-" for q in quantities)]
                for s, r in v[point].items()]
        detail += [f"{point.capitalize()} point, simulated over measured:", "",
                   *_table(["setup", *(LABELS.get(q, q) for q in quantities)], rows), ""]
    on = f"the simulator, CPU profiles of configs/; the demo's {_line(v['line'])}"
    return Area("The simulator against the demo", "validation.json", "scripts/validate_sim.py",
                "The simulator against the demo (`scripts/validate_sim.py`)",
                "the demo's setups simulated, fitted at its latency point, its load point "
                "predicted", on, f"{len(met)} of {len(bound)} load-point goals met",
                f"simulated over measured: {bands}: " + _verdict(missed), _date(v),
                detail[:-1])


def faults_area(f: dict) -> Area:
    rows, misses = [], []
    for name, r in f["faults"].items():
        floor = r.get("line_floor_s")
        goal_s = None if floor is None else floor + RELAY_DEATH_SLACK_S
        late = goal_s is not None and r["recovery_s"] is not None and r["recovery_s"] > goal_s
        if r["lost"] or r["leaked_slots"] or r["errored"] or late:
            misses.append(name)
        rows.append([name, r["sent"], r["completed"], r["errored"], r["lost"], r["leaked_slots"],
                     r["recovery_s"], "-" if goal_s is None else f"{goal_s:.2f}"])
    figure = "; ".join(f"{row[0]}: {row[4]} lost of {row[1]}, recovery {row[6]} s"
                       for row in rows)
    return Area("Faults", "faults.json", "scripts/fault_suite.py",
                "The fault suite (`scripts/fault_suite.py`)",
                f"steady load through the router while {', '.join(f['faults'])} strikes",
                f"{_machine(f)}; tiny model, CPU engine; {_line(f['line'])}", figure,
                f"nothing lost or leaked; recovery <= one request's copy alone + "
                f"{RELAY_DEATH_SLACK_S:g} s: " + _verdict(misses), _date(f),
                [*_table(["fault", "sent", "completed", "errored", "lost", "leaked slots",
                          "recovery s", "goal s"], rows), *_first_after(f)])


def _first_after(f: dict) -> list:
    """What the first request after each fault went through, and what was ahead on the line."""
    rows = [[name, first.get("outcome"), first.get("ttft_s"),
             f"{first.get('needed_now_bytes_ahead_at_send', 0) / 1e6:.1f}",
             f"{first.get('cache_only_bytes_ahead_at_send', 0) / 1e6:.1f}"]
            for name, r in f["faults"].items() if (first := r.get("first_request_after"))]
    return ["", "The first request after each fault:", "",
            *_table(["fault", "ended", "TTFT s", "needed-now MB ahead", "cache-only MB ahead"],
                    rows)] if rows else []


def soak_area(s: dict) -> Area:
    leaks = sum(v for key in ("leaked_slots", "leaked_locks", "leaked_rooms")
                for v in s[key].values())
    misses = [k for k in ("lost", "token_mismatches", "digest_mismatches") if s[k]]
    misses += ["leaks"] if leaks else []
    misses += ["dead threads"] if s["dead_threads"] else []
    figure = (f"{s['requests']} requests, {sum(s['faults'].values())} faults of "
              f"{len(s['faults'])} kinds: {s['lost']} lost, {s['errored']} errored, "
              f"{s['token_mismatches']} token and {s['digest_mismatches']} digest mismatches, "
              f"{leaks} leaked, {len(s['dead_threads'])} dead threads; handoffs "
              f"{_pct(s['handoff_share'])}")
    rows = [[k, n, ", ".join(str(t) for t in s["recovery_s"].get(k, []))]
            for k, n in s["faults"].items()]
    return Area("Chaos soak", "soak.json", "scripts/fault_suite.py --soak",
                "The chaos soak (`scripts/fault_suite.py --soak`)",
                f"{s['minutes']:g} minutes of multi-turn load, seeded random faults one at a time, "
                f"every answer checked token for token against plain SGLang",
                f"{_machine(s)}; tiny model, CPU engine; {_line(s['line'])}", figure,
                "nothing lost, no mismatch, leak or dead thread: " + _verdict(misses), _date(s),
                [*_table(["fault", "times", "recovery s"], rows), "",
                 "How the requests ended: " + ", ".join(
                     f"{n} {k.replace('_', ' ')}" for k, n in s["completed_by_outcome"].items()) + "."])


def wan_line_area(w: dict) -> Area:
    points = w["points"]
    lines = sorted({(p["rate_mbit"], p["rtt_ms"]) for p in points})
    rules = sorted({p["rule"] for p in points})
    one = {(p["rate_mbit"], p["rtt_ms"]): p["utilization"] for p in points
           if p["rule"] == p["product_rule"] and p["concurrent"] == 1}
    misses = [f"{r:g} Mbit/s x {t:g} ms" for (r, t), u in sorted(one.items())
              if u < WAN_LINE_FILL_GOAL]
    rows = []
    for rate, rtt in lines:
        cell = {(p["rule"], p["concurrent"]): p["utilization"] for p in points
                if (p["rate_mbit"], p["rtt_ms"]) == (rate, rtt)}
        rows.append([f"{rate:g} Mbit/s x {rtt:g} ms",
                     *(" / ".join(f"{cell[(rule, n)]:.2f}" for n in (1, 4) if (rule, n) in cell)
                       for rule in rules)])
    product = points[0]["product_rule"]
    figure = (f"one {product} copy fills {min(one.values()):.2f}-{max(one.values()):.2f} of the "
              f"line at {len(one)} points")
    return Area("WAN line fill", "wan_line_bench.json", "scripts/bench_wan_line.py",
                "The WAN line bench (`scripts/bench_wan_line.py`)",
                f"a {points[0]['copy_bytes'] / 2**20:g} MiB copy of {w['kv_buffers']} KV buffers "
                f"over Mooncake TCP, one copy and four at once, by each rule",
                f"{_machine(w)}; no model; {lines[0][0]:g}-{lines[-1][0]:g} Mbit/s x "
                f"{min(t for _, t in lines):g}-{max(t for _, t in lines):g} ms", figure,
                f"one copy fills {WAN_LINE_FILL_GOAL:g} of the line at every point: "
                + _verdict(misses), _date(w),
                ["Share of the line filled, one copy / four at once, by rule "
                 f"(the product's: `{product}`):", "", *_table(["line", *rules], rows)])


def codec_area(c: dict) -> Area:
    codecs = {x["codec"]: x for x in c["codecs"]}
    lossless = codecs.get("lossless", {})
    misses = [] if lossless.get("bit_exact") and lossless.get("ratio", 0) > 1 else ["lossless"]
    rows = [[x["codec"], f"{x['ratio']:.2f}", f"{x['compress_mb_s']:,.0f}",
             f"{x['decompress_mb_s']:,.0f}", f"{x['token_agreement']:.3f}"] for x in c["codecs"]]
    copies = {}
    for p in c["copy"]["points"]:
        copies.setdefault(p["codec"], []).append(f"{p['copy_s']:.2f}")
    rates = " / ".join(f"{r:g}" for r in sorted({p["rate_mbit"] for p in c["copy"]["points"]}))
    for row in rows:
        row.append(" / ".join(copies.get(row[0], [])))
    demo = c["demo"]
    return Area("WAN KV codecs (CPU)", "wan_codec_bench.json", "scripts/bench_wan_codec.py",
                "WAN KV codecs (`scripts/bench_wan_codec.py`)",
                "each codec on the tiny model's KV (demo and test prompts); a copy over the "
                "emulated line; the quick demo with the codec on and off",
                f"{_machine(c)}; the tiny model's KV; {rates} Mbit/s x "
                f"{c['copy']['points'][0]['rtt_ms']:g} ms",
                f"lossless x{lossless.get('ratio', 0):.2f} on the wire, bit-exact; the quick demo's "
                f"WAN bytes {demo['on']['wan_bytes'] / 1e6:.1f} MB on against "
                f"{demo['off']['wan_bytes'] / 1e6:.1f} MB off",
                "lossless is bit-exact and smaller than raw: " + _verdict(misses), _date(c),
                [*_table(["codec", "ratio", "compress MB/s a core", "decompress MB/s a core",
                          "greedy token agreement", f"copy s at {rates} Mbit/s"], rows), "",
                 _sentence(c["caveat"]) + "."])


def codec_gpu_area(g: dict) -> Area:
    top = max(g["sizes"], key=lambda s: s["size_bytes"])
    slow = min(top["fp8_encode_gb_s"], top["planes_split_gb_s"])
    keys = ("fp8_encode_gb_s", "fp8_decode_gb_s", "planes_split_gb_s", "planes_merge_gb_s",
            "d2h_pinned_gb_s")
    rows = [[f"{s['size_bytes'] / 2**20:g}", *(f"{s[k]:.1f}" for k in keys)] for s in g["sizes"]]
    return Area("WAN KV codecs on a GPU", "codec_gpu.json", "scripts/gpu/codec_gpu.py",
                "WAN KV codecs on a GPU (`scripts/gpu/codec_gpu.py`)",
                "FP8 and the lossless byte planes' transform in torch, copies of several sizes; "
                + g["kv"],
                f"1x {g['device']}; synthetic bf16 KV", f"at {top['size_bytes'] / 2**20:g} MiB: FP8 encode "
                f"{top['fp8_encode_gb_s']:.0f} GB/s, byte planes {top['planes_split_gb_s']:.0f} GB/s",
                f"keep up with a 100 Gbit/s line ({CODEC_GPU_LINE_GB_S:g} GB/s): "
                + _verdict([] if slow >= CODEC_GPU_LINE_GB_S else ["slower"]), _date(g),
                _table(["MiB", "FP8 encode GB/s", "FP8 decode GB/s", "planes split GB/s",
                        "planes merge GB/s", "device->host GB/s"], rows))


def _router_runs(r: dict, kind: str, concurrency: int) -> dict:
    return {run["mode"]: run for run in r["runs"]
            if run["kind"] == kind and run["concurrency"] == concurrency}


def router_area(r: dict) -> Area:
    s = r["settings"]
    load, sat = _router_runs(r, "load", 256), _router_runs(r, "saturation", 1024)
    base = load["pd"]
    ttft_goal = max(ROUTER_X * base["added_ttft_p99_ms"], ROUTER_TTFT_MIN_MS)
    itl_goal = max(ROUTER_X * base["added_itl_p99_ms"], ROUTER_ITL_MS)
    misses = []
    for mode in ("p_md", "p_rld_md"):
        if load[mode]["added_ttft_p99_ms"] > ttft_goal:
            misses.append(f"{mode} TTFT")
        if load[mode]["added_itl_p99_ms"] > itl_goal:
            misses.append(f"{mode} ITL")
        if sat[mode]["cpu_ms_per_request"] > ROUTER_CPU_MS[mode]:
            misses.append(f"{mode} CPU")
    figure = ("at 256 streams added TTFT P99 " + " / ".join(
        f"{load[m]['added_ttft_p99_ms']:.0f}" for m in ("p_md", "p_rld_md", "pd"))
        + " ms, ITL P99 " + " / ".join(f"{load[m]['added_itl_p99_ms']:.1f}"
                                       for m in ("p_md", "p_rld_md", "pd"))
        + " ms (P->MD / P->RLD->MD / sglang-router); CPU a request at saturation "
        + " / ".join(f"{sat[m]['cpu_ms_per_request']:.3f}" for m in ("p_md", "p_rld_md", "pd"))
        + " ms")
    goal = (f"TTFT within {ttft_goal:.0f} ms, ITL within {itl_goal:.0f} ms, CPU within "
            + " / ".join(f"{v:g}" for v in ROUTER_CPU_MS.values()) + " ms: " + _verdict(misses))
    rows = [[run["kind"], run["concurrency"], run["answer_tokens"], run["router"], run["mode"],
             run["added_ttft_p99_ms"], run["added_itl_p99_ms"], run["rps"],
             run["cpu_ms_per_request"], run["repeats"]] for run in r["runs"]]
    return Area("The router against sglang-router", "router_bench.json", "scripts/bench_router.py",
                "The router against sglang-router (`scripts/bench_router.py`)",
                f"closed-loop streams through each router to scripted servers, "
                f"{s['prompt_tokens']}-token prompts, {s['answer_tokens']}-token answers at "
                f"{s['token_rate']:g} tokens/s, one worker; 256 streams and "
                f"saturation medians of {s['repeats']}",
                f"{_machine(r)}; scripted servers; {s['router_cores']:g} core a router; no WAN",
                figure, goal, _date(r),
                _table(["run", "streams", "answer tokens", "router", "mode", "+TTFT P99 ms",
                        "+ITL P99 ms", "req/s", "CPU ms a request", "repeats"], rows))


def tp_area(t: dict) -> Area:
    failed = [x["combination"] for x in t["results"] if x["result"] != "PASS"]
    digest = sum(x.get("kv_digest", {}).get("mismatched", 0) for x in t["results"])
    rows = [[x["combination"], x["result"], x.get("router_p_md", "-"),
             x.get("next_turn_main_hit", "-"), json.dumps(x.get("kv_digest", {})),
             x.get("seconds", "-")] for x in t["results"]]
    return Area("Mixed TP", "tp_matrix.json", "scripts/tp_matrix.py",
                "Mixed TP (`scripts/tp_matrix.py`)",
                "prefill, relay and main at every combination of TP 1 and 2, against plain "
                f"SGLang at TP {t['reference_tp']}",
                f"{_machine(t)}; tiny model, CPU engine; no WAN",
                f"{len(t['results']) - len(failed)} of {len(t['results'])} combinations "
                f"token-exact; KV digest mismatches {digest}",
                "every combination token-exact: " + _verdict(failed), _date(t),
                _table(["combination", "result", "P->MD", "next turn's hit at main", "KV digest",
                        "s"], rows))


def frontier_area(f: dict) -> Area:
    points = f["frontier"]["points"]
    rows = [[p["setup"], f"{p['budget_x']:g}", f"{p['ttft_p50_s']:.3f}", f"{p['ttft_p99_s']:.3f}",
             _x(p["p50_over_same_dc"]), _x(p["p99_over_same_dc"]), _pct(p["relay_busy_share"]),
             _pct(p["within_budget_share"])] for p in points]
    span = f"{points[0]['budget_x']:g}x-{points[-1]['budget_x']:g}x"
    return Area("The TTFT budget's frontier", "frontier.json", "scripts/demo.py --frontier",
                "The frontier (`scripts/demo.py --frontier`)",
                f"the demo's load point, PDD at TTFT budgets of {span} same-DC PD's P50",
                _demo_on(f), f"at budgets of {span}: TTFT P50 {_span(points, 'p50_over_same_dc')} "
                f"of same-DC's, the relay's share of decode "
                f"{_span(points, 'relay_busy_share', _pct)}",
                "none of its own (the demo's bar is checked at 1.15x)", _date(f),
                [*_table(["setup", "budget x", "TTFT P50 s", "P99 s", "P50 over same-DC",
                          "P99 over same-DC", "relay's share", "within budget"], rows), "",
                 "![frontier](results/frontier.png)"])


def figures_area(f: dict) -> Area:
    checks, cut, paper = f["operating_point"]["checks"], f["ttft_reduction_pct"], f["paper"]
    misses = [c["quantity"] for c in checks if not c["within"]]
    rows = [[c["quantity"], f"{c['simulated']:.2f}", c["target"], f"+-{100 * c['tolerance']:g} %",
             "yes" if c["within"] else "no"] for c in checks]
    ttft = [[setup, *(f"{v[p]:.2f}" for p in ("p50", "p90", "p99"))]
            for setup, v in f["ttft_s"].items()]
    return Area("The report's figures, simulated", "figures.json", "scripts/reproduce_figures.py",
                "The simulator's figures (`scripts/reproduce_figures.py`)",
                "the PDD report's figures F1-F9 by the simulator, at the operating point fitted to "
                "the report (`configs/operating_point.toml`), on the public conversation trace",
                f"{_machine(f)}; the simulator; {f['line']['rate_mbit'] / 1e3:g} Gbit/s x "
                f"{f['line']['rtt_ms']:g} ms",
                f"PDD cuts naive cross-DC PD's TTFT by {cut['p50']:.1f} / {cut['p90']:.1f} / "
                f"{cut['p99']:.1f} % (P50 / P90 / P99; the report: {paper['ttft_reduction_pct']:g} %); "
                f"BCR {f['bcr']['gain_pct']:+.1f} % against same-DC PD (the report: up to "
                f"{paper['bcr_gain_pct']:g} %)",
                f"the operating point's {len(checks)} TTFTs within "
                f"{_span(checks, 'tolerance', lambda t: f'{100 * t:g}')} % of the report's: "
                + _verdict(misses), _date(f),
                [*_table(["condition", "simulated", "report", "allowed", "within"], rows), "",
                 "TTFT at the operating point, s (F1):", "",
                 *_table(["setup", "P50", "P90", "P99"], ttft)])


def _span(rows: list, key: str, fmt: Callable = _x) -> str:
    values = [row[key] for row in rows]
    return f"{fmt(min(values))}-{fmt(max(values))}"


def load(name: str) -> Optional[dict]:
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else None


BUILDERS: list[tuple[str, Callable]] = [
    ("demo.json", demo_area), ("frontier.json", frontier_area),
    ("validation.json", validation_area), ("figures.json", figures_area),
    ("faults.json", faults_area), ("soak.json", soak_area), ("wan_line_bench.json", wan_line_area),
    ("wan_codec_bench.json", codec_area), ("codec_gpu.json", codec_gpu_area),
    ("router_bench.json", router_area), ("tp_matrix.json", tp_area)]


def areas() -> list[Area]:
    return [build(report) for name, build in BUILDERS if (report := load(name)) is not None]


# --- rendering ---------------------------------------------------------------------------------

def anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    text = "".join(c for c in heading.strip().lower() if c.isalnum() or c in "-_ ")
    return text.replace(" ", "-")


def readme_block(found: list[Area]) -> str:
    rows = [[f"[{a.name}](docs/results.md#{anchor(a.name)})", f"`{a.script}`", a.on, a.figure,
             a.goal, a.date] for a in found]
    return "\n".join(_table(["area", "what ran", "on", "figure", "goal", "date"], rows))


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:]


def page_block(found: list[Area]) -> str:
    lines = []
    for a in found:
        lines += [f"## {a.name}", "",
                  f"`{a.script}`, {a.date} ([{a.file}](results/{a.file}); method: "
                  f"[measurements.md](measurements.md#{anchor(a.method)})). {_sentence(a.ran)}; on "
                  f"{a.on}.", "", f"**{_sentence(a.figure)}.** Goal: {a.goal}.", "", *a.detail, ""]
    return "\n".join(lines).rstrip()


def replace_block(text: str, block: str, path: Path) -> str:
    head, begin, rest = text.partition(BEGIN)
    _, end, tail = rest.partition(END)
    if not begin or not end:
        raise ValueError(f"{path.relative_to(REPO)}: the results markers are missing")
    return f"{head}{BEGIN}\n{block}\n{END}{tail}"


def rendered() -> dict[Path, str]:
    """What README.md and docs/results.md hold once rendered from docs/results/."""
    found = areas()
    return {path: replace_block(path.read_text(), block, path)
            for path, block in ((README, readme_block(found)), (PAGE, page_block(found)))}


def render(write: bool) -> list[str]:
    """The docs that differ from the results (written with ``write``)."""
    changed = []
    for path, text in rendered().items():
        if path.read_text() != text:
            changed.append(str(path.relative_to(REPO)))
            if write:
                path.write_text(text)
    return changed
