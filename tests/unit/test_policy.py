"""Unit tests of pdd_sglang.policy, the decisions shared by router, relay and simulator."""

import ast
import math
from pathlib import Path

import pytest

from pdd_sglang import policy
from pdd_sglang.policy import (HandoffChunk, HandoffMode, MainCandidate, Pipeline, PolicyConfig,
                               RelayLoad, choose_handoff_mode, choose_main, choose_pipeline,
                               next_handoff_chunk, predict_wan_seconds, relay_finishes_locally)

KV = 50_000          # bytes per token
WAN = 1e9            # bytes per second
RTT = 0.02


def idle_relay():
    return RelayLoad(running_requests=1, max_running_requests=32, kv_used_tokens=0,
                     kv_capacity_tokens=1_000_000)


def test_pipeline_values_name_the_two_normal_pipelines():
    assert Pipeline.PREFILL_MAIN.label == "P->MD"
    assert Pipeline.PREFILL_RELAY_MAIN.label == "P->RLD->MD"
    # One vocabulary: the value is the name a route carries to the servers.
    assert Pipeline("prefill_relay_main") is Pipeline.PREFILL_RELAY_MAIN
    assert "positive feedback" in Pipeline.__doc__


def test_predict_wan_seconds_is_rtt_plus_bytes_over_rate():
    assert predict_wan_seconds(1000, KV, WAN, RTT) == pytest.approx(0.02 + 0.05)
    assert predict_wan_seconds(0, KV, WAN, RTT) == pytest.approx(RTT)


@pytest.mark.parametrize("args", [(-1, KV, WAN, RTT), (10, 0, WAN, RTT), (10, KV, 0, RTT),
                                  (10, KV, -5, RTT), (10, KV, WAN, -0.1), (10, KV, math.inf, RTT),
                                  (float("nan"), KV, WAN, RTT)])
def test_predict_wan_seconds_rejects_nonsense(args):
    with pytest.raises(ValueError):
        predict_wan_seconds(*args)


def test_short_copy_goes_straight_to_main_long_copy_through_relay():
    cfg = PolicyConfig(hide_wan_below_s=0.5)
    assert choose_pipeline(1000, 200, KV, WAN, RTT, cfg) is Pipeline.PREFILL_MAIN
    assert choose_pipeline(60_000, 200, KV, WAN, RTT, cfg) is Pipeline.PREFILL_RELAY_MAIN


def test_threshold_is_strict_at_the_boundary():
    # 9600 tokens * 50 KB / 1 GB/s = 0.48 s, + 0.02 s RTT = 0.5 s exactly: not "under" 0.5 s
    cfg = PolicyConfig(hide_wan_below_s=0.5)
    assert choose_pipeline(9600, 10, KV, WAN, RTT, cfg) is Pipeline.PREFILL_RELAY_MAIN
    assert choose_pipeline(9599, 10, KV, WAN, RTT, cfg) is Pipeline.PREFILL_MAIN


def test_predictive_singular_only_when_enabled_and_both_thresholds_met():
    on = PolicyConfig(singular_predictive=True, singular_min_uncached_tokens=32_000,
                      singular_max_new_tokens=32)
    assert choose_pipeline(60_000, 16, KV, WAN, RTT, on) is Pipeline.RELAY_SINGULAR
    assert choose_pipeline(60_000, 33, KV, WAN, RTT, on) is Pipeline.PREFILL_RELAY_MAIN
    assert choose_pipeline(20_000, 16, KV, WAN, RTT, on) is Pipeline.PREFILL_RELAY_MAIN
    assert choose_pipeline(60_000, 16, KV, WAN, RTT) is Pipeline.PREFILL_RELAY_MAIN


def test_choose_pipeline_rejects_zero_max_new_tokens():
    with pytest.raises(ValueError, match="max_new_tokens"):
        choose_pipeline(10, 0, KV, WAN, RTT)


def test_relay_load_utilisation_is_the_tighter_limit():
    assert RelayLoad(8, 32, 900, 1000).utilisation == pytest.approx(0.9)
    assert RelayLoad(24, 32, 100, 1000).utilisation == pytest.approx(0.75)
    with pytest.raises(ValueError):
        RelayLoad(1, 0, 0, 10)
    with pytest.raises(ValueError):
        RelayLoad(-1, 4, 0, 10)


def test_handoff_mode_rule():
    cfg = PolicyConfig(catch_up_threshold_tokens=64, relay_load_watermark=0.7)
    assert choose_handoff_mode(64, idle_relay(), cfg) is HandoffMode.ONE_SHOT
    assert choose_handoff_mode(65, idle_relay(), cfg) is HandoffMode.CATCH_UP
    busy = RelayLoad(23, 32, 0, 1000)          # 0.71875 >= 0.7
    assert choose_handoff_mode(500, busy, cfg) is HandoffMode.ONE_SHOT
    with pytest.raises(ValueError):
        choose_handoff_mode(-1, idle_relay(), cfg)


