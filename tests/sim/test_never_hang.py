"""Never hang: time-based completion in the line, the clock-stall guard, and a foreign trace
with tiny prompts late in a long run on a fast line."""

import json
import random

import pytest

from pdd_sglang.sim.cluster import ClusterConfig, Setup, simulate
from pdd_sglang.sim.engine import Callback, ClockStalled, Event, Simulator
from pdd_sglang.sim.link import FairShareLink
from pdd_sglang.sim.profiles import LinkProfile
from pdd_sglang.sim.workload import read_trace


def test_tiny_flows_late_on_a_fast_line_all_complete():
    # At t ~ 514 s one float step is 1e-13 s, in which 40 GB/s moves 0.004 B: a byte tolerance
    # left such flows a residue whose next check landed on the same clock value, forever.
    sim = Simulator(stall_events=10_000)
    link = FairShareLink(sim, LinkProfile("fast", "test", 40e9, 0.0, 0.0, 0.0))
    rng = random.Random(1)
    delivered = []
    t = 514.0
    for _ in range(5000):
        t += rng.expovariate(2000.0)
        size = rng.randint(1, 64) * 50
        sim.at(t, Callback(lambda s=size: link.start_flow(s, lambda s=s: delivered.append(s))))
    sim.run()
    assert len(delivered) == 5000
    assert link.active_flows == 0
    assert link.bytes_sent == pytest.approx(sum(delivered))


class _Stuck(Event):
    """Reschedules itself below the clock's float step: the shape of the old link bug."""

    def fire(self, sim):
        sim.schedule(1e-14, self)


def test_clock_stall_guard_names_the_event_and_the_time():
    sim = Simulator(stall_events=1000)
    sim.schedule(600.0, _Stuck())
    with pytest.raises(ClockStalled, match=r"1000 consecutive events at t = 600.0 s.*_Stuck"):
        sim.run()


def test_a_burst_at_one_time_is_not_a_stall():
    sim = Simulator(stall_events=1000)
    fired = []
    for _ in range(999):
        sim.schedule(5.0, Callback(fired.append, 1))
    sim.run()
    assert len(fired) == 999


def write_mooncake_trace(path, rows):
    with open(path, "w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")


def test_tiny_prompts_late_in_a_long_run_on_a_fast_line_finish(tmp_path):
    rng = random.Random(4)
    rows, next_block = [], 1
    for second in range(0, 600, 3):                     # a long run of ordinary prompts
        blocks = rng.randint(2, 12)
        rows.append({"timestamp": second * 1000, "input_length": blocks * 512 - 7,
                     "output_length": rng.randint(1, 40),
                     "hash_ids": [0] + list(range(next_block, next_block + blocks - 1))})
        next_block += blocks
    for i in range(300):                                # then tiny prompts from t = 514 s
        rows.append({"timestamp": 514_000 + 3 * i, "input_length": 16, "output_length": 2,
                     "hash_ids": [next_block + i]})
    rows.sort(key=lambda r: r["timestamp"])
    path = tmp_path / "tiny.jsonl"
    write_mooncake_trace(path, rows)
    requests = read_trace(path)
    assert len(requests) == len(rows)
    for setup in (Setup.CROSS_DC_PD, Setup.PDD):
        summary, cluster = simulate(ClusterConfig(setup=setup, wan_link="wan_100g",
                                                  wan_bandwidth_scale=3.6), requests)
        assert summary.finished == len(requests), setup
        assert cluster.wan.active_flows == 0


def test_planner_replays_a_trace_at_the_trial_rate(tmp_path):
    from pdd_sglang.sim.plan import TraceWorkload, workload_at
    rows = [{"timestamp": 1000 * i, "input_length": 600, "output_length": 5, "hash_ids": [0, i + 1]}
            for i in range(11)]
    path = tmp_path / "t.jsonl"
    write_mooncake_trace(path, rows)
    requests, warmup = workload_at(TraceWorkload(str(path), duration_s=100.0), 2.2)
    assert warmup == [] and len(requests) == 11
    assert len(requests) / requests[-1].arrival_s == pytest.approx(2.2)


def test_a_row_without_hash_ids_is_a_clear_error(tmp_path):
    path = tmp_path / "bad.jsonl"
    write_mooncake_trace(path, [{"timestamp": 0, "input_length": 5, "output_length": 1}])
    with pytest.raises(ValueError, match=r"bad.jsonl:1: not a Mooncake trace row.*hash_ids"):
        read_trace(path)


def test_f9_runs_on_any_mooncake_trace_and_measures_its_hit(tmp_path):
    from pdd_sglang.sim.experiments import trace_study
    rows = [{"timestamp": 500 * i, "input_length": 2048, "output_length": 8,
             "hash_ids": [0, 1, 2, 100 + i]} for i in range(40)]     # 3 of 4 blocks shared
    path = tmp_path / "shared_prefix.jsonl"
    write_mooncake_trace(path, rows)
    out = trace_study(quick=True, trace_path=path)
    assert len(out) == 10
    for summary in out.values():
        assert summary.finished == 40
        assert 0.6 < summary.prefill_hit < 0.75       # 1536 of 2048 tokens after the first
