"""The demo's figures for one setup: TTFT and ITL percentiles, outcomes, the stage split, the bar.

Outcomes (one per request, from the router's finish summary in the stream's last meta_info):
``handoff_one_shot`` / ``handoff_catch_up`` (the relay answered first, main took over),
``relay_finished`` (the relay answered alone), ``main`` (main answered from the first token: P->MD,
or the relay lost), ``error``.

Stages of a TTFT (each from two wall-clock marks on this one host; they add up to the TTFT):

  router_to_prefill   client sends -> the router posts it to prefill (client->router HTTP,
                      placement)
  registration_wait   the router posts it -> it enters prefill's wait queue (router->prefill
                      HTTP, tokenization, bootstrap: the decode side(s) register their KV slots)
  prefill_queue       wait queue -> prefill's forward starts (SGLang's queue_time)
  prefill_forward     forward start -> forward done
  kv_and_first_token  forward done -> first token at the router (KV copy to the decode server that
                      answers first, its first decode step, its stream)
  router_to_client    first token at the router -> at the client

``registration_wait`` is split further by where each server's scheduler took the request in, from
SGLang's per-request time stats in the servers' logs (``--enable-request-time-stats-logging``;
``intake`` per row, :func:`intake_table` per setup), each after the router posted to prefill:

  <prefill> received    its scheduler put the request in its bootstrap queue (it reads new
                        requests only between two forwards, so a forward in progress shows here)
  <decode> received     a relay's or main's scheduler put it in its prealloc queue
  <decode> registered   ... and sent prefill its KV slots (its transfer queue entry)
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from pdd_sglang.dev.demo import wan_wait
from pdd_sglang.dev.testing import agentic

OUTCOMES = ("handoff_one_shot", "handoff_catch_up", "relay_finished", "main", "error")
STAGES = ("router_to_prefill", "registration_wait", "prefill_queue", "prefill_forward",
          "kv_and_first_token", "router_to_client")
# The brief's bar, measured in one run at the load point.
PDD_BAR, CROSS_BAR, HANDOFF_SHARE = 1.15, 2.0, 0.25
LINE_UTILISATION_LIMIT = 0.70
_PREFILL_STATS = re.compile(r"pdd-prefill-stats (\{.*\})")
# SGLang's ReqTimeStats log line (observability/req_time_stats.py): entry_time is the wall time,
# on the scheduler's clock, of the bootstrap queue (prefill) or prealloc queue (decode) entry.
_TIME_STATS = re.compile(r"ReqTimeStats\(rid=([^,]+),.*?type=(prefill|decode)\): (.*)$", re.M)


def outcome_of(row: dict) -> str:
    if row["error"]:
        return "error"
    if row["outcome"] == "handoff":
        return "handoff_catch_up" if row.get("handoff_mode") == "catch-up" else "handoff_one_shot"
    if row["outcome"] == "relay_finished":
        return "relay_finished"
    return "main"  # P->MD, or main took over from a lost relay


def prefill_stats_from_log(log_path: Path) -> dict:
    """rid -> prefill's own time stats, from the router's ``pdd-prefill-stats`` log lines."""
    stats = {}
    try:
        text = Path(log_path).read_text(errors="replace")
    except FileNotFoundError:
        return stats
    for match in _PREFILL_STATS.finditer(text):
        with_rid = json.loads(match.group(1))
        stats[with_rid.pop("rid")] = with_rid
    return stats


def _duration_s(text: str) -> float:
    return float(text[:-2]) / 1e3 if text.endswith("ms") else float(text.rstrip("s"))


def scheduler_intake_from_logs(logs: dict) -> dict:
    """rid -> server -> ``{"received_ts"}`` (and for a decode server ``"registered_ts"``), from
    the ReqTimeStats lines of each server's log (``logs``: server name -> log path)."""
    intake: dict = {}
    for server, path in logs.items():
        try:
            text = Path(path).read_text(errors="replace")
        except FileNotFoundError:
            continue
        for rid, kind, fields in _TIME_STATS.findall(text):
            values = dict(kv.split("=", 1) for kv in fields.split(", ") if "=" in kv)
            try:
                entry = float(values["entry_time"])
                marks = {"received_ts": entry}
                if kind == "decode":
                    waited = sum(_duration_s(values[k]) for k in (
                        "bootstrap_duration", "alloc_wait_duration", "prealloc_queue_duration")
                        if k in values)
                    marks["registered_ts"] = entry + waited
            except (KeyError, ValueError):
                continue  # a line of another shape: no mark rather than a wrong one
            intake.setdefault(rid, {})[server] = marks
    return intake


