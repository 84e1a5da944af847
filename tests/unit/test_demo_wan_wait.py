"""The demo's P->MD WAN wait over its copy alone (issue 34's idle-line goal), on hand-made rows:
which requests count, the alone time's arithmetic, the codec's ratio, and the bar's check, which
is "not measured" (None, so the bar is not met) without an idle-line P->MD request."""

from __future__ import annotations

import pytest

from pdd_sglang.dev.demo import wan_wait
from pdd_sglang.dev.demo.report import STAGES, the_bar

# 8 Mbit/s: 1e6 bytes/s, so 1000 uncached tokens of 1000 bytes are 1 s on the line
LINE = {"rate_mbit": 8.0, "rtt_ms": 40.0}
KV = 1000
STEP = 0.06  # same-DC's kv_and_first_token P50 below


def _row(rid, wait_s, prompt=1100, cached=100, outcome="main", pipeline="prefill_main",
         error=None):
    stages = None if wait_s is None else {s: 0.0 for s in STAGES} | {"kv_and_first_token": wait_s}
    return {"rid": rid, "prompt_tokens": prompt, "cached_tokens": cached, "outcome_kind": outcome,
            "pipeline": pipeline, "error": error, "stages": stages}


def _setup(rows, placement="congestion-aware"):
    return {"rows": rows, "placement": placement}


def _same_dc(step=STEP):
    stages = {"requests_with_split": 3,
              "all": {s: {"p50_s": 0.0} for s in STAGES} | {"kv_and_first_token": {"p50_s": step}}}
    return {"rows": [], "placement": None, "stages": stages}


def _figures(setups, codec=None, latency=None):
    return wan_wait.wait_over_alone({"same_dc_pd": _same_dc(), **setups}, LINE, KV, codec,
                                    latency)


def _latency(uncached_tokens, fixed_s=0.3, s_per_token=0.002, step=0.04):
    """The latency point: naive cross-DC PD's copies alone on the line, kv_and_first_token =
    fixed_s + s_per_token x uncached tokens; same-DC's first step ``step`` (STEP at load)."""
    rows = [_row(f"x{n}", fixed_s + s_per_token * n, prompt=100 + n, cached=100,
                 pipeline="prefill_main") for n in uncached_tokens]
    return {"same_dc_pd": _same_dc(step), "cross_dc_pd": {"rows": rows, "placement": None}}


def test_only_p_to_md_requests_main_answered_count_and_alone_adds_up():
    idle = _setup([
        _row("a", 2.2),                                   # alone 1 + 0.04 + 0.06 = 1.1: x2.0
        _row("b", 0.55, prompt=600, cached=100),          # alone 0.5 + 0.1 = 0.6
        _row("c", 9.0, outcome="handoff_one_shot", pipeline="prefill_relay_main"),
        _row("d", 9.0, pipeline="prefill_relay_main"),    # main after a lost relay: not P->MD
        _row("e", 9.0, error="boom"),
    ], placement="idle-line")
    figures = _figures({"pdd_idle_line": idle})
    s = figures["setups"]["pdd_idle_line"]
    assert figures["idle_line_setup"] == "pdd_idle_line"
    assert s["p_to_md_requests"] == 2 and s["measured"] == 2
    a, b = s["requests"]
    assert (a["rid"], a["wait_s"], a["alone_s"], a["uncached_tokens"]) == ("a", 2.2, 1.1, 1000)
    assert a["wait_over_alone"] == pytest.approx(2.0)
    assert b["alone_s"] == pytest.approx(0.6) and b["wait_over_alone"] == pytest.approx(0.917)
    # numpy's linear percentile over [0.917, 2.0]
    assert s["wait_over_alone_p50"] == pytest.approx(1.458, abs=1e-3)
    assert s["wait_over_alone_p90"] == pytest.approx(1.892, abs=1e-3)
    assert figures["inputs"]["main_first_step_s"] == STEP
    assert wan_wait.idle_line_check(figures) is False


def test_alone_is_measured_on_the_latency_points_copies_alone_on_the_line():
    """alone = the latency point's fit (0.3 s + 2 ms a token) + main's load at this point
    (same-DC's first step 0.06 s at load less 0.04 s at latency); the line floor beside it."""
    idle = _setup([_row("a", 2.3), _row("b", 1.0, prompt=600, cached=100)], "idle-line")
    figures = _figures({"pdd_idle_line": idle}, latency=_latency((20, 80, 400, 1500)))
    model = figures["inputs"]["alone_model"]
    assert model == {"fixed_s": pytest.approx(0.3), "s_per_token": pytest.approx(0.002),
                     "main_load_s": pytest.approx(0.02)}
    assert "MEASURED" in figures["inputs"]["alone_model_from"]
    a, b = figures["setups"]["pdd_idle_line"]["requests"]
    assert a["alone_s"] == pytest.approx(0.3 + 2.0 + 0.02)
    assert a["line_floor_s"] == pytest.approx(1.1)          # 1 s + 0.04 + 0.06, as before
    assert a["wait_over_alone"] == pytest.approx(2.3 / 2.32, abs=1e-3)
    assert b["alone_s"] == pytest.approx(0.3 + 1.0 + 0.02)
    s = figures["setups"]["pdd_idle_line"]
    # numpy's linear percentile over wait / floor [1.0 / 0.6, 2.3 / 1.1]
    assert s["wait_over_line_floor_p90"] == pytest.approx(1 / 0.6 + 0.9 * (2.3 / 1.1 - 1 / 0.6),
                                                          abs=1e-3)
    assert wan_wait.idle_line_check(figures) is True


