"""The prefill cost model by hand, and validate_sim's handling of a real demo.json."""

import importlib.util
from dataclasses import replace
import json
from pathlib import Path

import pytest

from pdd_sglang.sim.cluster import ClusterConfig, Setup, simulate
from pdd_sglang.sim.profiles import InstanceCost, load_hardware, load_model
from pdd_sglang.sim.workload import Request

ROOT = Path(__file__).resolve().parents[2]


def test_prefill_of_a_90pct_hit_64k_request_by_hand():
    hw, model = load_hardware("gpu_a"), load_model("moe_1t_50kb")
    cost = InstanceCost(hw, model)
    new, cached = 6554, 58982                       # 64K at 90% hit
    # attention on ONE GPU (DP attention) at the cited attention MFU, MoE on all 16 at the
    # cited prefill MFU, the new KV written once, one fixed cost per 8192-token chunk
    attention = 2.5e6 * new * (cached + new / 2) / (1 * 989e12 * 0.60)
    linear = 2 * 32e9 * new / (16 * 989e12 * 0.49)
    kv_write = new * 50_000 / (3.35e12 * 0.80)
    forwards = 1                                    # 6554 new tokens: one chunk
    assert cost.prefill_lanes == 16
    assert cost.prefill_seconds(new, cached) == pytest.approx(
        attention + kv_write + linear + forwards * 0.030, rel=1e-12)
    # the attention over the cached context, on one GPU, dominates the new tokens' MoE work
    assert attention > 10 * linear
    # with every lane busy, each lane gets 1/16 of the instance's linear layers
    assert cost.prefill_seconds(new, cached, concurrent=16) == pytest.approx(
        attention + kv_write + 16 * linear + 0.030, rel=1e-12)
    assert cost.prefill_seconds(new, cached, concurrent=99) == cost.prefill_seconds(new, cached, 16)


def test_chunked_prefill_pays_one_fixed_cost_per_chunk_and_keeps_the_attention_pairs():
    hw, model = load_hardware("gpu_a"), load_model("moe_1t_50kb")
    cost = InstanceCost(hw, model)
    whole = InstanceCost(replace(hw, chunked_prefill_tokens=0), model)
    # a cold 64K prompt is 8 chunks of 8192: 7 more fixed costs than one pass, nothing else
    assert cost.prefill_seconds(65536, 0) - whole.prefill_seconds(65536, 0) == pytest.approx(
        7 * hw.prefill_overhead_s, rel=1e-9)
    assert cost.prefill_seconds(8193, 0) - cost.prefill_seconds(8192, 0) > hw.prefill_overhead_s


def test_a_lightly_loaded_decoder_is_bound_by_expert_parallel_communication():
    model = load_model("moe_1t_50kb")
    for name in ("gpu_a", "gpu_b"):
        hw = load_hardware(name)
        step = InstanceCost(hw, model).forward_seconds(1, 65536)
        # DeepEP EP16: (118 + 195) us per MoE layer x 60 layers, plus the step overhead
        assert step == pytest.approx(60 * 313e-6 + hw.step_overhead_s, rel=1e-9)


def test_prefill_time_grows_with_cached_context_and_new_tokens():
    cost = InstanceCost(load_hardware("gpu_a"), load_model("moe_1t_50kb"))
    by_context = [cost.prefill_seconds(2000, c) for c in (0, 8000, 32000, 64000)]
    by_new = [cost.prefill_seconds(n, 32000) for n in (100, 1000, 4000, 16000)]
    assert by_context == sorted(by_context) and by_new == sorted(by_new)


def test_prefill_lanes_run_concurrently_and_share_the_moe():
    # 16 identical requests at once on one instance: all lanes busy, all finish together
    cost = InstanceCost(load_hardware("gpu_a"), load_model("moe_1t_50kb"))
    requests = [Request(i, 0.0, 2048, 1, (1000 + 4 * i, 1001 + 4 * i, 1002 + 4 * i, 1003 + 4 * i),
                        ()) for i in range(16)]
    _, cluster = simulate(ClusterConfig(setup=Setup.SAME_DC_PD, prefill_instances=1), requests)
    done = [j.prefill_done_s for j in cluster.jobs]
    dispatch = load_hardware("gpu_a").dispatch_latency_s
    expected = [dispatch + cost.prefill_seconds(2048, 0, concurrent=k + 1) for k in range(16)]
    assert done == pytest.approx(expected, rel=1e-9)
    assert len({j.prefill_lane for j in cluster.jobs}) == 16


