"""P->MD requests' WAN wait against their copy alone on an idle line (issue 34: in the demo's
idle-line setup the P90 of wait / alone is at most 1.5).

For every request of a PDD setup that took P->MD (pipeline ``prefill_main``) and that main
answered from the first token (outcome ``main``):

  wait   its ``kv_and_first_token`` stage (report.py): prefill's forward done -> main's first
         token at the router: the copy across the line, main's first step, its stream back.
  alone  what the same copy takes alone on the idle line, MEASURED in the same run: naive
         cross-DC PD at the latency point sends one request at a time over the same line to the
         same main, so each of its copies has the line to itself; a least-squares line of their
         kv_and_first_token on their uncached tokens gives a fixed part (round trips, the
         transfer's set-up and completion, main's first step) and a part per token (the line's
         rate, the codec as it ran). At the load point main's first step also waits for its
         running batch: plus same-DC PD's kv_and_first_token P50 at load less at the latency
         point (loopback copies, so the difference is main's load, not the line), never less
         than 0.
  line_floor  the line's arithmetic, reported beside it (and ``alone`` where the run has no
         latency point, e.g. --frontier):
           (prompt_tokens - cached_tokens) x KV bytes per token / raw-over-wire ratio
           / the line's rate + one RTT + main's first step.
         It leaves out the protocol's second round trip (main learns of the landed copy from
         prefill's status message after Mooncake's acknowledgement) and the per-transfer set-up,
         so it rated copies that had the idle line to themselves (the latency point's naive
         cross-DC PD, three fresh-clone runs) at x1.10-1.90 of "alone": it cannot tell a copy
         that waited behind others from one that did not.

``cached_tokens`` is what main reported to the router: SGLang's decode side starts from prefill's
prefix hit and raises it to main's own radix hit where that is longer
(disaggregation/decode.py ``_commit_transfer_to_req``, decode_schedule_batch_mixin.py
``prepare_for_prebuilt``); prefill sends main only what main's cache lacks. In the demo main keeps
every turn's output as well as its prompt, so the figure is main's hit; where prefill held more
than main, the uncached count (and so alone) is short, and wait / alone errs high, not low.

The raw-over-wire ratio (line floor only) is the run's coded copies' KV bytes over their wire
bytes (the prefill's ``wan_codec`` state, ``wan_kv_codec`` in demo.json). ``auto`` leaves some
copies raw, and a raw copy takes longer than this assumes: again the floor is short, never long.

Main's first step (line floor only) is the run's same-DC PD ``kv_and_first_token`` P50 at the same
point: the same P->MD path with no line in it (the KV on loopback, main's first step and its
stream, under the same CPU quota and the same load), so the floor differs from it only by the line.
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
                   f"{codec.get('coded_copies')} coded copies ({codec.get('packed_raw_copies')} packed "
                   f"raw, {codec.get('one_sided_copies')} one-sided)")


def first_step_s(setups: dict) -> tuple[float | None, str]:
    """Main's first step (with its loopback copy and stream): same-DC PD's kv_and_first_token P50."""
    same = setups.get("same_dc_pd")
    if not same or not same.get("stages", {}).get("requests_with_split"):
        return None, "no same_dc_pd stage split in the run"
    return (same["stages"]["all"]["kv_and_first_token"]["p50_s"],
            "same_dc_pd's kv_and_first_token P50 at the same point")


def _uncached(row: dict) -> int | None:
    cached = row.get("cached_tokens")
    return None if cached is None else max(row["prompt_tokens"] - cached, 0)


def measured_alone(latency_setups: dict | None, setups: dict) -> tuple[dict | None, str]:
    """``{fixed_s, s_per_token, main_load_s}`` of a copy alone on the idle line, fitted on the
    run's latency-point naive cross-DC PD (module docstring), or None and why not."""
    cross = (latency_setups or {}).get("cross_dc_pd") or {}
    points = [(tokens, row["stages"]["kv_and_first_token"]) for row in cross.get("rows") or []
              if not row.get("error") and (row.get("stages") or {}).get("kv_and_first_token")
              and (tokens := _uncached(row))]
    if len({tokens for tokens, _ in points}) < 3:
        return None, "fewer than 3 copies of different sizes in the latency point's cross_dc_pd"
    mean_n = sum(n for n, _ in points) / len(points)
    mean_t = sum(t for _, t in points) / len(points)
    slope = (sum((n - mean_n) * (t - mean_t) for n, t in points)
             / sum((n - mean_n) ** 2 for n, _ in points))
    if not slope > 0:
        return None, "the latency point's cross_dc_pd copies do not grow with their size"
    if mean_t - slope * mean_n < 0:  # no copy takes less than nothing: a line that bends
        return None, "the latency point's cross_dc_pd copies fit a negative fixed part"
    step_latency, _ = first_step_s(latency_setups or {})
    step_load, _ = first_step_s(setups)
    main_load = (max(step_load - step_latency, 0.0)
                 if None not in (step_latency, step_load) else 0.0)
    model = {"fixed_s": round(mean_t - slope * mean_n, 4), "s_per_token": round(slope, 7),
             "main_load_s": round(main_load, 4)}
    return model, (f"MEASURED: the latency point's naive cross-DC PD, {len(points)} copies one "
                   "at a time on the idle line, least squares of kv_and_first_token on uncached "
                   "tokens; plus main's load: same_dc_pd's kv_and_first_token P50 at this point "
                   "less at the latency point")