def test_a_copy_that_waited_behind_others_still_fails_against_the_measured_alone():
    idle = _setup([_row("a", 7.0, prompt=200, cached=100)], "idle-line")  # alone 0.52 s
    figures = _figures({"pdd_idle_line": idle}, latency=_latency((20, 80, 400, 1500)))
    assert figures["setups"]["pdd_idle_line"]["wait_over_alone_p90"] > 10
    assert wan_wait.idle_line_check(figures) is False


@pytest.mark.parametrize("sizes, fixed, per_token", [((50, 50, 50, 900), 0.3, 0.002),  # 2 sizes
                                                     ((20, 80, 400), 2.0, -0.001),    # shrinks
                                                     ((20, 80, 400), -0.1, 0.002)])   # < 0 s
def test_without_a_usable_latency_point_alone_is_the_line_floor(sizes, fixed, per_token):
    figures = _figures({"pdd_idle_line": _setup([_row("a", 2.2)], "idle-line")},
                       latency=_latency(sizes, fixed, per_token))
    assert figures["inputs"]["alone_model"] is None
    request = figures["setups"]["pdd_idle_line"]["requests"][0]
    assert request["alone_s"] == request["line_floor_s"] == pytest.approx(1.1)


def test_the_codecs_ratio_shortens_the_copy():
    codec = {"flag": "auto", "coded_copies": 3, "one_sided_copies": 1,
             "coded_raw_bytes": 2_000_000, "coded_wire_bytes": 1_000_000}
    figures = _figures({"pdd_idle_line": _setup([_row("a", 0.9)], "idle-line")}, codec)
    assert figures["inputs"]["raw_over_wire"] == 2.0
    request = figures["setups"]["pdd_idle_line"]["requests"][0]
    assert request["alone_s"] == pytest.approx(0.5 + 0.04 + STEP)
    assert wan_wait.idle_line_check(figures) is True  # x1.5, on the bound


@pytest.mark.parametrize("codec, ratio", [
    (None, 1.0),                                           # a run before the codec: raw
    ({"flag": "raw"}, 1.0),
    ({"flag": "auto", "coded_raw_bytes": 0, "coded_wire_bytes": 0}, 1.0),  # nothing coded
    ({"flag": "auto"}, None),                              # counts not reported: unknown
    ({"flag": "auto", "unread": "ConnectionError()"}, None),
])
def test_raw_over_wire(codec, ratio):
    assert wan_wait.raw_over_wire(codec)[0] == ratio


def test_an_unknown_ratio_or_cache_hit_gives_no_figure_rather_than_a_guess():
    rows = [_row("a", 0.9, cached=None), _row("b", None)]
    figures = _figures({"pdd_idle_line": _setup(rows, "idle-line")}, {"flag": "auto"})
    s = figures["setups"]["pdd_idle_line"]
    assert s["p_to_md_requests"] == 2 and s["measured"] == 0
    assert s["wait_over_alone_p90"] is None
    assert all(q["alone_s"] is None for q in s["requests"])
    assert wan_wait.idle_line_check(figures) is None


def test_no_p_to_md_request_is_count_0_and_not_measured():
    figures = _figures({"pdd": _setup([_row("a", 0.4)]),
                        "pdd_idle_line": _setup([], "idle-line")})
    assert figures["setups"]["pdd_idle_line"] == {
        "p_to_md_requests": 0, "measured": 0, "wait_over_alone_p50": None,
        "wait_over_alone_p90": None, "wait_over_line_floor_p90": None, "requests": []}
    assert figures["setups"]["pdd"]["p_to_md_requests"] == 1
    assert wan_wait.idle_line_check(figures) is None
    assert "pdd_idle_line 0 P->MD" in wan_wait.summary_line(figures)


def test_the_idle_line_setup_is_pdd_under_placement_idle_line():
    setups = {"pdd": _setup([_row("a", 0.9)], "idle-line"),
              "pdd_congestion_aware": _setup([])}
    assert wan_wait.idle_line_setup(setups) == "pdd"
    assert wan_wait.idle_line_setup({"pdd": _setup([])}) is None  # e.g. the frontier's


def _bar_setup(requests=24, **outcomes):
    counts = dict.fromkeys(("handoff_one_shot", "handoff_catch_up", "relay_finished", "main",
                            "error"), 0) | outcomes
    stages = {"all": {s: {"p50_s": 0.1, "p99_s": 0.1} for s in STAGES}}
    return {"ttft_p50_s": 1.0, "ttft_p99_s": 1.0, "requests": requests, "errors": 0,
            "outcomes": counts, "stages": stages, "rows": []}


@pytest.mark.parametrize("wait, check, met", [(0.9, True, True), (2.2, False, False),
                                              (None, None, False)])
def test_the_bar_checks_the_idle_line_setup(wait, check, met):
    rows = [] if wait is None else [_row("a", wait)]
    figures = _figures({"pdd_idle_line": _setup(rows, "idle-line")},
                       {"flag": "auto", "coded_raw_bytes": 2, "coded_wire_bytes": 1})
    setups = {"same_dc_pd": _bar_setup(main=24),
              "cross_dc_pd": {**_bar_setup(main=24), "ttft_p99_s": 3.0},
              "pdd": _bar_setup(handoff_one_shot=24)}
    bar = the_bar(setups, {}, figures)
    assert bar["checks"][wan_wait.CHECK] is check
    assert bar["met"] is met
    assert bar["idle_line_p_to_md_requests"] == len(rows)
    # without the idle-line setup (the frontier), the bar has no such check
    assert wan_wait.CHECK not in the_bar(setups, {}, _figures({}))["checks"]
    assert the_bar(setups, {})["met"] is True