def intake_of(row: dict, marks: dict | None) -> dict | None:
    """Seconds from the router's post to prefill to each server's intake marks, for one row."""
    sent = (row.get("marks") or {}).get("prefill_sent_ts")
    if sent is None or not marks:
        return None
    return {f"{server} {what[:-3]}": round(ts - sent, 4)
            for server, server_marks in sorted(marks.items(), key=lambda m: (m[0] != "prefill", m[0]))
            for what, ts in server_marks.items()}


def intake_table(rows: list) -> dict:
    """P50/P90 of each intake mark over the rows that have it."""
    names = sorted({name for r in rows for name in (r.get("intake") or {})},
                   key=lambda name: (not name.startswith("prefill "), name))
    return {name: _pcts([r["intake"][name] for r in rows if name in (r.get("intake") or {})])
            for name in names}


def stage_split(row: dict, prefill: dict | None) -> dict | None:
    """The six stages of one request's TTFT (seconds), or None where a mark is missing.

    Every mark is on the router's clock or the prefill scheduler's (its forward marks agree with
    the router's to milliseconds). SGLang's ``request_received_ts`` is not used: SGLang turns its
    tokenizer process's monotonic time into wall time with an offset taken once in that process,
    and in one full demo here it sat 6-21 s away from the scheduler's. So the prefill's side
    starts where the router posts to it (``prefill_sent_ts``), and the HTTP hop, tokenization and
    the bootstrap all count as ``registration_wait``.
    """
    marks = row.get("marks") or {}
    prefill = prefill or {}
    sent, ttft = row.get("sent_ts"), row.get("ttft_s")
    received = marks.get("prefill_sent_ts")
    forward = prefill.get("forward_entry_time")
    forward_done = prefill.get("prefill_finished_time")
    first = marks.get("first_token_ts")
    if None in (sent, ttft, received, forward, forward_done, first):
        return None
    queue = min(max(prefill.get("queue_time") or 0.0, 0.0), forward - received)
    split = {"router_to_prefill": received - sent,
             "registration_wait": forward - received - queue,
             "prefill_queue": queue,
             "prefill_forward": forward_done - forward,
             "kv_and_first_token": first - forward_done,
             "router_to_client": sent + ttft - first}
    return {k: round(v, 4) for k, v in split.items()}


def _pcts(values: list) -> dict:
    pct = agentic.percentile
    return {f"p{q}_s": (round(pct(values, q), 4) if values else None) for q in (50, 90, 99)}


def stage_table(rows: list) -> dict:
    """Per stage P50/P90/P99 over every request with a full split, and per outcome."""
    split = [r for r in rows if r.get("stages")]
    table = {"requests_with_split": len(split),
             "all": {s: _pcts([r["stages"][s] for r in split]) for s in STAGES},
             "by_outcome": {}}
    for outcome in OUTCOMES:
        chosen = [r for r in split if r["outcome_kind"] == outcome]
        if chosen:
            table["by_outcome"][outcome] = {
                "requests": len(chosen),
                **{s: _pcts([r["stages"][s] for r in chosen]) for s in STAGES}}
    return table