def _validate_module():
    spec = importlib.util.spec_from_file_location("validate_sim", ROOT / "scripts/validate_sim.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_validate_sim_compares_only_measured_setups_and_uses_the_files_line(tmp_path, capsys):
    validate = _validate_module()
    demo = {"setups": {"same_dc_pd": {"ttft_p50_s": 0.5, "ttft_p90_s": 1.0, "ttft_p99_s": 2.0,
                                      "itl_p50_ms": 40.0, "itl_p99_ms": None, "wan_bytes": 0,
                                      "requests": 20, "errors": 0},
                       "pdd": {"status": "pending", "reason": "not built"}},
            "line": {"rate_mbit": 30.0, "rtt_ms": 40.0, "jitter_ms": 4.0,
                     "kv_bytes_per_token": 8192},
            "workload": {"prompt_tokens": {"mean": 2400.0}, "output_tokens": {"mean": 16.0}}}
    path = tmp_path / "demo.json"
    path.write_text(json.dumps(demo))
    assert validate.main(["--measured", str(path)]) == 0
    out = capsys.readouterr().out
    assert "cross_dc_pd: not compared (absent)" in out
    assert "pdd: not compared (status 'pending')" in out
    assert "line rate = 30 Mbit/s (measured file)" in out
    assert "KV bytes/token = 8192 (measured file)" in out
    compared = [line.split()[:2] for line in out.splitlines() if line.startswith("same_dc_pd ")]
    # itl_p99_ms is null in the file, so it is not compared; wan_bytes 0 gives a NaN ratio only
    assert [q for _, q in compared] == ["ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "itl_p50_ms",
                                        "wan_bytes"]


def test_validate_sim_without_any_measured_setup_says_so(tmp_path):
    validate = _validate_module()
    path = tmp_path / "demo.json"
    path.write_text(json.dumps({"setups": {"pdd": {"status": "pending"}}}))
    assert validate.main(["--measured", str(path)]) == 1
    assert validate.main(["--measured", str(tmp_path / "missing.json")]) == 2


# The lead's measured `scripts/demo.py --quick` run (2026-11-29 17:36), kept as measured.
DEMO_QUICK = ROOT / "tests/sim/fixtures/demo_quick_2026-11-29.json"


def test_cpu_profile_numbers_are_the_ones_derived_from_the_same_dc_rows():
    validate = _validate_module()
    derived = validate.derive_cpu_profile(json.loads(DEMO_QUICK.read_text()))
    hardware = load_hardware("cpu_demo")
    assert hardware.prefill_mfu == pytest.approx(derived["prefill_mfu"], rel=0.01)
    assert hardware.dispatch_latency_s == pytest.approx(derived["dispatch_latency_s"], rel=0.01)
    assert hardware.step_overhead_s == pytest.approx(derived["step_overhead_s"], rel=0.01)


def test_simulated_cpu_demo_ttft_is_within_2x_of_the_measured_one(capsys):
    validate = _validate_module()
    rows = validate.compare(json.loads(DEMO_QUICK.read_text()))
    ratios = {(setup, key): ratio for setup, key, _, _, ratio in rows}
    assert "same_dc_pd: replaying its 30 measured requests" in capsys.readouterr().out
    # same-DC is fitted (see cpu_demo.toml); cross-DC is out of sample: only the line differs
    for setup in ("same_dc_pd", "cross_dc_pd"):
        for key in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s"):
            assert 0.5 <= ratios[(setup, key)] <= 2.0, (setup, key, ratios[(setup, key)])
    assert 0.5 <= ratios[("cross_dc_pd", "wan_bytes")] <= 2.0


def test_replayed_turns_extend_the_previous_context_and_share_the_system_prompt():
    from pdd_sglang.sim.workload import replay_rows
    rows = [{"conversation": 0, "turn": 0, "prompt_tokens": 110, "output_tokens": 5, "sent_at": 10.0},
            {"conversation": 1, "turn": 0, "prompt_tokens": 120, "output_tokens": 3, "sent_at": 10.5},
            {"conversation": 0, "turn": 1, "prompt_tokens": 130, "output_tokens": 4, "sent_at": 12.0}]
    requests, warmup = replay_rows(rows, system_tokens=100)
    a, b, a2 = requests
    assert [r.arrival_s for r in requests] == [0.0, 0.5, 2.0]
    assert warmup[0].prompt_blocks == tuple(range(100))
    assert a.prompt_blocks[:100] == b.prompt_blocks[:100] == tuple(range(100))
    assert a.prompt_blocks[100] != b.prompt_blocks[100]
    assert len(a.context_blocks) == 115 and a2.prompt_blocks[:115] == a.context_blocks
    assert len(set(a2.prompt_blocks[115:]) & set(a.context_blocks + b.context_blocks)) == 0
