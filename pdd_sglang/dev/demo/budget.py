"""The demo's TTFT budget: what each setup's budget is, how many requests met it, and what the
relay paid for it.

- **The budget.** ``--ttft-slo-ms MS`` (fixed) or ``--ttft-slo-x F``: F x same-DC PD's TTFT P50 at
  the same operating point, measured earlier in the same run (the demo runs same-DC PD first at
  every point). The router of every PDD setup gets it as ``--ttft-slo-ms``.
- **Within budget.** The share of a setup's requests whose TTFT at the client is at most the
  budget; a failed request is not within. Setups without a budget of their own (same-DC and
  naive cross-DC PD) are measured against the run's reference budget, for comparison.
- **The relay's busy share** (the cost side): decode work at the relay over all decode work
  (relay + main) in the setup. SGLang 0.5.23 exports no decode-step counter; its
  ``sglang:realtime_tokens_total{mode="decode"}`` counts the tokens each decode iteration
  generated, per server (every iteration, with ``--enable-metrics``). So the share is of
  generated tokens: a proxy for steps that weighs a step by its batch size.
- **The frontier** (``--frontier``): the load point's PDD at several budgets, one point each:
  TTFT P50/P99 against the relay's busy share.
"""

from __future__ import annotations

import re
from typing import Iterable, Optional

DECODE_TOKENS = "sglang:realtime_tokens_total"
ROUTER_VERDICTS = "pdd_router_ttft_budget_total"
ROUTER_RETRIES = "pdd_router_retries_total"
FRONTIER_X = (1.0, 1.15, 1.5, 3.0)  # x same-DC P50
BAR_X = 1.15  # the budget at which the load point must meet its bar
_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def samples(text: str, name: str) -> list[tuple[dict, float]]:
    """Every sample of metric ``name`` in Prometheus text: (labels, value)."""
    found = []
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and match.group(1) == name:
            found.append((dict(_LABEL.findall(match.group(2) or "")), float(match.group(3))))
    return found


def decode_tokens(metrics_text: str) -> Optional[float]:
    """The tokens a server's decode iterations generated (sum over its schedulers); None when
    the server exports no such counter (no ``--enable-metrics``)."""
    chosen = [v for labels, v in samples(metrics_text, DECODE_TOKENS)
              if labels.get("mode") == "decode"]
    if not chosen and DECODE_TOKENS not in metrics_text:
        return None
    return sum(chosen)  # exported, but no decode yet: 0


def router_verdicts(metrics_text: str) -> dict:
    """The router's placements by verdict against the TTFT budget (pdd_router_ttft_budget)."""
    return _by_label(metrics_text, ROUTER_VERDICTS, "verdict")


def router_retries(metrics_text: str) -> dict:
    """The router's re-placements by cause (pdd_router_retries: a server failed a request, or
    its servers disagreed on a token, ``splice``): requests the client got whole, late."""
    return _by_label(metrics_text, ROUTER_RETRIES, "cause")


def _by_label(metrics_text: str, name: str, label: str) -> dict:
    counts: dict = {}
    for labels, value in samples(metrics_text, name):
        key = labels.get(label, "")
        counts[key] = counts.get(key, 0) + value
    return counts


def counter_delta(before: dict, after: dict) -> dict:
    return {k: int(round(after.get(k, 0) - before.get(k, 0))) for k in set(before) | set(after)
            if after.get(k, 0) - before.get(k, 0)}


def busy_share(relay_tokens: Optional[float], main_tokens: Optional[float]) -> Optional[float]:
    """Relay decode work / all decode work (relay + main); None when unknown or nothing decoded."""
    if main_tokens is None or (relay_tokens is None and main_tokens == 0):
        return None
    relay = relay_tokens or 0.0
    total = relay + main_tokens
    if relay < 0 or main_tokens < 0:
        raise ValueError(f"negative decode counts: relay {relay_tokens}, main {main_tokens}")
    return round(relay / total, 4) if total > 0 else None


