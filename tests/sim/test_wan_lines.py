"""Issue 34 item 4: the simulator's WAN line as prefill's sender drives it (sim/wan_lines.py):
needed-now first, earliest deadline first within a class, preemption at a slice boundary after
the window in flight, cache-only copies dropped past the backlog, each copy at most its window
per RTT; and TTFT-budget placement taken from pdd_sglang.policy."""

from __future__ import annotations

from collections import Counter

import pytest

from pdd_sglang import policy
from pdd_sglang.policy import Pipeline, PolicyConfig
from pdd_sglang.sim import cluster as cluster_module
from pdd_sglang.sim.cluster import ClusterConfig, Setup, simulate
from pdd_sglang.sim.engine import Callback, Simulator
from pdd_sglang.sim.profiles import LinkProfile
from pdd_sglang.sim.wan_lines import CACHE_ONLY, NEEDED_NOW, ClassedLink
from pdd_sglang.sim.workload import Request


def _line(rate=1000.0, rtt=0.0, window=0.0, slice_bytes=1000.0, backlog_s=None,
          background_window=None, in_flight_bytes=None):
    sim = Simulator(0)
    profile = LinkProfile("test line", "test", bytes_per_s=rate, rtt_s=rtt, jitter_s=0.0,
                          cost_per_hour=0.0, window_bytes=window)
    return sim, ClassedLink(sim, profile, slice_bytes, backlog_s,
                            background_window=background_window,
                            in_flight_bytes=in_flight_bytes)


def _copy(sim, line, size, name, done, dest=0, dropped=None, relay_covered=False):
    return line.start_flow(size, lambda: done.append((name, round(sim.now, 6))), dest=dest,
                           on_dropped=(lambda: dropped.append(name)) if dropped is not None
                           else None, relay_covered=relay_covered)


def test_needed_now_goes_first_then_the_earliest_deadline_within_a_class():
    sim, line = _line()
    done = []
    _copy(sim, line, 5000, "holder", done)
    big, small = _copy(sim, line, 3000, "big", done), _copy(sim, line, 1000, "small", done)
    cache = _copy(sim, line, 500, "cache-only", done)
    line.set_cache_only(cache)
    assert (big.copy_class, cache.copy_class) == (NEEDED_NOW, CACHE_ONLY)
    sim.run()
    # Needed-now copies due before it (queued together, so the ones with less left) take the
    # line from the needed-now holder at its next slice (the sender's should_yield): small,
    # then big, then the holder; cache-only last though it is the shortest.
    assert done == [("small", 1.0), ("big", 4.0), ("holder", 9.0), ("cache-only", 9.5)]
    assert line.sent_by_class == pytest.approx({NEEDED_NOW: 9000.0, CACHE_ONLY: 500.0})


def test_a_larger_copy_is_passed_only_by_smaller_copies_due_before_it():
    """The sender's bound on least-left's starvation (policy.wan_order): a 1,100-byte copy
    (due at 2.2 s) behind a holder, then a 1,000-byte copy arriving each second from 0.05 s.
    Only the first is due before it (2.05 s); least-left would send it last, a bound of two
    passes third."""
    sim, line = _line()
    done = []
    _copy(sim, line, 1000, "holder", done)
    _copy(sim, line, 1100, "big", done)
    for k in range(4):
        sim.at(0.05 + k, Callback(_copy, sim, line, 1000, f"small{k}", done))
    sim.run()
    assert [name for name, _ in done] == ["holder", "small0", "big", "small1", "small2",
                                          "small3"]


def test_a_holder_far_into_its_copy_still_yields_to_a_copy_due_before_it():
    """A deadline from the bytes left moved the holder's closer as it sent: 6 s into its 8 s it
    was due at 4 s and kept the line from a 0.5 s copy due at 7 s. Its deadline is its size's:
    16 s."""
    sim, line = _line()
    done = []
    _copy(sim, line, 8000, "holder", done)
    sim.at(6.0, Callback(_copy, sim, line, 500, "small", done))
    sim.run()
    assert done == [("small", 6.5), ("holder", 8.5)]


@pytest.mark.parametrize("window, yield_at_s", [(0.0, 3.0), (1500.0, 4.0)])
def test_a_needed_now_copy_overtakes_a_cache_only_one_at_its_next_slice_after_the_window(
        window, yield_at_s):
    # An RTT of ~0: the window never caps the rate, it only sets how far the holder has run
    # ahead of the wire.
    sim, line = _line(rtt=1e-9, window=window)
    done = []
    warm = _copy(sim, line, 10_000, "cache-only", done)
    line.set_cache_only(warm)
    sim.at(2.5, Callback(_copy, sim, line, 500, "needed-now", done))
    sim.run()
    # Yields at the first 1000-byte slice boundary past 2500 bytes sent plus the window, then
    # resumes where it left off.
    assert done == [("needed-now", yield_at_s + 0.5), ("cache-only", 10.5)]


