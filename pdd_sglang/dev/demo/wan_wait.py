"""P->MD requests' WAN wait against their copy alone on an idle line (issue 34: in the demo's
idle-line setup the P90 of wait / alone is at most 1.5).

For every request of a PDD setup that took P->MD (pipeline ``prefill_main``) and that main
answered from the first token (outcome ``main``):

  wait   its ``kv_and_first_token`` stage (report.py): prefill's forward done -> main's first
         token at the router: the copy across the line, main's first step, its stream back.
  alone  what the same copy takes on an idle line:
           (prompt_tokens - cached_tokens) x KV bytes per token / raw-over-wire ratio
           / the line's rate + one RTT + main's first step.

``cached_tokens`` is what main reported to the router: SGLang's decode side starts from prefill's
prefix hit and raises it to main's own radix hit where that is longer
(disaggregation/decode.py ``_commit_transfer_to_req``, decode_schedule_batch_mixin.py
``prepare_for_prebuilt``); prefill sends main only what main's cache lacks. In the demo main keeps
every turn's output as well as its prompt, so the figure is main's hit; where prefill held more
than main, the uncached count (and so alone) is short, and wait / alone errs high, not low.

The raw-over-wire ratio is the run's coded copies' KV bytes over their wire bytes (the prefill's
``wan_codec`` state, ``wan_kv_codec`` in demo.json). ``auto`` leaves some copies raw, and a raw
copy takes longer than this assumes: again alone is short, never long.

Main's first step is the run's same-DC PD ``kv_and_first_token`` P50 at the same point: the same
P->MD path with no line in it (the KV on loopback, main's first step and its stream, under the
same CPU quota and the same load), so alone differs from it only by the line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pdd_sglang.dev.testing import agentic

GOAL_X = 1.5  # issue 34: the idle-line setup's P->MD wait within 1.5x of alone at P90
KEY = "p_to_md_wait_over_alone"  # its key in demo.json
CHECK = "idle_line_p_to_md_wait"  # its check in the bar
P_TO_MD = "prefill_main"


def raw_over_wire(codec: dict | None) -> tuple[float | None, str]:
    """KV bytes per wire byte on the line in this run, and where that figure comes from."""
    if codec is None:  # demo.json written before --pdd-wan-kv-codec existed: every copy raw
        return 1.0, "no codec in the run (before --pdd-wan-kv-codec): raw"
    if "unread" in codec:
        return None, f"the prefill's codec state was not read: {codec['unread']}"
    if "coded_wire_bytes" not in codec:
        if codec.get("flag") == "raw":
            return 1.0, "--pdd-wan-kv-codec raw"
        return None, f"--pdd-wan-kv-codec {codec.get('flag')}: the prefill reported no counts"
    if not codec["coded_wire_bytes"]:
        return 1.0, f"--pdd-wan-kv-codec {codec.get('flag')}: no copy coded"
    ratio = codec["coded_raw_bytes"] / codec["coded_wire_bytes"]
    return ratio, (f"--pdd-wan-kv-codec {codec.get('flag')}: KV over wire bytes of the run's "
                   f"{codec.get('coded_copies')} coded copies ({codec.get('raw_copies')} raw)")


def first_step_s(setups: dict) -> tuple[float | None, str]:
    """Main's first step (with its loopback copy and stream): same-DC PD's kv_and_first_token P50."""
    same = setups.get("same_dc_pd")
    if not same or not same.get("stages", {}).get("requests_with_split"):
        return None, "no same_dc_pd stage split in the run"
    return (same["stages"]["all"]["kv_and_first_token"]["p50_s"],
            "same_dc_pd's kv_and_first_token P50 at the same point")


def request_figure(row: dict, kv_bytes_per_token: int, ratio: float | None, rate_bytes_s: float,
                   rtt_s: float, step_s: float | None) -> dict:
    """One P->MD request's wait, alone time and their ratio (None where a figure is missing)."""
    wait = (row.get("stages") or {}).get("kv_and_first_token")
    cached = row.get("cached_tokens")
    uncached = None if cached is None else max(row["prompt_tokens"] - cached, 0)
    alone = None
    if None not in (uncached, ratio, step_s):
        alone = uncached * kv_bytes_per_token / ratio / rate_bytes_s + rtt_s + step_s
    return {"rid": row.get("rid"), "wait_s": wait,
            "alone_s": None if alone is None else round(alone, 4),
            "uncached_tokens": uncached,
            "wait_over_alone": (round(wait / alone, 3)
                                if wait is not None and alone else None)}


