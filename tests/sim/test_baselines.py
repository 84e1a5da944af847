"""The report's baselines: what each setup ships over the WAN and where it decodes, and the
split of PDD's TTFT cut by mechanism."""

import pytest

from pdd_sglang.sim.cluster import ClusterConfig, Setup, simulate
from pdd_sglang.sim.experiments import ttft_reductions
from pdd_sglang.sim.profiles import InstanceCost, load_hardware, load_link, load_model
from pdd_sglang.sim.workload import AgenticConfig, Request, generate_agentic

KV = load_model("moe_1t_50kb").kv_bytes_per_token


def two_turns():
    """Turn 1: 10 blocks; turn 2, long after, re-sends them and adds 2 more."""
    first = Request(0, 0.0, 10 * 512, 1, tuple(range(10)), tuple(range(10)), conversation_id=1)
    second = Request(1, 60.0, 12 * 512, 1, tuple(range(12)), tuple(range(12)), conversation_id=1)
    return [first, second]


def test_naive_cross_dc_ships_every_prompt_whole():
    requests, warmup = generate_agentic(AgenticConfig(rate_per_s=2.0, duration_s=60.0, seed=3))
    summary, cluster = simulate(ClusterConfig(setup=Setup.CROSS_DC_PD), requests, warmup)
    assert summary.finished == len(requests)
    for job in cluster.jobs:
        assert job.wan_bytes == job.request.input_tokens * KV
        assert job.main_cached_tokens == 0
    assert summary.wan_bytes == pytest.approx(summary.wan_bytes_without_drc, rel=1e-9)


def test_drc_ships_exactly_mains_uncached_suffix():
    naive, _ = simulate(ClusterConfig(setup=Setup.CROSS_DC_PD), two_turns())
    drc, cluster = simulate(ClusterConfig(setup=Setup.CROSS_DC_PD_DRC), two_turns())
    first, second = cluster.jobs
    assert first.wan_bytes == 10 * 512 * KV                 # nothing cached yet
    assert second.main_cached_tokens == 10 * 512
    assert second.wan_bytes == 2 * 512 * KV                 # only the two new blocks
    assert naive.wan_bytes == pytest.approx((10 + 12) * 512 * KV)
    assert drc.wan_bytes == pytest.approx((10 + 2) * 512 * KV)
    assert drc.ttft_p50_s < naive.ttft_p50_s


@pytest.mark.parametrize("setup,decode", [(Setup.SAME_DC_PD, "gpu_a"),
                                          (Setup.SAME_DC_HETERO_PD, "gpu_b")])
def test_same_dc_setups_decode_on_their_own_hardware_without_the_wan(setup, decode):
    model = load_model("moe_1t_50kb")
    prefill = InstanceCost(load_hardware("gpu_a"), model)
    decoder = InstanceCost(load_hardware(decode), model)
    rdma = load_link("rdma_intra_dc")
    request = Request(0, 1.0, 4096, 2, tuple(range(8)), tuple(range(8)))
    summary, cluster = simulate(ClusterConfig(setup=setup), [request])
    landed = 1.0 + prefill.hardware.dispatch_latency_s + prefill.prefill_seconds(4096, 0) + 4096 * KV / rdma.bytes_per_s + rdma.rtt_s / 2
    assert cluster.jobs[0].finish_s == pytest.approx(landed + decoder.forward_seconds(1, 4096),
                                                     rel=1e-9)
    assert summary.wan_bytes == 0


def test_mechanism_split_adds_up_to_the_total_cut():
    requests, warmup = generate_agentic(AgenticConfig(rate_per_s=2.5, duration_s=120.0, seed=5))
    ttft = {}
    for setup in (Setup.CROSS_DC_PD, Setup.CROSS_DC_PD_DRC, Setup.PDD):
        summary, _ = simulate(ClusterConfig(setup=setup), requests, warmup)
        ttft[setup.value] = {"p50": summary.ttft_p50_s, "p90": summary.ttft_p90_s,
                             "p99": summary.ttft_p99_s}
    total, by_mechanism = ttft_reductions(ttft)
    for q in ("p50", "p90", "p99"):
        assert by_mechanism["drc"][q] + by_mechanism["relay"][q] == pytest.approx(total[q])
        assert total[q] == pytest.approx(100 * (1 - ttft["pdd"][q] / ttft["cross_dc_pd"][q]))
        assert by_mechanism["drc"][q] == pytest.approx(
            100 * (ttft["cross_dc_pd"][q] - ttft["cross_dc_pd_drc"][q]) / ttft["cross_dc_pd"][q])
    assert by_mechanism["drc"]["p50"] > 0      # DRC alone shortens the naive copy
