"""The simulator's WAN codec (issue 36): declared profiles load, a coded copy puts wire bytes on
the line, auto leaves a copy raw where coding would lengthen it, and a forced lossy codec codes
every copy."""

from pathlib import Path

import pytest

from pdd_sglang.sim.cluster import ClusterConfig, Setup, simulate
from pdd_sglang.sim.profiles import CONFIG_ROOT, load_codec
from pdd_sglang.sim.workload import AgenticConfig, generate_agentic

SMALL = AgenticConfig(rate_per_s=2.0, duration_s=120.0, seed=5)


@pytest.fixture(scope="module")
def small_workload():
    return generate_agentic(SMALL)


def test_every_declared_codec_profile_loads_with_a_source():
    names = sorted(p.stem for p in (CONFIG_ROOT / "codecs").glob("*.toml"))
    assert {"lossless_zipnn", "fp8_e4m3"} <= set(names)
    for name in names:
        profile = load_codec(name)
        assert profile.source and profile.ratio > 1 and profile.codec in ("lossless", "fp8")


def run(small_workload, setup, codec):
    requests, warmup = small_workload
    return simulate(ClusterConfig(setup=setup, wan_link="wan_10g", wan_codec=codec),
                    requests, warmup)


@pytest.mark.parametrize("codec", ["lossless_zipnn", "fp8_e4m3"])
def test_a_free_codec_divides_the_wire_bytes_by_its_ratio(small_workload, codec):
    raw, raw_cluster = run(small_workload, Setup.CROSS_DC_PD, None)
    coded, cluster = run(small_workload, Setup.CROSS_DC_PD, codec)
    ratio = load_codec(codec).ratio
    raw_kv = sum(j.wan_bytes for j in raw_cluster.jobs)
    assert sum(j.wan_bytes for j in cluster.jobs) == pytest.approx(raw_kv / ratio)
    assert coded.finished == raw.finished == len(cluster.jobs)
    assert coded.ttft_p50_s <= raw.ttft_p50_s + 1e-9
    assert coded.ttft_p99_s <= raw.ttft_p99_s + 1e-9


def slow_codec(tmp_path: Path, lossless: bool) -> str:
    path = tmp_path / f"slow_{lossless}.toml"
    codec, flag = ("lossless", "true") if lossless else ("fp8", "false")
    path.write_text(f'name = "slow"\nsource = "test"\ncodec = "{codec}"\nratio = 1.5\n'
                    f'encode_bytes_per_s = 5e8\ndecode_bytes_per_s = 5e8\nlossless = {flag}\n')
    return str(path)


def test_auto_leaves_copies_raw_where_a_slow_codec_would_lengthen_them(small_workload, tmp_path):
    raw, _ = run(small_workload, Setup.PDD, None)
    auto, _ = run(small_workload, Setup.PDD, slow_codec(tmp_path, lossless=True))
    assert auto.as_dict() == raw.as_dict()


def test_a_forced_lossy_codec_codes_every_copy_and_its_cpu_time_counts(small_workload, tmp_path):
    one_request = (small_workload[0][:1], ())      # an idle line: the copy's own time shows
    raw, _ = run(one_request, Setup.CROSS_DC_PD, None)
    forced, cluster = run(one_request, Setup.CROSS_DC_PD, slow_codec(tmp_path, lossless=False))
    job = cluster.jobs[0]
    assert job.wan_bytes == pytest.approx(job.request.input_tokens * cluster.kv_bytes_per_token
                                          / 1.5)
    # 0.5 GB/s of coding against a 1.25 GB/s line: the copy waits for its codec.
    assert forced.ttft_p50_s > raw.ttft_p50_s + 1.0