def test_one_shot_hands_everything_at_once():
    assert next_handoff_chunk(300, 0, HandoffMode.ONE_SHOT) == HandoffChunk(0, 300, True)
    assert next_handoff_chunk(300, 128, HandoffMode.ONE_SHOT) == HandoffChunk(128, 300, True)


def test_catch_up_hands_chunks_then_a_small_last_one():
    cfg = PolicyConfig(catch_up_chunk_tokens=64)
    assert next_handoff_chunk(300, 0, HandoffMode.CATCH_UP, cfg) == HandoffChunk(0, 64, False)
    assert next_handoff_chunk(130, 64, HandoffMode.CATCH_UP, cfg) == HandoffChunk(64, 128, False)
    assert next_handoff_chunk(128, 64, HandoffMode.CATCH_UP, cfg) == HandoffChunk(64, 128, True)


def test_catch_up_converges_when_relay_adds_a_few_tokens_per_round():
    cfg = PolicyConfig(catch_up_chunk_tokens=64)
    held, handed, rounds = 1000, 0, 0
    while True:
        chunk = next_handoff_chunk(held, handed, HandoffMode.CATCH_UP, cfg)
        rounds += 1
        handed = chunk.end
        if chunk.is_last:
            break
        held += 3                                 # the relay keeps decoding meanwhile
    assert handed == held
    assert rounds <= 1000 // (64 - 3) + 2


def test_next_handoff_chunk_rejects_inconsistent_counts():
    with pytest.raises(ValueError, match="exceeds"):
        next_handoff_chunk(10, 11, HandoffMode.ONE_SHOT)
    with pytest.raises(ValueError):
        next_handoff_chunk(10, 0, "one-shot")


def test_reactive_singular_filter_truth_table():
    assert relay_finishes_locally(True, False) is True
    assert relay_finishes_locally(True, True) is False
    assert relay_finishes_locally(False, False) is False
    assert relay_finishes_locally(False, True) is False
    assert relay_finishes_locally(True, False, PolicyConfig(singular_reactive=False)) is False


def test_choose_main_prefers_cache_weighed_against_load():
    cfg = PolicyConfig(main_load_penalty_tokens=8192)
    idle_cold = MainCandidate(0, 0, 100)
    warm_busy = MainCandidate(60_000, 90, 100)
    assert choose_main([idle_cold, warm_busy], cfg) == 1
    slightly_warm_busy = MainCandidate(4000, 90, 100)   # 4000 - 7373 < 0
    assert choose_main([idle_cold, slightly_warm_busy], cfg) == 0


def test_choose_main_ties_break_to_lowest_index_and_skips_full_servers():
    same = MainCandidate(1000, 10, 100)
    assert choose_main([same, same, same]) == 0
    full = MainCandidate(10**6, 100, 100)
    assert choose_main([full, MainCandidate(0, 5, 100)]) == 1
    assert choose_main([full, MainCandidate(0, 100, 100)]) == 0      # all full: best cache
    with pytest.raises(ValueError):
        choose_main([])


def test_policy_config_validates():
    with pytest.raises(ValueError):
        PolicyConfig(catch_up_chunk_tokens=0)
    with pytest.raises(ValueError):
        PolicyConfig(hide_wan_below_s=-1)
    with pytest.raises(Exception):
        PolicyConfig().hide_wan_below_s = 1.0          # frozen


def test_policy_module_uses_only_the_standard_library():
    modules = set()
    for path in Path(policy.__file__).parent.glob("*.py"):  # the package's every module
        tree = ast.parse(path.read_text())
        modules |= {alias.name for node in ast.walk(tree)
                    if isinstance(node, ast.Import) for alias in node.names}
        modules |= {node.module for node in ast.walk(tree)
                    if isinstance(node, ast.ImportFrom) and node.module}
    outside = {m for m in modules if not m.startswith("pdd_sglang.policy")}
    assert {m.split(".")[0] for m in outside} <= {"__future__", "enum", "math", "dataclasses",
                                                 "typing"}
    assert len(modules - outside) >= 1  # the package's own modules only


def test_wan_copy_is_cancelled_only_for_singular_traffic():
    from pdd_sglang.policy import cancel_wan_copy

    cfg = PolicyConfig(singular_min_uncached_tokens=1000, singular_max_new_tokens=8)
    assert cancel_wan_copy(5000, 4, cfg) is True
    assert cancel_wan_copy(5000, 9, cfg) is False  # a real answer: main should learn the turn
    assert cancel_wan_copy(999, 1, cfg) is False  # short copy: keep main's cache aligned
    assert cancel_wan_copy(5000, 4, PolicyConfig(singular_reactive=False,
                                                 singular_min_uncached_tokens=1000)) is False
    with pytest.raises(ValueError):
        cancel_wan_copy(-1, 1, cfg)