def test_a_background_holder_yields_within_its_smaller_window_and_any_other_within_its_own():
    """The sender's background window (prefill.wan_engine.background_window): a needed-now copy
    that takes the line from a cache-only or a relay-covered copy (a handoff's) shares it with
    that window, not the full one."""
    def run(holder_kind):
        sim = Simulator(0)
        profile = LinkProfile("test line", "test", bytes_per_s=1000.0, rtt_s=1e-9, jitter_s=0.0,
                              cost_per_hour=0.0, window_bytes=3000.0)
        line = ClassedLink(sim, profile, 1000.0, None, background_window=(100.0, 300.0))
        done = []
        holder = line.start_flow(10_000, lambda: done.append(("holder", round(sim.now, 6))),
                                 relay_covered=holder_kind == "relay-covered")
        if holder_kind == CACHE_ONLY:
            line.set_cache_only(holder)
        sim.at(2.5, Callback(_copy, sim, line, 500, "needed-now", done))
        sim.run()
        return done
    # 2500 sent + 300 in flight: it hands over at 2600 (room for its next 100-byte slice) and
    # lands 200 beside the newcomer's 500 (half the line each): 2.6 + 0.4 + 0.3
    assert run(CACHE_ONLY)[0] == ("needed-now", 2.6 + 0.4 + 0.3)
    assert run("relay-covered")[0] == ("needed-now", 2.6 + 0.4 + 0.3)
    # A P->MD holder due after the newcomer yields too, within its full window: 2500 sent +
    # 3000 in flight, to the 1000-byte slice boundary at 6000; it hands over at 4000, then the
    # newcomer's 500 bytes go at half the line beside its last 2000: 4.0 + 1.0.
    assert run(NEEDED_NOW)[0] == ("needed-now", 4.0 + 1.0)
    with pytest.raises(ValueError, match="background"):
        ClassedLink(Simulator(0), LinkProfile("x", "x", 1.0, 0.0, 0.0, 0.0), 1.0, None,
                    background_window=(0.0, 1.0))


def test_a_p_to_md_copy_takes_the_line_from_a_relay_covered_one_due_before_it():
    """policy.wan_order.copy_tier, as the sender: a handoff's copy (relay-covered) due first
    still yields to a copy whose request has no token yet, after its background window."""
    sim = Simulator(0)
    profile = LinkProfile("test line", "test", bytes_per_s=1000.0, rtt_s=1e-9, jitter_s=0.0,
                          cost_per_hour=0.0, window_bytes=3000.0)
    line = ClassedLink(sim, profile, 1000.0, None, background_window=(100.0, 300.0))
    done = []
    line.start_flow(1000, lambda: done.append(("handoff", round(sim.now, 6))),
                    relay_covered=True)
    sim.at(0.5, Callback(_copy, sim, line, 1000, "p->md", done))  # due 0.5 + 2 x 1.0 = 2.5 s
    sim.run()
    # the handoff's copy, due at 2.0 s, before the P->MD one's 2.5 s, yields at 500 + 300 bytes
    assert done == [("p->md", 0.8 + 1.0), ("handoff", 2.0)]
    assert policy.copy_tier(False, False) < policy.copy_tier(False, True) < policy.copy_tier(
        True, False) == policy.copy_tier(True, True)


def test_queued_cache_only_copies_past_the_backlog_are_dropped_newest_first_never_needed_now():
    sim, line = _line(backlog_s=2.0)          # 2 s of a 1000 B/s line: 2000 bytes ahead
    done, dropped = [], []
    _copy(sim, line, 1000, "measured", done)   # one slice: the line measured at 1000 B/s
    sim.run()
    done.clear()
    line.bytes_received = 0
    _copy(sim, line, 1500, "holder", done, dropped=dropped)
    first = _copy(sim, line, 300, "older", done, dropped=dropped)
    second = _copy(sim, line, 400, "newer", done, dropped=dropped)
    _copy(sim, line, 900, "needed-now", done, dropped=dropped)   # 3100 ahead: none cache-only
    line.set_cache_only(first)                                   # still 3100: drop older
    assert first.dropped and not second.dropped
    line.set_cache_only(second)                                  # 2800: drop newer too
    sim.run()
    assert dropped == ["older", "newer"]
    assert [name for name, _ in done] == ["needed-now", "holder"]   # 900 left against 1500
    assert line.dropped_cache_only_bytes == 700 and line.dropped_copies == 2
    assert line.bytes_received == 2400


