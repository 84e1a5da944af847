"""The singular filter in the simulator is the router's rule (policy.cancel_wan_copy): when the
relay answers before main holds the prompt, main's WAN copy is cancelled only for singular
traffic; any other copy lands and main caches the prompt for the conversation's next turn."""

import pytest

from pdd_sglang import policy
from pdd_sglang.policy import Pipeline, PolicyConfig
from pdd_sglang.sim.cluster import ClusterConfig, Setup, simulate
from pdd_sglang.sim.profiles import load_model
from pdd_sglang.sim.workload import AgenticConfig, Request, generate_agentic

KV = load_model("moe_1t_50kb").kv_bytes_per_token
# Cancels every copy the relay beat: the rule serving used before the measured collapse.
ALWAYS_CANCEL = PolicyConfig(singular_min_uncached_tokens=0, singular_max_new_tokens=10 ** 9)


def _blocks(tokens, first_id=0):
    return tuple(range(first_id, first_id + -(-tokens // 512)))


def _one_request(input_tokens, output_tokens):
    return Request(0, 1.0, input_tokens, output_tokens, _blocks(input_tokens),
                   _blocks(input_tokens + output_tokens)[:(input_tokens + output_tokens) // 512])


def test_singular_request_cancels_the_copy_and_sends_fewer_wan_bytes():
    request = _one_request(60_000, 4)           # 60K uncached, 4 out: singular by the defaults
    assert policy.cancel_wan_copy(60_000, 4)
    summary, cluster = simulate(ClusterConfig(setup=Setup.PDD), [request])
    never, kept = simulate(ClusterConfig(setup=Setup.PDD, policy=PolicyConfig(
        singular_min_uncached_tokens=10 ** 9)), [request])
    job, kept_job = cluster.jobs[0], kept.jobs[0]
    assert job.finished_at == kept_job.finished_at == "relay"
    assert job.cancelled_wan and not kept_job.cancelled_wan
    assert kept_job.wan_bytes == pytest.approx(60_000 * KV)
    assert summary.wan_bytes < 0.5 * never.wan_bytes
    # the cancelled copy never reaches main's cache; the landed one does
    assert cluster.mains[0].cache.matched_blocks(request.prompt_blocks) == 0
    assert kept.mains[0].cache.matched_blocks(request.prompt_blocks) == len(request.prompt_blocks)
    for c in (cluster, kept):
        main = c.mains[0]
        assert main.kv_used == 0 and not main.reserved and not main.admission


def _two_turns():
    first = Request(0, 1.0, 20_000, 4, _blocks(20_000), _blocks(20_004)[:20_004 // 512], 7)
    # Turn 2 re-sends turn 1 (39 full blocks) plus the answer and a 600-token tool result.
    second_blocks = first.context_blocks + (1000, 1001)
    second = Request(1, 60.0, 20_604, 30, second_blocks, second_blocks[:-1], 7)
    return [first, second]


def test_non_singular_relay_first_finish_lands_the_copy_and_next_turn_hits_main():
    requests = _two_turns()
    assert not policy.cancel_wan_copy(20_000, 4)     # 20K < 32K uncached: not singular
    summary, cluster = simulate(ClusterConfig(setup=Setup.PDD), requests)
    first, second = cluster.jobs
    assert first.pipeline is Pipeline.PREFILL_RELAY_MAIN
    assert first.finished_at == "relay" and first.handoff_cancelled
    assert not first.cancelled_wan and first.wan_bytes == pytest.approx(20_000 * KV)
    assert second.main_cached_tokens == 39 * 512
    assert second.pipeline is Pipeline.PREFILL_MAIN and second.finished_at == "main"

    # The always-cancel rule cuts turn 1's copy, so turn 2 misses at main and goes to the
    # relay again: the feedback behind the P->RLD-only collapse.
    _, cut = simulate(ClusterConfig(setup=Setup.PDD, policy=ALWAYS_CANCEL), requests)
    assert cut.jobs[0].cancelled_wan
    assert cut.jobs[1].main_cached_tokens == 0
    assert cut.jobs[1].pipeline is Pipeline.PREFILL_RELAY_MAIN
    assert summary.finished == 2


def test_workload_cancels_exactly_the_singular_copies():
    requests, warmup = generate_agentic(AgenticConfig(rate_per_s=3.0, duration_s=150.0, seed=5))
    cfg = PolicyConfig()
    summary, cluster = simulate(ClusterConfig(setup=Setup.PDD), requests, warmup)
    relay_first = [j for j in cluster.jobs if j.handoff_cancelled]
    cancelled = [j for j in relay_first if j.cancelled_wan]
    landed = [j for j in relay_first if not j.cancelled_wan]
    assert cancelled and landed, "the workload should exercise both branches"
    for job in cancelled:
        assert policy.cancel_wan_copy(job.main_uncached_tokens, job.request.output_tokens, cfg)
    for job in landed:
        assert not policy.cancel_wan_copy(job.main_uncached_tokens, job.request.output_tokens, cfg)
        sent = (job.request.input_tokens - job.main_cached_tokens) * KV
        assert job.wan_bytes == pytest.approx(sent)
        assert job.main.cache.matched_blocks(job.request.prompt_blocks) > 0 or \
            job.request.input_tokens < 512
    always, _ = simulate(ClusterConfig(setup=Setup.PDD, policy=ALWAYS_CANCEL), requests, warmup)
    assert summary.main_hit > always.main_hit
    # Cutting every relay-first copy does not even save bytes on this workload: the next turn
    # of each such conversation misses at main and ships the whole context again.
    assert summary.wan_bytes < always.wan_bytes
