"""The operating point's configuration, congestion-aware placement, and the planner."""

import pytest

from pdd_sglang.policy import Pipeline
from pdd_sglang.sim import plan
from pdd_sglang.sim.cluster import ClusterConfig, Setup, simulate
from pdd_sglang.sim.operating_point import checks, operating_point
from pdd_sglang.sim.workload import AgenticConfig, Request


def test_the_operating_point_is_read_from_configs():
    point = operating_point(quick=True)
    assert point.workload.max_context_tokens == 65536
    assert point.workload.duration_s < operating_point(quick=False).workload.duration_s
    same = point.cluster(Setup.SAME_DC_PD)
    assert same.decode_hardware == "gpu_a" and same.main_instances == point.gpu_a_decode_instances
    pdd = point.cluster(Setup.PDD)
    assert pdd.decode_hardware == "gpu_b" and pdd.main_instances == point.base.main_instances
    assert pdd.wan_link == "wan_f1"


def test_checks_apply_the_issues_tolerances():
    ttft = {"same_dc_pd": {"p50": 4.6}, "cross_dc_pd": {"p50": 8.5, "p90": 18.3, "p99": 22.0}}
    within = {row[0]: row[4] for row in checks(ttft)}
    assert within == {"same_dc_pd TTFT P50 s": True, "cross_dc_pd TTFT P50 s": False,
                      "cross_dc_pd TTFT P90 s": True, "cross_dc_pd TTFT P99 s": False}


def busy_line_then_a_small_request():
    big = Request(0, 0.0, 40 * 1024, 400, tuple(range(1000, 1080)), tuple(range(1000, 1080)))
    small = Request(1, 4.5, 600, 8, (5000, 5001), (5000,))
    return [big, small]


@pytest.mark.parametrize("placement,expected", [("idle-line", Pipeline.PREFILL_MAIN),
                                                ("congestion-aware", Pipeline.PREFILL_RELAY_MAIN)])
def test_congestion_aware_placement_sees_the_copy_already_on_the_line(placement, expected):
    cfg = ClusterConfig(setup=Setup.PDD, wan_link="wan_10g", placement=placement)
    _, cluster = simulate(cfg, busy_line_then_a_small_request())
    big, small = cluster.jobs
    assert big.pipeline is Pipeline.PREFILL_RELAY_MAIN       # 2 GB: worth hiding either way
    assert big.prefill_done_s < small.prefill_done_s < big.prefill_done_s + 2.0   # copy in flight
    assert small.pipeline is expected
    assert all(job.completions == 1 for job in cluster.jobs)


def test_an_unknown_placement_is_a_clear_error():
    with pytest.raises(ValueError, match="placement must be one of"):
        ClusterConfig(placement="psychic")


def test_planner_compares_pdd_with_both_same_dc_setups():
    # 10 s of arrivals: the planner's search doubles the rate up to 256 req/s, and a minute of
    # those took a minute of the suite (20 s: 25 s of it); what is checked here is the layouts,
    # costs and gains.
    workload = AgenticConfig(rate_per_s=1.0, duration_s=10.0, seed=2)
    base = ClusterConfig(prefill_instances=1)
    found = plan.plan_setups(base, workload, plan.Sla(), [1], [2], [1])
    best = {name: rows[0] for name, rows in found.items()}
    assert set(best) == {"same_dc_pd", "same_dc_hetero_pd", "pdd"}
    assert best["same_dc_pd"].gpus == {"gpu_a": 16 + 32}
    assert best["same_dc_hetero_pd"].gpus == {"gpu_a": 16, "gpu_b": 16}
    assert best["pdd"].gpus == {"gpu_a": 32, "gpu_b": 16}
    # PDD pays the relay and the line on top of the hetero layout
    assert best["pdd"].cost_per_hour == pytest.approx(
        best["same_dc_hetero_pd"].cost_per_hour + 16 * 2.0 + 0.66)
    gains = plan.bcr_gains(best)
    for name, gain in gains.items():
        ratio = best["pdd"].bcr_requests_per_dollar / best[name].bcr_requests_per_dollar
        assert gain == pytest.approx(100 * (ratio - 1))