def test_a_copy_taking_the_line_waits_for_the_senders_window_not_the_rate_window():
    """The profile's window caps a copy's rate (400 B/s at 1 s of RTT); the sender keeps its
    own window in flight (2000 bytes), which sets when a copy taking the line gets it: the
    holder has sent 200 bytes at 0.5 s and handed the transport 2200, up to the slice boundary
    at 3000; it hands over once the window has room for its next slice, at 2000 bytes sent
    (5.0 s), and lands the rest beside the small copy (each at its 400 B/s cap). With the rate
    window (400 bytes) it would hand over at 1000 bytes, 2.5 s."""
    for in_flight, small_done in ((2000.0, 5.0 + 100 / 400 + 0.5), (None, 2.5 + 100 / 400 + 0.5)):
        sim, line = _line(rtt=1.0, window=400.0, in_flight_bytes=in_flight)
        done = []
        _copy(sim, line, 10_000, "holder", done)
        sim.schedule(0.5, Callback(lambda: _copy(sim, line, 100, "small", done)))
        sim.run()
        assert done[0] == ("small", pytest.approx(small_done))


def test_nothing_is_dropped_before_the_line_has_measured_a_rate():
    """As the sender: the bound is seconds at the measured rate, and none is measured yet."""
    sim, line = _line(backlog_s=1.0)
    done, dropped = [], []
    _copy(sim, line, 5000, "holder", done, dropped=dropped)
    cache = _copy(sim, line, 300, "cache-only", done, dropped=dropped)
    line.set_cache_only(cache)                   # 5300 ahead, 5 s past the bound
    assert not cache.dropped and line.measured_rate(0) is None
    sim.run()
    assert dropped == [] and [name for name, _ in done] == ["holder", "cache-only"]


def test_a_background_copy_moves_its_stop_and_wait_share_and_drops_go_by_the_measured_rate():
    """A handoff's copy keeps 1000 bytes in flight on a 1000 B/s x 1 s line (BDP 1000 bytes):
    it moves 1000 / (1000 + 1000) of the line, and the line measures that rate, so 2 s of
    backlog is 1000 bytes, not the 2000 the line alone would carry."""
    sim, line = _line(rtt=1.0, backlog_s=2.0, background_window=(100.0, 1000.0))
    done, dropped = [], []
    _copy(sim, line, 1000, "handoff", done, relay_covered=True)
    sim.run()
    assert done == [("handoff", 2.5)]            # 2 s at 500 B/s, then the one-way delay
    assert line.measured_rate(0) == pytest.approx(500.0)
    _copy(sim, line, 900, "holder", done, dropped=dropped, relay_covered=True)
    older = _copy(sim, line, 300, "older", done, dropped=dropped, relay_covered=True)
    line.set_cache_only(older)                   # 1200 ahead: past 2 s at 500 B/s
    assert older.dropped
    # Beside a copy to another main, what a slowed background copy leaves goes to the other:
    # at 3 s of RTT it moves 1000 / (1000 + 3000) of the line, 250 B/s, the other 750 B/s.
    sim, line = _line(rtt=3.0, background_window=(100.0, 1000.0))
    done = []
    _copy(sim, line, 1000, "handoff", done, dest="a", relay_covered=True)
    _copy(sim, line, 1000, "p->md", done, dest="b")
    sim.run()
    assert done == [("p->md", pytest.approx(1000 / 750 + 1.5)), ("handoff", pytest.approx(5.5))]


def test_a_copy_moves_at_most_its_window_per_rtt_and_lines_to_two_mains_share_the_wire():
    sim, line = _line(rate=1000.0, rtt=1.0, window=400.0)   # 400 B/s per copy: window-bound
    done = []
    _copy(sim, line, 800, "alone", done)
    sim.run()
    assert done == [("alone", 2.5)]                          # 2 s on the wire + one way
    sim, line = _line(rate=1000.0, rtt=0.0)
    done = []
    _copy(sim, line, 1000, "main-a", done, dest="a")
    _copy(sim, line, 1000, "main-b", done, dest="b")
    _copy(sim, line, 1000, "main-a again", done, dest="a")   # waits for its own line
    sim.run()
    assert done == [("main-a", 2.0), ("main-b", 2.0), ("main-a again", 3.0)]


