"""scripts/gpu/codec_gpu.py measures the WAN codecs' transforms on a GPU with its own copy of their
math (the GPU image has torch, not this package's dependencies): it must be the codec's math."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import torch

from pdd_sglang.kv_codec import HEADER, Fp8Codec, LosslessCodec

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu" / "codec_gpu.py"


def _script():
    spec = importlib.util.spec_from_file_location("codec_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fp8_math_is_the_codecs_bit_for_bit():
    script = _script()
    kv = (torch.randn(33, 4, 16) * 3).to(torch.bfloat16)
    scales, quantized = script.fp8_rows_like_codec(kv)
    payload = Fp8Codec().encode(kv)[HEADER.size:]
    assert payload == scales.numpy().tobytes() + quantized.view(torch.uint8).numpy().tobytes()


def test_byte_planes_are_the_lossless_codecs_planes():
    script = _script()
    kv = torch.randn(7, 2, 8).to(torch.bfloat16)
    planes = script.byte_planes(kv)
    flat = kv.reshape(-1).view(torch.uint8).numpy().reshape(-1, 2)
    assert np.array_equal(planes.numpy(), np.ascontiguousarray(flat.T))
    assert torch.equal(script.merge_planes(planes, kv), kv)
    assert LosslessCodec  # the codec whose transform this is


def test_runs_on_cpu_when_allowed(tmp_path):
    out = tmp_path / "codec_gpu.json"
    assert _script().main(["--allow-cpu", "--repeats", "2", "--out", str(out)]) == 0
    row = json.loads(out.read_text())["sizes"][0]
    assert row["fp8_wire_ratio"] > 1.9 and 0 < row["fp8_relative_error"] < 0.1
    assert row["fp8_encode_gb_s"] > 0 and row["planes_split_gb_s"] > 0