def within_budget_share(rows: Iterable[dict], budget_s: Optional[float]) -> Optional[float]:
    """Share of requests with a client TTFT <= ``budget_s`` (a failed request is not within)."""
    rows = list(rows)
    if budget_s is None or not rows:
        return None
    within = sum(1 for r in rows
                 if not r.get("error") and r.get("ttft_s") is not None and r["ttft_s"] <= budget_s)
    return round(within / len(rows), 4)


def budget_seconds(slo_ms: Optional[float], slo_x: Optional[float],
                   same_dc_p50_s: Optional[float]) -> Optional[float]:
    """A setup's budget: fixed (ms) or a multiple of same-DC's measured P50; None: no budget."""
    if slo_ms is not None and slo_x is not None:
        raise ValueError("give a budget in ms or as a multiple of same-DC's P50, not both")
    if slo_ms is not None:
        if not slo_ms > 0:
            raise ValueError(f"the TTFT budget must be > 0 ms, got {slo_ms!r}")
        return slo_ms / 1e3
    if slo_x is None:
        return None
    if not slo_x > 0:
        raise ValueError(f"the budget's multiple of same-DC's P50 must be > 0, got {slo_x!r}")
    if not same_dc_p50_s:
        raise ValueError("a budget relative to same-DC's P50 needs same-DC PD measured first")
    return slo_x * same_dc_p50_s


def setup_budget(slo_ms: Optional[float], slo_x: Optional[float], rate: Optional[float],
                 same_dc: Optional[dict], system_tokens: int) -> tuple:
    """A PDD setup's TTFT budget (s; None: none) and the prefill rate its router predicts with
    (``rate``, else measured from same-DC PD's requests at the same point)."""
    if slo_x is None and slo_ms is None:
        return None, None
    budget_s = budget_seconds(slo_ms, slo_x, same_dc["ttft_p50_s"] if same_dc else None)
    if rate is None and same_dc:
        rate = prefill_tokens_per_s(same_dc["rows"], system_tokens)
    return budget_s, rate


def reference_budget(slo_ms: Optional[float], slo_x: Optional[float],
                     same_dc: Optional[dict]) -> Optional[float]:
    """What setups without a budget of their own are measured against: the run's budget."""
    if slo_ms is not None:
        return slo_ms / 1e3
    p50 = (same_dc or {}).get("ttft_p50_s")
    return slo_x * p50 if slo_x and p50 else None


def prefill_tokens_per_s(rows: Iterable[dict], system_tokens: int) -> Optional[float]:
    """Prefill's throughput in this run, from one setup's requests (same-DC PD's).

    What prefill computed for a turn is what its radix cache lacked: the prefill caches every
    prompt it serves (and the system prompt, from the warm-up), so turn t of a conversation lacks
    its prompt less turn t-1's (the last answer and the new turn), and turn 0 lacks all but the
    system prompt. Tokens over the forward time summed (``stages.prefill_forward``), so a
    forward's fixed cost is in the rate, as it is in a TTFT."""
    rows = [r for r in rows if not r.get("error") and r.get("stages")]
    prompts = {(r["conversation"], r["turn"]): r["prompt_tokens"] for r in rows}
    tokens = seconds = 0.0
    for r in rows:
        before = (system_tokens if r["turn"] == 0
                  else prompts.get((r["conversation"], r["turn"] - 1)))
        if before is None:
            continue
        tokens += max(r["prompt_tokens"] - before, 0)
        seconds += r["stages"]["prefill_forward"]
    return round(tokens / seconds, 1) if tokens > 0 and seconds > 0 else None


def setup_name(x: float) -> str:
    return f"pdd_slo_{x:.2f}x"