def test_a_new_first_token_copy_waits_behind_its_tier_and_a_background_holders_window():
    sim, line = _line(rtt=1e-9, window=300.0)
    done = []
    warm = _copy(sim, line, 10_000, "cache-only", done)
    line.set_cache_only(warm)
    line.set_cache_only(_copy(sim, line, 5000, "queued cache-only", done))
    assert line.first_token_bytes_ahead(0) == 300            # the holder's window only
    _copy(sim, line, 4000, "a handoff's copy", done, relay_covered=True)
    assert line.first_token_bytes_ahead(0) == 300            # a later tier: not ahead of it
    _copy(sim, line, 700, "needed-now", done)
    assert line.first_token_bytes_ahead(0) == 1000
    cancelled = _copy(sim, line, 200, "cancelled", done)
    assert line.first_token_bytes_ahead(0) == 1200
    assert line.cancel_flow(cancelled) == 0.0 and not cancelled.active
    assert line.first_token_bytes_ahead(0) == 1000


def test_a_relay_covered_holder_counts_only_its_window_ahead_of_a_first_token_copy():
    sim, line = _line(rtt=1e-9, window=300.0)
    _copy(sim, line, 10_000, "a handoff's copy", [], relay_covered=True)
    assert line.first_token_bytes_ahead(0) == 300


# --- the cluster on the classed line, placing by the TTFT budget -------------------------------

