"""Whole-cluster properties: conservation, a hand-computed request, determinism, monotonicity,
and the P->RLD-only collapse."""

from dataclasses import replace

import pytest

from pdd_sglang.policy import Pipeline, PolicyConfig
from pdd_sglang.sim.cluster import ClusterConfig, Setup, simulate
from pdd_sglang.sim.experiments import detect_collapse, quarter_stats
from pdd_sglang.sim.profiles import InstanceCost, load_hardware, load_link, load_model
from pdd_sglang.sim.workload import AgenticConfig, Request, generate_agentic

SMALL = AgenticConfig(rate_per_s=3.0, duration_s=150.0, seed=5)


@pytest.fixture(scope="module")
def small_workload():
    return generate_agentic(SMALL)


@pytest.mark.parametrize("setup", list(Setup))
def test_every_request_finishes_once_and_bytes_balance(setup, small_workload):
    requests, warmup = small_workload
    summary, cluster = simulate(ClusterConfig(setup=setup), requests, warmup)
    assert [j.completions for j in cluster.jobs] == [1] * len(requests)
    assert summary.finished == len(requests)
    assert all(j.first_token_s <= j.finish_s for j in cluster.jobs)
    assert cluster.wan.bytes_sent == pytest.approx(cluster.wan.bytes_received)
    kv_bytes = sum(j.wan_bytes for j in cluster.jobs)
    control = cluster.wan.bytes_received - kv_bytes
    assert 0 <= control <= 2000 * cluster.wan.messages_sent      # the rest are control messages
    for server in cluster.mains + cluster.relays:
        assert server.kv_used == 0 and not server.reserved and not server.running


def test_handoff_delivers_every_token_exactly_once(small_workload):
    requests, warmup = small_workload
    ids = [r.request_id for r in requests]
    _, cluster = simulate(ClusterConfig(setup=Setup.PDD), requests, warmup, traced_ids=ids)
    handed = [j for j in cluster.jobs if j.pipeline is Pipeline.PREFILL_RELAY_MAIN
              and j.finished_at == "main"]
    assert handed, "the workload should exercise the handoff"
    for job in handed:
        times = [job.first_token_s] + job.token_times
        assert len(times) == job.request.output_tokens
        assert times == sorted(times)
        assert job.handoff_gap_s > 0


def test_single_request_same_dc_matches_hand_computation():
    model = load_model("moe_1t_50kb")
    prefill = InstanceCost(load_hardware("gpu_a"), model)
    decode = InstanceCost(load_hardware("gpu_a"), model)      # same_dc_pd is homogeneous
    rdma = load_link("rdma_intra_dc")
    request = Request(0, 1.0, 4096, 3, tuple(range(8)), tuple(range(8)))
    summary, cluster = simulate(ClusterConfig(setup=Setup.SAME_DC_PD), [request])
    kv_landed = 1.0 + prefill.hardware.dispatch_latency_s + prefill.prefill_seconds(4096, 0) + 4096 * 50_000 / rdma.bytes_per_s + rdma.rtt_s / 2
    assert summary.ttft_p50_s == pytest.approx(kv_landed - 1.0, rel=1e-9)
    steps = decode.forward_seconds(1, 4096) + decode.forward_seconds(1, 4097)
    assert cluster.jobs[0].finish_s == pytest.approx(kv_landed + steps, rel=1e-9)


def test_same_seed_same_results_other_seed_differs():
    def run(seed):
        requests, warmup = generate_agentic(replace(SMALL, seed=seed))
        return simulate(ClusterConfig(setup=Setup.PDD, seed=seed), requests, warmup)[0].as_dict()
    assert run(5) == run(5)
    assert run(5) != run(6)


def test_more_bandwidth_never_raises_ttft(small_workload):
    requests, warmup = small_workload
    previous = None
    for scale in (0.5, 1.0, 2.0, 8.0):
        summary, _ = simulate(ClusterConfig(setup=Setup.CROSS_DC_PD, wan_bandwidth_scale=scale),
                              requests, warmup)
        current = (summary.ttft_p50_s, summary.ttft_p90_s, summary.ttft_p99_s, summary.ttft_mean_s)
        if previous:
            assert all(c <= p + 1e-9 for c, p in zip(current, previous)), (scale, current, previous)
        previous = current