def request_figure(row: dict, kv_bytes_per_token: int, ratio: float | None, rate_bytes_s: float,
                   rtt_s: float, step_s: float | None, alone_model: dict | None) -> dict:
    """One P->MD request's wait, alone time (measured, else the line floor), line floor and the
    ratio of wait to alone (None where a figure is missing)."""
    wait = (row.get("stages") or {}).get("kv_and_first_token")
    uncached = _uncached(row)
    floor = None
    if None not in (uncached, ratio, step_s):
        floor = uncached * kv_bytes_per_token / ratio / rate_bytes_s + rtt_s + step_s
    alone = floor
    if alone_model is not None and uncached is not None:
        alone = (alone_model["fixed_s"] + alone_model["s_per_token"] * uncached
                 + alone_model["main_load_s"])
    return {"rid": row.get("rid"), "wait_s": wait,
            "alone_s": None if alone is None else round(alone, 4),
            "line_floor_s": None if floor is None else round(floor, 4),
            "uncached_tokens": uncached,
            "wait_over_alone": (round(wait / alone, 3)
                                if wait is not None and alone else None)}


def setup_figures(setup: dict, **inputs) -> dict:
    """Count, P50/P90 of wait / alone and every P->MD request of one setup."""
    chosen = [r for r in setup["rows"] if not r.get("error")
              and r.get("outcome_kind") == "main" and r.get("pipeline") == P_TO_MD]
    requests = [request_figure(r, **inputs) for r in chosen]
    ratios = [q["wait_over_alone"] for q in requests if q["wait_over_alone"] is not None]
    over_floor = [q["wait_s"] / q["line_floor_s"] for q in requests
                  if q["wait_s"] is not None and q["line_floor_s"]]
    pct = agentic.percentile
    return {"p_to_md_requests": len(requests), "measured": len(ratios),
            "wait_over_alone_p50": round(pct(ratios, 50), 3) if ratios else None,
            "wait_over_alone_p90": round(pct(ratios, 90), 3) if ratios else None,
            "wait_over_line_floor_p90": round(pct(over_floor, 90), 3) if over_floor else None,
            "requests": requests}


def idle_line_setup(setups: dict) -> str | None:
    """The PDD setup placed by the idle line: pdd_idle_line, or pdd under --placement idle-line."""
    return next((name for name in ("pdd_idle_line", "pdd")
                 if (setups.get(name) or {}).get("placement") == "idle-line"), None)


def wait_over_alone(setups: dict, line: dict, kv_bytes_per_token: int,
                    codec: dict | None, latency_setups: dict | None = None) -> dict:
    """The figure for every PDD setup of one point (``setups``: name -> report.summarize's);
    ``latency_setups``, the run's latency point, gives the measured alone time."""
    ratio, ratio_source = raw_over_wire(codec)
    step, step_source = first_step_s(setups)
    model, model_source = measured_alone(latency_setups, setups)
    inputs = {"kv_bytes_per_token": kv_bytes_per_token, "ratio": ratio,
              "rate_bytes_s": line["rate_mbit"] * 1e6 / 8, "rtt_s": line["rtt_ms"] / 1e3,
              "step_s": step, "alone_model": model}
    return {
        "goal": f"the idle-line setup's P90 of wait / alone <= {GOAL_X}",
        "wait": "kv_and_first_token: prefill's forward done -> main's first token at the router",
        "alone": ("fixed_s + s_per_token x uncached tokens + main_load_s (alone_model)"
                  if model else "the line floor (no measured alone: " + model_source + ")"),
        "line_floor": "(prompt_tokens - cached_tokens as main reported) x kv_bytes_per_token / "
                      "raw_over_wire / the line's rate + rtt + main_first_step",
        "inputs": {"kv_bytes_per_token": kv_bytes_per_token,
                   "raw_over_wire": None if ratio is None else round(ratio, 4),
                   "raw_over_wire_from": ratio_source, "rate_mbit": line["rate_mbit"],
                   "rtt_ms": line["rtt_ms"], "main_first_step_s": step,
                   "main_first_step_from": step_source, "alone_model": model,
                   "alone_model_from": model_source},
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
                     f"P90 x{s['wait_over_alone_p90']} (x{s['wait_over_line_floor_p90']} of the "
                     "line floor)")
    return (f"P->MD WAN wait over its copy alone (goal: {figures['idle_line_setup'] or 'idle-line'}"
            f" P90 <= {GOAL_X}): " + "; ".join(parts))


def from_demo_json(demo: dict) -> dict:
    """The figure recomputed from a saved demo.json (its load point)."""
    return wait_over_alone(demo["setups"], demo["line"], demo["model"]["kv_bytes_per_token"],
                           demo.get("wan_kv_codec"), demo.get("latency_setups"))


if __name__ == "__main__":  # python -m pdd_sglang.dev.demo.wan_wait DEMO_JSON...
    for path in sys.argv[1:]:
        figures = from_demo_json(json.loads(Path(path).read_text()))
        print(f"{path}\n  {summary_line(figures)}\n  inputs {figures['inputs']}")
        for name, s in figures["setups"].items():
            for q in s["requests"]:
                print(f"  {name} {q}")
