"""The WAN's KV codecs (pdd_sglang.kv_codec) and auto's rule (pdd_sglang.policy.wan_codec):
lossless is bit-exact in every pool dtype, fp8's error is bounded per row, a damaged or mismatched
frame is refused before a byte reaches the pages, and auto codes a copy only where it is shorter."""

from __future__ import annotations

import math

import pytest
import torch

from pdd_sglang.kv_codec import (CODECS, HEADER, CorruptFrame, codec_named, frame_codec_name)
from pdd_sglang.policy.wan_codec import RAW, CodecCost, choose_wan_codec, coded_copy_seconds

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def kv_like(dtype: torch.dtype, tokens: int = 64, heads: int = 4, head_dim: int = 32,
            seed: int = 0) -> torch.Tensor:
    """KV-shaped values: rows of varied magnitude, as heads' keys and values are."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn(tokens, heads, head_dim, generator=generator)
    scale = torch.exp(torch.randn(tokens, heads, 1, generator=generator))
    return (rows * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["raw", "lossless"])
def test_exact_codecs_are_bit_exact(name, dtype):
    kv = kv_like(dtype)
    kv[0, 0, :3] = torch.tensor([0.0, -0.0, float("inf")]).to(dtype)
    into = torch.full_like(kv, 7)
    codec = codec_named(name)
    codec.decode(codec.encode(kv), into)
    assert torch.equal(kv.view(torch.uint8), into.view(torch.uint8))


def test_lossless_shrinks_values_of_similar_magnitude():
    kv = kv_like(torch.bfloat16, tokens=512)
    frame = CODECS["lossless"].encode(kv)
    assert len(frame) < 0.9 * kv.numel() * kv.element_size()


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_error_is_bounded_by_each_rows_scale(dtype):
    kv = kv_like(dtype, seed=1)
    into = torch.empty_like(kv)
    frame = CODECS["fp8"].encode(kv)
    CODECS["fp8"].decode(frame, into)
    exact, back = kv.float(), into.float()
    row_max = exact.abs().amax(dim=-1, keepdim=True)
    # e4m3 keeps 3 mantissa bits (a relative error of at most 2^-4); values far below their row's
    # maximum fall to e4m3's subnormal step (2^-9 x the row's scale, well under the row max x 2^-9).
    bound = exact.abs() * 2 ** -4 + row_max * 2 ** -9
    if dtype is not torch.float32:  # the decoded value is rounded to the pool's dtype again
        bound += back.abs() * 2 ** -7
    assert ((exact - back).abs() <= bound).all()
    raw_bytes = kv.numel() * kv.element_size()
    # One byte per value and a 4-byte scale per row of 32.
    assert len(frame) - HEADER.size == kv.numel() + 4 * kv.numel() // 32
    assert len(frame) < raw_bytes


def test_fp8_keeps_an_all_zero_row_zero():
    kv = torch.zeros(2, 2, 8)
    into = torch.ones_like(kv)
    CODECS["fp8"].decode(CODECS["fp8"].encode(kv), into)
    assert not into.any()


@pytest.mark.parametrize("name", sorted(CODECS))
def test_a_damaged_frame_is_refused_and_the_pages_are_untouched(name):
    codec = codec_named(name)
    kv = kv_like(torch.float32)
    frame = bytearray(codec.encode(kv))
    into = torch.full_like(kv, 3.0)
    flipped = frame[:HEADER.size] + bytes([frame[HEADER.size] ^ 1]) + frame[HEADER.size + 1:]
    for damaged in (frame[:HEADER.size - 1], frame[:-5], flipped):
        with pytest.raises(CorruptFrame):
            codec.decode(bytes(damaged), into)
    assert (into == 3.0).all()


def test_a_frame_for_other_pages_or_another_codec_is_refused():
    kv = kv_like(torch.float32)
    frame = CODECS["lossless"].encode(kv)
    with pytest.raises(CorruptFrame, match="does not fit"):
        CODECS["lossless"].decode(frame, torch.empty(kv.numel() // 2))
    with pytest.raises(CorruptFrame, match="does not fit"):
        CODECS["lossless"].decode(frame, torch.empty_like(kv, dtype=torch.bfloat16))
    with pytest.raises(CorruptFrame, match="codec"):
        CODECS["raw"].decode(frame, torch.empty_like(kv))
    assert frame_codec_name(frame) == "lossless"
    with pytest.raises(CorruptFrame):
        frame_codec_name(b"nope" + frame[4:])


def test_unknown_names_and_dtypes_are_refused():
    with pytest.raises(ValueError, match="no KV codec 'zip'"):
        codec_named("zip")
    with pytest.raises(ValueError, match="dtype"):
        CODECS["lossless"].encode(torch.zeros(4, dtype=torch.int32))


# --- auto's rule ---------------------------------------------------------------------------
LOSSLESS = CodecCost("lossless", ratio=1.5, encode_bytes_per_s=300e6, decode_bytes_per_s=600e6)
FP8 = CodecCost("fp8", ratio=2.0, encode_bytes_per_s=1e12, decode_bytes_per_s=1e12,
                lossless=False)


def test_raw_copy_is_bytes_over_rate():
    assert coded_copy_seconds(100e6, 10e6, RAW, window_bytes=4e6) == pytest.approx(10.0)


def test_a_coded_copy_is_paced_by_its_slowest_stage_plus_the_pipelines_fill():
    # 10 MB/s line: the wire (100 MB / 1.5 / 10 MB/s) paces it.
    assert coded_copy_seconds(100e6, 10e6, LOSSLESS, 3e6) == pytest.approx(
        100 / 1.5 / 10 + 3 / 300 + 3 / 600)
    # 1 GB/s line: the encoder (100 MB / 300 MB/s) paces it.
    assert coded_copy_seconds(100e6, 1e9, LOSSLESS) == pytest.approx(100 / 300)


def test_auto_codes_a_copy_only_where_it_is_shorter():
    assert choose_wan_codec(100e6, 10e6, [LOSSLESS]) is LOSSLESS      # a slow line: it pays
    assert choose_wan_codec(100e6, 1e9, [LOSSLESS]) is RAW            # a fast line: CPU-bound
    assert choose_wan_codec(100e6, 10e6, [FP8]) is RAW                # lossy: never auto's
    assert choose_wan_codec(0, 10e6, [LOSSLESS]) is RAW               # a tie: raw


@pytest.mark.parametrize("field", ["ratio", "encode_bytes_per_s", "decode_bytes_per_s"])
def test_codec_cost_rejects_nonsense(field):
    for bad in (0, -1, math.nan):
        with pytest.raises(ValueError, match=field):
            CodecCost("x", **{"ratio": 1.0, "encode_bytes_per_s": 1.0, "decode_bytes_per_s": 1.0,
                              field: bad})


# --- the bench's measurement (scripts/bench_wan_codec.py) ----------------------------------
def test_the_bench_measures_each_codec_with_the_issues_fields():
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[2] / "scripts" / "bench_wan_codec.py"
    spec = importlib.util.spec_from_file_location("bench_wan_codec", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    tensors = [kv_like(torch.float32, seed=s) for s in range(3)]
    for name in CODECS:
        entry = bench.measure_codec(name, tensors, repeats=1)
        assert {"codec", "ratio", "compress_mb_s", "decompress_mb_s"} <= entry.keys()
        assert entry["bit_exact"] is CODECS[name].lossless
        cost = bench.codec_cost(entry)
        assert cost.name == name and cost.lossless is CODECS[name].lossless
    assert bench.codec_cost(bench.measure_codec("raw", tensors, repeats=1)) == RAW


def test_the_benchs_demo_section_has_the_issues_fields_for_on_and_off(tmp_path, monkeypatch):
    """``--demo``: two demo runs (codec auto, then raw), PDD's figures from each demo.json."""
    import importlib.util
    import json
    import subprocess
    from pathlib import Path
    from types import SimpleNamespace
    path = Path(__file__).resolve().parents[2] / "scripts" / "bench_wan_codec.py"
    spec = importlib.util.spec_from_file_location("bench_wan_codec", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    runs = []

    def fake_demo(argv, **kwargs):
        codec, out = argv[argv.index("--wan-kv-codec") + 1], Path(argv[argv.index("--out") + 1])
        runs.append((argv[2:argv.index("--wan-kv-codec")], codec))
        out.mkdir(parents=True)
        wan = 800 if codec == "auto" else 1000
        (out / "demo.json").write_text(json.dumps({
            "setups": {"pdd": {"wan_bytes": wan, "ttft_p50_s": 0.5, "ttft_p99_s": 1.0,
                               "relay_busy_share": 0.2, "kv_bytes_to_main": 1000}},
            "bar": {"pdd_handoff_share": 0.9, "errors": 0}, "leaks": {},
            "wan_kv_codec": {"flag": codec}}))
        return SimpleNamespace(returncode=0)

    monkeypatch.setattr(subprocess, "run", fake_demo)
    demo = bench.demo_on_off(tmp_path, ["--quick"])
    assert runs == [(["--quick"], "auto"), (["--quick"], "raw")]
    for side in ("on", "off"):
        assert {"wan_bytes", "ttft_p50_s", "ttft_p99_s", "handoff_share",
                "relay_busy_share"} <= demo[side].keys()
    assert (demo["on"]["wan_bytes"], demo["off"]["wan_bytes"]) == (800, 1000)