def summarize(results: list, prefill_stats: dict, wan: dict, kv_bytes: int, duration_s: float,
              main_location: str, rate_mbit: float, intake: dict | None = None,
              wan_in_run: dict | None = None) -> dict:
    """One setup's figures. ``wan``: the line's bytes each way from the start to once every copy
    landed or was dropped; ``wan_in_run``: those until the last answer (the line's load in the
    run; ``wan`` when not given)."""
    rows = [r.summary() for r in results]
    for row in rows:
        row["outcome_kind"] = outcome_of(row)
        row["stages"] = None if row["error"] else stage_split(row, prefill_stats.get(row["rid"]))
        row["intake"] = intake_of(row, (intake or {}).get(row["rid"]))
    ok = [r for r in results if not r.error]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    itl = [g for r in ok for g in r.itl_s]
    pct = agentic.percentile
    hits = [(r.cached_tokens or 0) / r.prompt_tokens for r in ok if r.cached_tokens is not None]
    low = [r for r in ok if r.cached_tokens is not None and r.cached_tokens / r.prompt_tokens < 0.8]
    cached, prompt = sum(r.cached_tokens or 0 for r in ok), sum(r.prompt_tokens for r in ok)
    pipelines: dict = {}
    for r in ok:
        pipelines[r.pipeline or "unknown"] = pipelines.get(r.pipeline or "unknown", 0) + 1
    outcomes = {k: sum(1 for row in rows if row["outcome_kind"] == k) for k in OUTCOMES}
    in_run = wan if wan_in_run is None else wan_in_run
    line_busy = in_run["a_to_b"] * 8 / (rate_mbit * 1e6 * duration_s) if duration_s > 0 else None

    def rnd(value, digits):
        return None if value is None else round(value, digits)

    return {
        "main_location": main_location,
        "ttft_p50_s": rnd(pct(ttft, 50), 4), "ttft_p90_s": rnd(pct(ttft, 90), 4),
        "ttft_p99_s": rnd(pct(ttft, 99), 4),
        "ttft_mean_s": rnd(sum(ttft) / len(ttft), 4) if ttft else None,
        "itl_p50_ms": rnd(pct(itl, 50) * 1e3, 2) if itl else None,
        "itl_p99_ms": rnd(pct(itl, 99) * 1e3, 2) if itl else None,
        "e2e_p50_s": rnd(pct([r.e2e_s for r in ok], 50), 4),
        "requests": len(results), "errors": len(results) - len(ok),
        "error_messages": sorted({r.error for r in results if r.error})[:5],
        "outcomes": outcomes, "pipelines": pipelines,
        "wan_bytes": wan["a_to_b"] + wan["b_to_a"],
        "wan_bytes_a_to_b": wan["a_to_b"], "wan_bytes_b_to_a": wan["b_to_a"],
        # what was still to cross when the last answer came (cache-only copies' tails)
        "wan_bytes_after_last_answer": (wan["a_to_b"] + wan["b_to_a"]
                                        - in_run["a_to_b"] - in_run["b_to_a"]),
        # A->B bytes over what the line could carry in the run: the average load on the line.
        "line_utilisation_a_to_b": rnd(line_busy, 3) if main_location == "cluster B" else 0.0,
        "kv_bytes_to_main": kv_bytes,
        "kv_bytes_over_wan": kv_bytes if main_location == "cluster B" else 0,
        "main_token_hit": rnd(cached / prompt, 4) if prompt else None,
        "median_request_hit": rnd(pct(hits, 50), 4),
        "requests_hit_lt_80pct": len(low),
        "ttft_p50_s_hit_lt_80pct": rnd(pct([r.ttft_s for r in low], 50), 4),
        "stages": stage_table(rows),
        "intake": intake_table(rows),
        "duration_s": round(duration_s, 2),
        "rows": rows,
    }


def the_bar(setups: dict, leaks: dict, p_to_md: dict | None = None) -> dict:
    """The brief's bar at the load point, from this one run, and where PDD's excess lies.

    ``p_to_md``: wan_wait.wait_over_alone's figures; where the run has an idle-line setup, issue
    34's check on its P->MD wait joins the bar, None (not measured, so not met) without a P->MD
    request there."""
    same, cross, pdd = setups["same_dc_pd"], setups["cross_dc_pd"], setups["pdd"]

    def ratio(a, b):
        return round(a / b, 3) if a and b else None

    handoffs = pdd["outcomes"]["handoff_one_shot"] + pdd["outcomes"]["handoff_catch_up"]
    bar = {"pdd_over_same_dc_p99": ratio(pdd["ttft_p99_s"], same["ttft_p99_s"]),
           "pdd_over_same_dc_p50": ratio(pdd["ttft_p50_s"], same["ttft_p50_s"]),
           "cross_dc_over_same_dc_p99": ratio(cross["ttft_p99_s"], same["ttft_p99_s"]),
           "pdd_handoff_share": round(handoffs / pdd["requests"], 3) if pdd["requests"] else 0.0,
           "errors": sum(s["errors"] for s in setups.values()),
           "pdd_bound": PDD_BAR, "cross_dc_bound": CROSS_BAR, "handoff_share_bound": HANDOFF_SHARE}
    checks = {
        "pdd_p99": bar["pdd_over_same_dc_p99"] is not None and bar["pdd_over_same_dc_p99"] <= PDD_BAR,
        "pdd_p50": bar["pdd_over_same_dc_p50"] is not None and bar["pdd_over_same_dc_p50"] <= PDD_BAR,
        "cross_dc_p99": (bar["cross_dc_over_same_dc_p99"] is not None
                         and bar["cross_dc_over_same_dc_p99"] >= CROSS_BAR),
        "handoffs": bar["pdd_handoff_share"] >= HANDOFF_SHARE,
        "no_errors": bar["errors"] == 0, "no_leaks": not leaks}
    if p_to_md is not None and p_to_md["idle_line_setup"] is not None:
        idle = p_to_md["setups"][p_to_md["idle_line_setup"]]
        bar.update(idle_line_p_to_md_requests=idle["p_to_md_requests"],
                   idle_line_p_to_md_wait_over_alone_p90=idle["wait_over_alone_p90"],
                   idle_line_wait_bound=wan_wait.GOAL_X)
        checks[wan_wait.CHECK] = wan_wait.idle_line_check(p_to_md)
    bar.update(checks=checks, met=all(checks.values()),
               pdd_met=checks["pdd_p99"] and checks["pdd_p50"], cross_dc_met=checks["cross_dc_p99"],
               pdd_excess_by_stage=stage_excess(same, pdd),
               pdd_excess_paired=paired_excess(same, pdd))
    return bar