@pytest.mark.parametrize("setup", [Setup.CROSS_DC_PD, Setup.CROSS_DC_PD_DRC])
def test_a_larger_per_flow_window_never_raises_ttft(setup, small_workload):
    # Setups without placement decisions: PDD's placement changes with the predicted copy time
    # (a larger window sends more requests straight to main), so its TTFT need not be monotone.
    requests, warmup = small_workload
    previous = None
    for window in (2e6, 8e6, 32e6, 128e6):
        summary, _ = simulate(ClusterConfig(setup=setup, wan_link="wan_10g",
                                            wan_window_bytes=window), requests, warmup)
        current = (summary.ttft_p50_s, summary.ttft_p90_s, summary.ttft_p99_s, summary.ttft_mean_s)
        if previous:
            assert all(c <= p + 1e-9 for c, p in zip(current, previous)), (window, current, previous)
        previous = current


def test_higher_hit_never_raises_wan_bytes(small_workload):
    # Same requests; main's DRC hit is raised by giving it more room (0 = no DRC at all).
    requests, warmup = small_workload
    hits, wan_bytes = [], []
    for capacity in (0, 200_000, 2_000_000, 16_000_000):
        summary, _ = simulate(ClusterConfig(setup=Setup.CROSS_DC_PD_DRC, main_cache_tokens=capacity,
                                            use_drc=capacity > 0), requests, warmup)
        hits.append(summary.main_hit)
        wan_bytes.append(summary.wan_bytes)
    assert hits == sorted(hits) and hits[0] == 0 and hits[-1] > 0.85
    assert wan_bytes == sorted(wan_bytes, reverse=True)
    assert wan_bytes[0] > 5 * wan_bytes[-1]


def test_relay_only_collapses_where_pdd_stays_stable():
    # 900 s as in F6: with the prefill cost of DP attention the relay saturates after ~10 min
    requests, warmup = generate_agentic(AgenticConfig(rate_per_s=3.0, duration_s=900.0, seed=1))
    _, pdd = simulate(ClusterConfig(setup=Setup.PDD), requests, warmup)
    _, relay_only = simulate(ClusterConfig(setup=Setup.RELAY_ONLY), requests, warmup)
    assert detect_collapse(relay_only) and not detect_collapse(pdd)
    # the brief's mechanism: requests that hit at prefill keep missing at main, so they are
    # sent to the relay again and again
    def relay_share_of_prefill_hits(cluster, quarter):
        jobs = sorted(cluster.jobs, key=lambda j: j.request.arrival_s)
        part = jobs[quarter * len(jobs) // 4:(quarter + 1) * len(jobs) // 4]
        hits = [j for j in part if j.prefill_cached_tokens >= 0.9 * j.request.input_tokens]
        return sum(j.pipeline is not Pipeline.PREFILL_MAIN for j in hits) / len(hits)
    assert relay_share_of_prefill_hits(relay_only, 3) > 0.5
    assert relay_share_of_prefill_hits(pdd, 3) < 0.35
    # the relay's share climbs: the share still reaching main at least halves
    first, last = quarter_stats(relay_only)[0]["relay_share"], quarter_stats(relay_only)[3]["relay_share"]
    assert 1 - last < 0.5 * (1 - first)


def test_reactive_filter_saves_wan_bytes_and_relay_time(small_workload):
    requests, warmup = small_workload
    off, _ = simulate(ClusterConfig(policy=PolicyConfig(singular_reactive=False)), requests, warmup)
    on, _ = simulate(ClusterConfig(), requests, warmup)
    assert on.wan_bytes < off.wan_bytes
    assert on.relay_busy_request_s < off.relay_busy_request_s


@pytest.mark.parametrize("told_bytes_per_s, expected", [(1e12, Pipeline.PREFILL_MAIN),
                                                         (1e8, Pipeline.PREFILL_RELAY_MAIN)])
def test_the_router_places_with_the_line_it_was_told(told_bytes_per_s, expected):
    """validate_sim replays the demo, whose router was told the line's rate and RTT
    (--wan-gbps, --wan-rtt-ms): the simulated router must place with those figures, not with
    the line's profile (its calibrated fixed cost once sent every request through the relay)."""
    request = Request(0, 1.0, 4096, 3, tuple(range(8)), tuple(range(8)))
    told = ClusterConfig(setup=Setup.PDD, router_wan_bytes_per_s=told_bytes_per_s,
                         router_wan_rtt_s=0.001)
    _, cluster = simulate(told, [request])
    assert cluster.router_line() == (told_bytes_per_s, 0.001)
    assert cluster.jobs[0].pipeline is expected
    _, untold = simulate(ClusterConfig(setup=Setup.PDD), [request])
    wan = untold.wan
    assert untold.router_line() == (min(wan.rate, wan.per_flow_cap),
                                    wan.profile.rtt_s + wan.transfer_fixed_s)
