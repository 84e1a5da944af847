"""The demo's TTFT budget: the budget of a setup, the share of requests within it, the relay's busy
share from the servers' decode counters, the prefill rate measured in the run, the frontier's
points and figure, and the run order (same-DC PD before any PDD setup that needs its P50)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

from pdd_sglang.dev.demo import budget, figures

REPO = Path(__file__).resolve().parents[2]

METRICS = """\
# HELP sglang:realtime_tokens_total Total number of tokens processed
# TYPE sglang:realtime_tokens_total counter
sglang:realtime_tokens_total{model_name="m",tp_rank="0",mode="prefill_compute"} 900.0
sglang:realtime_tokens_total{model_name="m",tp_rank="0",mode="decode"} 1234.0
sglang:realtime_tokens_total{model_name="m",tp_rank="1",mode="decode"} 6.0
sglang:realtime_tokens_created{model_name="m",tp_rank="0",mode="decode"} 1.7e9
sglang:num_running_reqs{model_name="m"} 3.0
"""


def test_decode_tokens_sums_the_decode_mode_of_every_scheduler():
    assert budget.decode_tokens(METRICS) == 1240.0


def test_decode_tokens_without_the_counter_is_unknown_and_before_any_decode_zero():
    assert budget.decode_tokens("sglang:num_running_reqs 0.0\n") is None
    declared = "# TYPE sglang:realtime_tokens_total counter\n"
    assert budget.decode_tokens(declared) == 0


def test_router_verdicts_and_their_delta():
    before = budget.router_verdicts('pdd_router_ttft_budget_total{verdict="within"} 1.0\n')
    after = budget.router_verdicts('pdd_router_ttft_budget_total{verdict="within"} 8.0\n'
                                   'pdd_router_ttft_budget_total{verdict="over"} 2.0\n'
                                   'pdd_router_ttft_budget_created{verdict="over"} 17.0\n')
    assert after == {"within": 8.0, "over": 2.0}
    assert budget.counter_delta(before, after) == {"within": 7, "over": 2}


def test_router_retries_by_cause():
    text = ('pdd_router_retries_total{cause="splice"} 1.0\n'
            'pdd_router_retries_total{cause="relay_lost"} 2.0\n'
            'pdd_router_retries_created{cause="splice"} 17.0\n')
    assert budget.router_retries(text) == {"splice": 1.0, "relay_lost": 2.0}
    assert budget.router_retries("") == {}


@pytest.mark.parametrize("relay, main, share", [
    (300, 700, 0.3), (0, 500, 0.0), (None, 500, 0.0), (500, 0, 1.0),
    (None, None, None), (0, 0, None), (10, None, None)])
def test_busy_share(relay, main, share):
    assert budget.busy_share(relay, main) == share


def test_busy_share_refuses_negative_counts():
    with pytest.raises(ValueError, match="negative"):
        budget.busy_share(-1, 10)


def row(conversation=0, turn=0, ttft=1.0, error=None, prompt=100, forward=0.1):
    return {"conversation": conversation, "turn": turn, "ttft_s": ttft, "error": error,
            "prompt_tokens": prompt, "stages": None if error else {"prefill_forward": forward}}


def test_within_budget_share_counts_failures_as_missed():
    rows = [row(ttft=0.5), row(ttft=1.0), row(ttft=1.01), row(ttft=None, error="HTTP 500")]
    assert budget.within_budget_share(rows, 1.0) == 0.5
    assert budget.within_budget_share(rows, None) is None
    assert budget.within_budget_share([], 1.0) is None


def test_budget_seconds():
    assert budget.budget_seconds(800.0, None, None) == 0.8
    assert budget.budget_seconds(None, 1.15, 2.0) == pytest.approx(2.3)
    assert budget.budget_seconds(None, None, 2.0) is None
    with pytest.raises(ValueError, match="not both"):
        budget.budget_seconds(800.0, 1.15, 2.0)
    with pytest.raises(ValueError, match="same-DC PD measured first"):
        budget.budget_seconds(None, 1.15, None)
    with pytest.raises(ValueError, match="> 0"):
        budget.budget_seconds(None, 0.0, 2.0)


def test_prefill_rate_counts_what_the_prefill_cache_lacked():
    # system prompt 1000 tokens; turn 0 lacks 200 (1200 - 1000), turn 1 lacks 500 (1700 - 1200),
    # conversation 1's turn 0 lacks 100; the failed row and the orphan turn count nothing.
    rows = [row(0, 0, prompt=1200, forward=0.2), row(0, 1, prompt=1700, forward=0.4),
            row(1, 0, prompt=1100, forward=0.2), row(1, 1, prompt=1500, error="x"),
            row(2, 3, prompt=5000, forward=9.0)]
    assert budget.prefill_tokens_per_s(rows, 1000) == pytest.approx(800 / 0.8)
    assert budget.prefill_tokens_per_s([], 1000) is None


def test_setup_budget_measures_the_rate_unless_given():
    same = {"ttft_p50_s": 2.0, "rows": [row(0, 0, prompt=1200, forward=0.5)]}
    assert budget.setup_budget(None, None, None, same, 1000) == (None, None)
    assert budget.setup_budget(None, 1.5, None, same, 1000) == (3.0, 400.0)
    assert budget.setup_budget(None, 1.5, 99.0, same, 1000) == (3.0, 99.0)
    assert budget.setup_budget(500.0, None, None, None, 1000) == (0.5, None)
    assert budget.reference_budget(None, 1.15, same) == pytest.approx(2.3)
    assert budget.reference_budget(None, None, same) is None


def setup(p50, p99, busy, handoffs=0, requests=10, errors=0, budget_s=None, ttfts=()):
    return {"ttft_p50_s": p50, "ttft_p99_s": p99, "relay_busy_share": busy, "requests": requests,
            "errors": errors, "ttft_budget_s": budget_s, "pipelines": {},
            "outcomes": {"handoff_one_shot": handoffs, "handoff_catch_up": 0},
            "rows": [row(ttft=t) for t in ttfts]}


def synthetic_load() -> tuple[dict, dict]:
    setups = {"same_dc_pd": setup(1.0, 1.6, 0.0, ttfts=(0.9, 1.0, 1.2)),
              "cross_dc_pd": setup(3.0, 7.0, 0.0, ttfts=(2.0, 3.0, 7.0)),
              budget.setup_name(3.0): setup(1.5, 3.0, 0.1, 1, budget_s=3.0, ttfts=(1.0, 3.5)),
              budget.setup_name(1.0): setup(1.05, 1.7, 0.6, 6, budget_s=1.0, ttfts=(0.9, 1.1)),
              budget.setup_name(1.15): setup(1.1, 1.8, 0.4, 4, budget_s=1.15,
                                             ttfts=(1.0, 1.1, 1.15, 2.0))}
    return setups, {budget.setup_name(x): x for x in (3.0, 1.0, 1.15)}


def test_frontier_points_one_per_budget_in_budget_order():
    setups, budgets = synthetic_load()
    budget.annotate(setups, reference_budget_s=1.15)
    table = budget.frontier(setups, budgets)
    points = table["points"]
    assert [p["budget_x"] for p in points] == [1.0, 1.15, 3.0]
    first = points[0]
    assert first["setup"] == "pdd_slo_1.00x" and first["budget_s"] == 1.0
    assert first["p50_over_same_dc"] == 1.05 and first["p99_over_same_dc"] == pytest.approx(1.0625,
                                                                                          abs=1e-3)
    assert first["relay_busy_share"] == 0.6 and first["handoff_share"] == 0.6
    assert first["within_budget_share"] == 0.5  # against its own budget, 1.0 s
    assert points[1]["within_budget_share"] == 0.75  # a TTFT equal to the budget is within
    # Setups without a budget of their own: the reference budget (1.15 s).
    assert setups["same_dc_pd"]["within_budget_share"] == pytest.approx(2 / 3, abs=1e-4)
    assert setups["cross_dc_pd"]["within_budget_of_s"] == 1.15
    assert table["references"]["cross_dc_pd"]["ttft_p99_s"] == 7.0


def test_frontier_figure_is_drawn(tmp_path):
    setups, budgets = synthetic_load()
    budget.annotate(setups, 1.15)
    path = tmp_path / "frontier.png"
    figures.plot_frontier(budget.frontier(setups, budgets), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def load_demo_script():
    spec = importlib.util.spec_from_file_location("pdd_demo_script", REPO / "scripts" / "demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("argv", [["--frontier"], ["--ttft-slo-x", "1.15"], []])
def test_same_dc_runs_before_every_budgeted_setup_of_its_point(argv):
    demo = load_demo_script()
    args = SimpleNamespace(frontier="--frontier" in argv, frontier_x=budget.FRONTIER_X,
                           ttft_slo_x=1.15 if "--ttft-slo-x" in argv else None,
                           placement="congestion-aware")
    servers = [SimpleNamespace(name=n) for n in ("main-a", "main-b", "relay")]
    plan = demo.plan_setups(args, *servers, other="pdd_idle_line")
    seen: dict = {}
    for point, name, _main, relay, _placement, slo_x in plan:
        seen.setdefault(point, []).append(name)
        if slo_x is not None:
            assert relay is not None and "same_dc_pd" in seen[point], plan
    budgeted = [slo_x for *_, slo_x in plan if slo_x is not None]
    if args.frontier:
        assert budgeted == sorted(budget.FRONTIER_X) and set(seen) == {"load"}
        assert seen["load"][:2] == ["same_dc_pd", "cross_dc_pd"]
    else:
        assert budgeted == ([1.15] * 2 if args.ttft_slo_x else [])
        # The budget-free PDD runs beside the budget run at the load point, without a budget,
        # and so does the other placement's (its P->MD requests test the line's class order).
        free = [(point, name, placement, slo_x) for point, name, _m, _r, placement, slo_x in plan
                if name in (demo.NO_BUDGET, "pdd_idle_line")]
        assert free == [("load", demo.NO_BUDGET, "congestion-aware", None),
                        ("load", "pdd_idle_line", "idle-line", None)]
        assert "pdd" in seen["load"]


@pytest.mark.parametrize("argv, message", [
    (["--frontier", "--ttft-slo-x", "1.2"], "--frontier sets"),
    (["--ttft-slo-ms", "500", "--ttft-slo-x", "1.2"], "not allowed with"),
    (["--ttft-slo-x", "0"], "must be > 0"),
    (["--frontier-x", "1,x"], "separated by commas"),
    (["--frontier-x", "1,-2"], "positive multiples")])
def test_bad_budget_options_are_refused_with_their_reason(argv, message, capsys):
    demo = load_demo_script()
    with pytest.raises(SystemExit) as exit_:
        demo.main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