def test_congestion_aware_prediction_waits_behind_the_line():
    from pdd_sglang.policy import IDLE_LINE, LineState, predict_wan_seconds, predict_wan_seconds_on_line
    idle = predict_wan_seconds(100, 1000.0, 1e6, 0.04)
    assert predict_wan_seconds_on_line(100, 1000.0, 1e6, 0.04, IDLE_LINE) == pytest.approx(idle)
    busy = LineState(bytes_ahead=2_000_000)
    assert predict_wan_seconds_on_line(100, 1000.0, 1e6, 0.04, busy) == pytest.approx(idle + 2.0)
    slow = LineState(measured_bytes_per_s=5e5)
    assert predict_wan_seconds_on_line(100, 1000.0, 1e6, 0.04, slow) == pytest.approx(0.04 + 0.2)
    # A small suffix on a busy line is worth hiding behind the relay; on an idle line it is not.
    assert choose_pipeline(100, 200, 1000.0, 1e6, 0.04) is Pipeline.PREFILL_MAIN
    assert choose_pipeline(100, 200, 1000.0, 1e6, 0.04, line=busy) is Pipeline.PREFILL_RELAY_MAIN
    with pytest.raises(ValueError):
        LineState(bytes_ahead=-1)


def test_ttft_budget_keeps_the_relay_for_requests_that_need_it():
    from pdd_sglang.policy import BudgetVerdict, MainTtft, place_by_ttft_budget
    cfg = PolicyConfig(relay_full_utilisation=0.9)
    fast = MainTtft(queue_s=0.1, prefill_s=0.3, wan_s=0.4)  # 0.8 s through main
    slow = MainTtft(queue_s=0.1, prefill_s=0.3, wan_s=1.5)  # 1.9 s through main
    # Within the budget through main: P->MD, even with an idle relay (a WAN the budget absorbs).
    assert place_by_ttft_budget(fast, 1.0, 0.0, cfg) == (Pipeline.PREFILL_MAIN, BudgetVerdict.WITHIN)
    assert place_by_ttft_budget(fast, 0.8, 0.0, cfg).pipeline is Pipeline.PREFILL_MAIN  # at it
    # Over it: the relay while it has headroom; its first token needs only queue and prefill.
    assert place_by_ttft_budget(slow, 1.0, 0.5, cfg) == (Pipeline.PREFILL_RELAY_MAIN,
                                                        BudgetVerdict.WITHIN)
    assert place_by_ttft_budget(slow, 0.3, 0.5, cfg) == (Pipeline.PREFILL_RELAY_MAIN,
                                                        BudgetVerdict.OVER)  # prefill alone misses
    # A full relay, or none: P->MD counted over budget.
    assert place_by_ttft_budget(slow, 1.0, 0.9, cfg) == (Pipeline.PREFILL_MAIN, BudgetVerdict.OVER)
    assert place_by_ttft_budget(slow, 1.0, None, cfg) == (Pipeline.PREFILL_MAIN, BudgetVerdict.OVER)
    # A tighter budget sends more requests through the relay: the trade the operator sets.
    budgets = [0.5, 1.0, 2.0]
    relayed = [place_by_ttft_budget(t, b, 0.0, cfg).pipeline is Pipeline.PREFILL_RELAY_MAIN
               for b in budgets for t in (fast, slow)]
    assert relayed == [True, True, False, True, False, False]


def test_without_a_budget_hide_wan_below_s_decides_as_before():
    from pdd_sglang.policy import BudgetVerdict, MainTtft, place_by_ttft_budget
    cfg = PolicyConfig(hide_wan_below_s=0.5)
    for wan_s, expected in ((0.49, Pipeline.PREFILL_MAIN), (0.5, Pipeline.PREFILL_RELAY_MAIN)):
        placed = place_by_ttft_budget(MainTtft(5.0, 5.0, wan_s), None, 0.0, cfg)
        assert placed == (expected, BudgetVerdict.NO_BUDGET)
        assert expected is choose_pipeline(0, 10, 1.0, 1.0, wan_s, cfg)  # the same rule


def test_ttft_budget_inputs_are_checked():
    from pdd_sglang.policy import MainTtft, place_by_ttft_budget, prefill_seconds
    with pytest.raises(ValueError):
        place_by_ttft_budget(MainTtft(0, 0, 0), 0.0, 0.0)
    with pytest.raises(ValueError):
        MainTtft(-1.0, 0, 0)
    for bad in ({"ttft_slo_s": 0.0}, {"prefill_tokens_per_s": -1.0}, {"relay_full_utilisation": 0}):
        with pytest.raises(ValueError):
            PolicyConfig(**bad)
    assert prefill_seconds(1000, 2000.0) == 0.5 and prefill_seconds(1000, None) == 0.0
