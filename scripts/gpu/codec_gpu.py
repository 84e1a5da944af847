#!/usr/bin/env python3
"""What the WAN KV codecs cost on a GPU (issue 36), in pure torch, in one command.

    python scripts/gpu/codec_gpu.py --out codec_gpu.json   # docs/results/codec_gpu.json: the current one
    python scripts/gpu/codec_gpu.py --allow-cpu --out /tmp/x.json     # tiny sizes, code check

At the brief's 10-100 Gbit/s a codec has to keep up with the line: the CPU codecs of
``pdd_sglang.kv_codec`` run at a few hundred MB/s a core (``docs/results/wan_codec_bench.json``),
so where the KV lives on a GPU the transforms have to run there. This measures, on bf16 KV of a
real model's layer shape (8 KV heads of 128, Llama-3-70B-like), for copies of several sizes:

* ``fp8``: the same per-row e4m3 quantization as ``Fp8Codec`` (one float32 scale per row, the
  row's largest magnitude mapped to 448), encode and decode, bytes of bf16 KV per second;
* ``byte_planes``: the lossless codec's transform (byte i of every element together), split and
  merge, bytes per second (the entropy coder after it is not in torch: nvCOMP, if the image has
  its Python package, is reported as found or not, never installed);
* the pinned device->host and host->device copy rates (what a CPU coder would pay first);
* zstd level 1 on the byte planes on one host core, if ``zstandard`` is importable. The KV here
  is synthetic (normal values), so its ratio says nothing about a trained model's: reported only
  to pair with the speed.

Timing: CUDA events around ``--repeats`` runs after a warm-up; the median is reported. Without
CUDA it says so and exits 0 unless --allow-cpu (then the sizes are tiny and the figures mean
nothing: a check that the code runs). ``fp8_rows_like_codec`` is the codec's math on any device;
``tests/unit/test_codec_gpu_script.py`` checks it against ``Fp8Codec`` bit for bit on CPU.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448, as in pdd_sglang.kv_codec
KV_HEADS, HEAD_DIM = 8, 128
GPU_SIZES_MB = (4, 64, 512)
CPU_SIZES_MB = (1,)


def fp8_rows_like_codec(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales [rows, 1] float32, e4m3 values [rows, row]): Fp8Codec.encode's math, any device."""
    rows = kv.reshape(-1, kv.shape[-1]).to(torch.float32)
    scales = rows.abs().amax(dim=1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
    scales = scales / FP8_MAX
    return scales, (rows / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def fp8_restore(scales: torch.Tensor, quantized: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (quantized.to(torch.float32) * scales).to(dtype)


def byte_planes(kv: torch.Tensor) -> torch.Tensor:
    return kv.reshape(-1).view(torch.uint8).reshape(-1, kv.element_size()).t().contiguous()


def merge_planes(planes: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return planes.t().contiguous().view(like.dtype).reshape(like.shape)


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn()``."""
    fn()  # warm-up (kernels, allocator)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            began = time.perf_counter()
            fn()
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def measure_size(size_mb: int, device: torch.device, repeats: int) -> dict:
    tokens = max(1, size_mb * 2**20 // (KV_HEADS * HEAD_DIM * 2))
    kv = torch.randn(tokens, KV_HEADS, HEAD_DIM, device=device).to(torch.bfloat16)
    nbytes = kv.numel() * kv.element_size()
    scales, quantized = fp8_rows_like_codec(kv)
    planes = byte_planes(kv)
    assert torch.equal(merge_planes(planes, kv), kv), "byte planes must round-trip exactly"
    restored = fp8_restore(scales, quantized, kv.dtype).reshape(kv.shape)
    rel_err = ((restored.float() - kv.float()).norm() / kv.float().norm()).item()
    row = {"size_bytes": nbytes, "tokens": tokens,
           "fp8_encode_gb_s": nbytes / timed(lambda: fp8_rows_like_codec(kv), device, repeats) / 1e9,
           "fp8_decode_gb_s": nbytes / timed(lambda: fp8_restore(scales, quantized, kv.dtype),
                                             device, repeats) / 1e9,
           "fp8_wire_ratio": nbytes / (quantized.numel() + 4 * scales.numel()),
           "fp8_relative_error": rel_err,
           "planes_split_gb_s": nbytes / timed(lambda: byte_planes(kv), device, repeats) / 1e9,
           "planes_merge_gb_s": nbytes / timed(lambda: merge_planes(planes, kv), device, repeats) / 1e9}
    if device.type == "cuda":
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        flat = kv.reshape(-1).view(torch.uint8)
        row["d2h_pinned_gb_s"] = nbytes / timed(lambda: host.copy_(flat, non_blocking=True),
                                                device, repeats) / 1e9
        row["h2d_pinned_gb_s"] = nbytes / timed(lambda: flat.copy_(host, non_blocking=True),
                                                device, repeats) / 1e9
    row.update(zstd_on_host(planes))
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}


def zstd_on_host(planes: torch.Tensor) -> dict:
    try:
        import zstandard
    except ImportError:
        return {"zstd": "zstandard not importable here"}
    data = planes.cpu().numpy().tobytes()
    compressor = zstandard.ZstdCompressor(level=1)
    began = time.perf_counter()
    payload = compressor.compress(data)
    seconds = time.perf_counter() - began
    return {"zstd_l1_one_core_mb_s": len(data) / seconds / 1e6,
            "zstd_l1_ratio_synthetic": len(data) / len(payload)}


def nvcomp_found() -> str:
    for module in ("nvidia.nvcomp", "nvcomp", "kvikio.nvcomp"):
        try:
            __import__(module)
            return module
        except ImportError:
            continue
    return "not found"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--allow-cpu", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() and not args.allow_cpu:
        print("codec_gpu: no CUDA device here; nothing measured (--allow-cpu to check the code)")
        return 0
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sizes = GPU_SIZES_MB if device.type == "cuda" else CPU_SIZES_MB
    report = {"device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor(),
              "torch": torch.__version__, "kv_shape": f"[tokens, {KV_HEADS}, {HEAD_DIM}] bf16",
              "kv": "synthetic: torch.randn cast to bf16 (speeds are shape-bound; ratios are not "
                    "a trained model's)",
              "nvcomp": nvcomp_found(), "repeats": args.repeats, "timing": "median of CUDA events",
              "date": time.strftime("%Y-%m-%d"),
              "sizes": [measure_size(size, device, args.repeats) for size in sizes]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    for row in report["sizes"]:
        print(json.dumps(row))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