def frontier_points(setups: dict, budgets: dict) -> list[dict]:
    """One point per PDD setup run at a budget (``budgets``: setup name -> multiple of same-DC's
    P50), in budget order; same-DC's and naive cross-DC's as references (no relay, share 0)."""
    same = setups.get("same_dc_pd") or {}

    def ratio(a, b):
        return round(a / b, 3) if a and b else None

    points = []
    for name in sorted(budgets, key=budgets.get):
        s = setups[name]
        handoffs = s["outcomes"]["handoff_one_shot"] + s["outcomes"]["handoff_catch_up"]
        points.append({
            "setup": name, "budget_x": budgets[name], "budget_s": s.get("ttft_budget_s"),
            "ttft_p50_s": s["ttft_p50_s"], "ttft_p99_s": s["ttft_p99_s"],
            "p50_over_same_dc": ratio(s["ttft_p50_s"], same.get("ttft_p50_s")),
            "p99_over_same_dc": ratio(s["ttft_p99_s"], same.get("ttft_p99_s")),
            "relay_busy_share": s.get("relay_busy_share"),
            "within_budget_share": s.get("within_budget_share"),
            "handoff_share": round(handoffs / s["requests"], 3) if s["requests"] else None,
            "router_verdicts": s.get("router_verdicts"),
            "pipelines": s.get("pipelines"), "errors": s["errors"]})
    return points


def frontier(setups: dict, budgets: dict) -> dict:
    references = {name: {"ttft_p50_s": setups[name]["ttft_p50_s"],
                         "ttft_p99_s": setups[name]["ttft_p99_s"],
                         "relay_busy_share": setups[name].get("relay_busy_share"),
                         "within_budget_share": setups[name].get("within_budget_share")}
                  for name in ("same_dc_pd", "cross_dc_pd") if name in setups}
    return {"points": frontier_points(setups, budgets), "references": references,
            "busy_share": "relay decode tokens / (relay + main) decode tokens, from each "
                          "server's sglang:realtime_tokens_total{mode=decode} (SGLang exports "
                          "no decode-step counter)"}


def annotate(setups: dict, reference_budget_s: Optional[float]) -> None:
    """Each setup's within-budget share: against its own budget, else the run's reference."""
    for s in setups.values():
        budget = s.get("ttft_budget_s") or reference_budget_s
        s["within_budget_share"] = within_budget_share(s["rows"], budget)
        s["within_budget_of_s"] = None if budget is None else round(budget, 4)


def print_budget_table(setups: dict) -> None:
    if not any(s.get("within_budget_of_s") for s in setups.values()):
        return
    pct = lambda v: "-" if v is None else f"{v:.0%}"  # noqa: E731
    print(f"\n{'setup':<22} {'budget':>9} {'within':>7} {'relay busy':>10} router verdicts "
          "(re-placed)")
    for name, s in setups.items():
        budget = s.get("within_budget_of_s")
        shown = "-" if budget is None else f"{budget:.2f}s" + ("" if s.get("ttft_budget_s") else "*")
        print(f"{name:<22} {shown:>9} {pct(s.get('within_budget_share')):>7} "
              f"{pct(s.get('relay_busy_share')):>10} {s.get('router_verdicts') or ''}"
              + (f" (re-placed {s['router_retries']})" if s.get("router_retries") else ""))
    print("(* the run's reference budget: the setup's router had none)")


def print_frontier(table: dict) -> None:
    print("\nfrontier (load point): TTFT against the relay's busy share, per budget")
    print(f"{'budget':>14} {'P50':>7} {'P99':>7} {'xP50':>6} {'xP99':>6} {'relay busy':>10} "
          f"{'within':>7} {'handoffs':>8} {'err':>4}")
    f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    for p in table["points"]:
        print(f"{p['budget_x']:>5.2f}x {f(p['budget_s'], '.2f'):>6}s {f(p['ttft_p50_s'], '.2f'):>7} "
              f"{f(p['ttft_p99_s'], '.2f'):>7} {f(p['p50_over_same_dc'], '.2f'):>6} "
              f"{f(p['p99_over_same_dc'], '.2f'):>6} {f(p['relay_busy_share'], '.0%'):>10} "
              f"{f(p['within_budget_share'], '.0%'):>7} {f(p['handoff_share'], '.0%'):>8} "
              f"{p['errors']:>4}")
    for name, ref in table["references"].items():
        print(f"{name:>14} {f(ref['ttft_p50_s'], '.2f'):>7} {f(ref['ttft_p99_s'], '.2f'):>7}")