def setup_figures(setup: dict, **inputs) -> dict:
    """Count, P50/P90 of wait / alone and every P->MD request of one setup."""
    chosen = [r for r in setup["rows"] if not r.get("error")
              and r.get("outcome_kind") == "main" and r.get("pipeline") == P_TO_MD]
    requests = [request_figure(r, **inputs) for r in chosen]
    ratios = [q["wait_over_alone"] for q in requests if q["wait_over_alone"] is not None]
    pct = agentic.percentile
    return {"p_to_md_requests": len(requests), "measured": len(ratios),
            "wait_over_alone_p50": round(pct(ratios, 50), 3) if ratios else None,
            "wait_over_alone_p90": round(pct(ratios, 90), 3) if ratios else None,
            "requests": requests}


def idle_line_setup(setups: dict) -> str | None:
    """The PDD setup placed by the idle line: pdd_idle_line, or pdd under --placement idle-line."""
    return next((name for name in ("pdd_idle_line", "pdd")
                 if (setups.get(name) or {}).get("placement") == "idle-line"), None)


def wait_over_alone(setups: dict, line: dict, kv_bytes_per_token: int,
                    codec: dict | None) -> dict:
    """The figure for every PDD setup of one point (``setups``: name -> report.summarize's)."""
    ratio, ratio_source = raw_over_wire(codec)
    step, step_source = first_step_s(setups)
    inputs = {"kv_bytes_per_token": kv_bytes_per_token, "ratio": ratio,
              "rate_bytes_s": line["rate_mbit"] * 1e6 / 8, "rtt_s": line["rtt_ms"] / 1e3,
              "step_s": step}
    return {
        "goal": f"the idle-line setup's P90 of wait / alone <= {GOAL_X}",
        "wait": "kv_and_first_token: prefill's forward done -> main's first token at the router",
        "alone": "(prompt_tokens - cached_tokens as main reported) x kv_bytes_per_token / "
                 "raw_over_wire / the line's rate + rtt + main_first_step",
        "inputs": {"kv_bytes_per_token": kv_bytes_per_token,
                   "raw_over_wire": None if ratio is None else round(ratio, 4),
                   "raw_over_wire_from": ratio_source, "rate_mbit": line["rate_mbit"],
                   "rtt_ms": line["rtt_ms"], "main_first_step_s": step,
                   "main_first_step_from": step_source},
        "idle_line_setup": idle_line_setup(setups),
        "setups": {name: setup_figures(setup, **inputs) for name, setup in setups.items()
                   if name.startswith("pdd")},
    }


def idle_line_check(figures: dict) -> bool | None:
    """The bar's check: None (not measured) without an idle-line P->MD request, never passed."""
    name = figures["idle_line_setup"]
    p90 = figures["setups"][name]["wait_over_alone_p90"] if name else None
    return None if p90 is None else p90 <= GOAL_X


def summary_line(figures: dict) -> str:
    parts = []
    for name, s in figures["setups"].items():
        if not s["measured"]:
            parts.append(f"{name} {s['p_to_md_requests']} P->MD"
                         + (", none measured" if s["p_to_md_requests"] else ""))
            continue
        parts.append(f"{name} {s['p_to_md_requests']} P->MD, P50 x{s['wait_over_alone_p50']} "
                     f"P90 x{s['wait_over_alone_p90']}")
    return (f"P->MD WAN wait over its copy alone (goal: {figures['idle_line_setup'] or 'idle-line'}"
            f" P90 <= {GOAL_X}): " + "; ".join(parts))


def from_demo_json(demo: dict) -> dict:
    """The figure recomputed from a saved demo.json (its load point)."""
    return wait_over_alone(demo["setups"], demo["line"], demo["model"]["kv_bytes_per_token"],
                           demo.get("wan_kv_codec"))


if __name__ == "__main__":  # python -m pdd_sglang.dev.demo.wan_wait DEMO_JSON...
    for path in sys.argv[1:]:
        figures = from_demo_json(json.loads(Path(path).read_text()))
        print(f"{path}\n  {summary_line(figures)}\n  inputs {figures['inputs']}")
        for name, s in figures["setups"].items():
            for q in s["requests"]:
                print(f"  {name} {q}")