def stage_excess(same: dict, pdd: dict) -> dict:
    """PDD's stage percentiles less same-DC PD's, per stage, largest P99 excess first."""
    a, b = same["stages"]["all"], pdd["stages"]["all"]
    excess = {}
    for stage in STAGES:
        diff = {q: (round(b[stage][q] - a[stage][q], 4)
                    if b[stage][q] is not None and a[stage][q] is not None else None)
                for q in ("p50_s", "p99_s")}
        excess[stage] = diff
    return dict(sorted(excess.items(), key=lambda kv: -(kv[1]["p99_s"] or 0)))


def paired_excess(same: dict, pdd: dict) -> dict:
    """PDD's TTFT less same-DC's for the same request (conversation, turn), split by stage.

    Percentiles of stages do not add up to a percentile of TTFT; per-request differences do:
    a pair's stage differences sum to its TTFT difference, so the mean per stage says which stage
    carries PDD's excess, and per outcome which kind of request. Pairs need a full split on both."""
    same_rows = {(r["conversation"], r["turn"]): r for r in same["rows"] if r.get("stages")}
    pairs = [(same_rows[key], r) for r in pdd["rows"] if r.get("stages")
             and (key := (r["conversation"], r["turn"])) in same_rows]

    def summary(chosen: list) -> dict:
        diffs = [b["ttft_s"] - a["ttft_s"] for a, b in chosen]
        return {"pairs": len(chosen),
                "ttft_diff_p50_s": round(agentic.percentile(diffs, 50), 4),
                "ttft_diff_mean_s": round(sum(diffs) / len(diffs), 4),
                "stage_diff_mean_s": {s: round(sum(b["stages"][s] - a["stages"][s]
                                                   for a, b in chosen) / len(chosen), 4)
                                      for s in STAGES}}

    if not pairs:
        return {"pairs": 0}
    table = summary(pairs)
    table["by_pdd_outcome"] = {
        outcome: summary(chosen) for outcome in OUTCOMES
        if (chosen := [(a, b) for a, b in pairs if b["outcome_kind"] == outcome])}
    return table


def print_table(setups: dict, title: str) -> None:
    print(f"\n{title}")
    header = (f"{'setup':<22} {'TTFT P50':>9} {'P90':>7} {'P99':>7} {'ITL P50':>8} "
              f"{'line':>5} {'1shot':>5} {'catch':>5} {'relay':>5} {'main':>5} {'err':>4} "
              f"{'reqs':>5}")
    print(header)
    print("-" * len(header))
    for name, s in setups.items():
        f = lambda v, unit="s": "-" if v is None else (f"{v:.2f}{unit}")  # noqa: E731
        o = s["outcomes"]
        print(f"{name:<22} {f(s['ttft_p50_s']):>9} {f(s['ttft_p90_s']):>7} {f(s['ttft_p99_s']):>7} "
              f"{f(s['itl_p50_ms'], 'ms'):>8} {s['line_utilisation_a_to_b']:>5.0%} "
              f"{o['handoff_one_shot']:>5} {o['handoff_catch_up']:>5} {o['relay_finished']:>5} "
              f"{o['main']:>5} {o['error']:>4} {s['requests']:>5}")