def _request(i, arrival_s, tokens, output_tokens=64):
    blocks = tuple(range(i * 1000, i * 1000 + -(-tokens // 512)))
    return Request(request_id=i, arrival_s=arrival_s, input_tokens=tokens,
                   output_tokens=output_tokens, prompt_blocks=blocks, context_blocks=blocks,
                   conversation_id=i)


def _requests(count=6, gap_s=0.5, tokens=4000):
    return [_request(i, i * gap_s, tokens) for i in range(count)]


def _pipelines(cluster) -> dict:
    return dict(Counter(job.pipeline.value for job in cluster.jobs))


def _budget_cluster(budget_s, relay_max_running=32):
    return ClusterConfig(setup=Setup.PDD, wan_link="wan_10g", wan_line="classed",
                         placement="congestion-aware", relay_max_running=relay_max_running,
                         policy=PolicyConfig(ttft_slo_s=budget_s, prefill_tokens_per_s=50_000.0))


def test_budget_placement_is_the_policys_and_follows_the_budget(monkeypatch):
    calls = []
    real = policy.place_by_ttft_budget

    def spy(main, budget_s, relay_utilisation, cfg):
        calls.append((main, budget_s, relay_utilisation))
        return real(main, budget_s, relay_utilisation, cfg)

    monkeypatch.setattr(cluster_module.policy, "place_by_ttft_budget", spy)
    requests = _requests()
    _, cluster = simulate(_budget_cluster(60.0), requests)
    assert len(calls) == len(requests) and all(b == 60.0 for _, b, _ in calls)
    assert _pipelines(cluster) == {Pipeline.PREFILL_MAIN.value: len(requests)}
    calls.clear()
    _, cluster = simulate(_budget_cluster(0.001), requests)
    assert _pipelines(cluster) == {Pipeline.PREFILL_RELAY_MAIN.value: len(requests)}
    assert all(0 <= u < 1 for _, _, u in calls)              # the relay had headroom
    assert {job.budget_verdict for job in cluster.jobs} == {policy.BudgetVerdict.OVER}


def test_a_request_placed_through_the_relay_waits_for_the_relays_registration_only():
    """The demo's PDD by the budget registered in 8-9 ms at the latency point, cross-DC PD in
    69-71 ms: prefill starts once the relay, next door, has registered. A request placed
    P->MD still waits for main's registration across the line."""
    from dataclasses import replace

    base = replace(_budget_cluster(0.001), dispatch_latency_s=0.07, relay_dispatch_latency_s=0.009)
    _, cluster = simulate(base, _requests(count=2, gap_s=5.0))
    assert _pipelines(cluster) == {Pipeline.PREFILL_RELAY_MAIN.value: 2}
    assert [round(j.dispatched_s - j.request.arrival_s, 6) for j in cluster.jobs] == [0.009, 0.009]
    _, cluster = simulate(replace(base, policy=replace(base.policy, ttft_slo_s=60.0)),
                          _requests(count=2, gap_s=5.0))
    assert _pipelines(cluster) == {Pipeline.PREFILL_MAIN.value: 2}
    assert [round(j.dispatched_s - j.request.arrival_s, 6) for j in cluster.jobs] == [0.07, 0.07]


def test_a_full_relay_sends_requests_through_main_over_budget():
    summary, cluster = simulate(_budget_cluster(0.001, relay_max_running=1), _requests(gap_s=0.0))
    pipelines = [job.pipeline for job in cluster.jobs]
    assert pipelines[0] is Pipeline.PREFILL_RELAY_MAIN
    assert pipelines.count(Pipeline.PREFILL_MAIN) == len(pipelines) - 1   # the relay is full


def test_a_relay_that_answers_alone_makes_main_copy_cache_only_on_the_classed_line():
    # A long prompt over a slow line: the relay's 4 tokens finish long before main's copy.
    # (Under the singular filter's 32768 tokens: its copy goes on, only cache-only.)
    requests = [_request(0, 0.0, 20_000, output_tokens=4)]
    cfg = ClusterConfig(setup=Setup.PDD, wan_link="wan_10g", wan_line="classed",
                        wan_bandwidth_scale=0.01)
    summary, cluster = simulate(cfg, requests)
    assert cluster.jobs[0].finished_at == "relay"
    assert cluster.wan.sent_by_class[CACHE_ONLY] > 0
    assert cluster.wan.sent_by_class[NEEDED_NOW] > 0


def test_the_classed_line_takes_the_senders_background_window_unless_told_the_full_one():
    from pdd_sglang.prefill.wan_engine import background_window, window_for_line

    cfg = ClusterConfig(setup=Setup.PDD, wan_link="wan_10g", wan_line="classed")
    _, cluster = simulate(cfg, [_request(0, 0.0, 1000)])
    rate = min(cluster.wan.profile.bytes_per_s, cluster.wan.profile.per_flow_bytes_per_s)
    sender = background_window(window_for_line(rate * 8 / 1e9, cluster.wan.profile.rtt_s * 1e3),
                               rate)
    assert cluster.wan.background_window == (sender.slice_bytes, sender.window_bytes)
    assert sender.window_bytes == pytest.approx(0.1 * rate, rel=1e-6)
    _, full = simulate(cfg.with_(wan_background_in_flight_s=None), [_request(0, 0.0, 1000)])
    assert full.wan.background_window is None


def test_a_turn_reaches_main_once_the_landing_copy_of_the_turn_it_extends_has_landed():
    """The router sends a P->RLD->MD turn to main only once the cache-only copy of the turn it
    extends has landed there (--main-wait-for-landing-s, router/landing.py), so the line
    carries the new suffix only. The simulator reserved main at once: main matched the older
    prefix and the prefix crossed twice (the validation's WAN bytes 1.4-1.8x the demo's)."""
    from dataclasses import replace

    first_blocks = tuple(range(16))  # 8,192 tokens
    first = Request(request_id=0, arrival_s=0.0, input_tokens=8192, output_tokens=4,
                    prompt_blocks=first_blocks, context_blocks=first_blocks, conversation_id=0)
    second_blocks = first_blocks + (100, 101)
    second = Request(request_id=1, arrival_s=0.5, input_tokens=9216, output_tokens=4,
                     prompt_blocks=second_blocks, context_blocks=second_blocks, conversation_id=0)
    base = _budget_cluster(0.001)
    landed = {}
    for wait_s in (20.0, 0.0):
        _, cluster = simulate(replace(base, router_main_wait_for_landing_s=wait_s),
                              [first, second])
        assert _pipelines(cluster) == {Pipeline.PREFILL_RELAY_MAIN.value: 2}
        earlier, later = sorted(cluster.jobs, key=lambda j: j.request.request_id)
        assert earlier.finished_at == "relay" and earlier.handoff_cancelled  # a landing copy
        landed[wait_s] = later.main_cached_tokens
        if wait_s:
            assert later.main_reserved_s >= earlier.wan_started_s
    assert landed[20.0] == 8192  # the first turn's prompt, landed before main matched
    assert landed[0.0] == 0      # matched at once: the prefix crossed a second time


def test_a_holder_keeps_the_line_when_the_copy_it_would_yield_to_turned_cache_only_meanwhile():
    """As the sender, which asks should_yield only when it is between slices: a needed-now
    holder due after a newcomer hands over at its next slice, unless by then the newcomer's
    relay answered alone (cache-only): then it keeps the line and sends whole."""
    sim, line = _line(rtt=1e-9, window=3000.0)
    done = []
    _copy(sim, line, 10_000, "holder", done)
    newcomer = []
    sim.at(0.5, Callback(lambda: newcomer.append(_copy(sim, line, 500, "newcomer", done))))
    sim.at(1.0, Callback(lambda: line.set_cache_only(newcomer[0])))  # before its hand-over
    sim.run()
    assert done == [("holder", 10.0), ("newcomer", 10.5)]