def print_line_classes(setups: dict) -> None:
    """The new WAN line's figures (issue 34): bytes each setup's copies handed to the line by
    class, and cache-only bytes dropped past the backlog bound (the prefill's /pdd/line)."""
    rows = {n: s["wan_line_by_class"] for n, s in setups.items() if s.get("wan_line_by_class")}
    if not rows:
        return
    mb = lambda v: f"{v / 1e6:.2f}"  # noqa: E731
    print(f"\n{'WAN line by class (MB)':<22} {'needed-now':>10} {'cache-only':>10} "
          f"{'dropped':>8}  (the prefill's /pdd/line: handed to the line; cache-only dropped)")
    for name, c in rows.items():
        print(f"{name:<22} {mb(c['needed_now_sent_bytes']):>10} "
              f"{mb(c['cache_only_sent_bytes']):>10} {mb(c['dropped_cache_only_bytes']):>8}")


def print_bar(bar: dict) -> None:
    c = bar["checks"]
    word = lambda ok: "met" if ok else "NOT met"  # noqa: E731
    print(f"\nthe bar (load point, this run): PDD P99 x{bar['pdd_over_same_dc_p99']} and P50 "
          f"x{bar['pdd_over_same_dc_p50']} of same-DC (<= {PDD_BAR}: {word(c['pdd_p99'])}, "
          f"{word(c['pdd_p50'])}); naive cross-DC P99 x{bar['cross_dc_over_same_dc_p99']} "
          f"(>= {CROSS_BAR}: {word(c['cross_dc_p99'])}); handoffs {bar['pdd_handoff_share']:.0%} "
          f"of PDD's requests (>= {HANDOFF_SHARE:.0%}: {word(c['handoffs'])}); errors "
          f"{bar['errors']}; leaks {'none' if c['no_leaks'] else 'YES'}{_idle_line_words(bar)}")
    if not bar["pdd_met"]:
        print("where PDD's TTFT exceeds same-DC's, by stage (P50 / P99, s):")
        for stage, d in bar["pdd_excess_by_stage"].items():
            print(f"  {stage:<20} {d['p50_s']!s:>8} / {d['p99_s']!s:>8}")
        paired = bar["pdd_excess_paired"]
        if paired["pairs"]:
            print(f"the same requests, PDD less same-DC ({paired['pairs']} pairs): TTFT median "
                  f"{paired['ttft_diff_p50_s']:+.3f} s, mean {paired['ttft_diff_mean_s']:+.3f} s; "
                  "mean by stage:")
            for stage, diff in paired["stage_diff_mean_s"].items():
                print(f"  {stage:<20} {diff:+.3f}")
            for outcome, part in paired["by_pdd_outcome"].items():
                print(f"  PDD {outcome:<17} {part['pairs']:>3} pairs: TTFT mean "
                      f"{part['ttft_diff_mean_s']:+.3f} s, median {part['ttft_diff_p50_s']:+.3f} s")


def _idle_line_words(bar: dict) -> str:
    if wan_wait.CHECK not in bar["checks"]:
        return ""
    ok = bar["checks"][wan_wait.CHECK]
    verdict = "not measured" if ok is None else ("met" if ok else "NOT met")
    return (f"; idle-line P->MD wait P90 x{bar['idle_line_p_to_md_wait_over_alone_p90']} of alone "
            f"({bar['idle_line_p_to_md_requests']} P->MD; <= {bar['idle_line_wait_bound']}: "
            f"{verdict})")


def print_intake(setups: dict) -> None:
    """Where registration_wait goes: each server's intake after the router's post to prefill."""
    print("\nintake after the router posts to prefill (P50 / P90, s): prefill received, decode "
          "servers received and registered")
    for name, setup in setups.items():
        marks = ", ".join(f"{mark} {q['p50_s']}/{q['p90_s']}"
                          for mark, q in (setup.get("intake") or {}).items())
        print(f"  {name:<20} {marks or '-'}")


def workload_stats(system: list, conversations: list, spec: agentic.WorkloadSpec,
                   setups: dict) -> dict:
    rows = [r for s in setups.values() for r in s["rows"] if r["error"] is None]
    pct = agentic.percentile
    stats = lambda v: {"min": min(v), "p50": pct(v, 50), "p90": pct(v, 90),  # noqa: E731
                       "max": max(v), "mean": round(sum(v) / len(v), 1)} if v else None
    documents = sum(1 for c in conversations for new, _ in c.turns
                    if len(new) >= spec.document_tokens[0])
    return {**spec.to_json(), "kind": "agentic multi-turn",
            "requests_per_setup": spec.conversations * spec.turns, "document_turns": documents,
            "system_prompt_tokens": len(system),
            "prompt_token_stats": stats([r["prompt_tokens"] for r in rows]),
            "output_token_stats": stats([r["output_tokens"] for r in rows]),
            "warmup": "one unmeasured request with the shared system prompt per setup"}
