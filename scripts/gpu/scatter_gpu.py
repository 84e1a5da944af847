#!/usr/bin/env python3
"""What landing a packed WAN record costs on a GPU main (issue 50), in pure torch, in one command.

    python scripts/gpu/scatter_gpu.py --out scatter_gpu.json
    python scripts/gpu/scatter_gpu.py --allow-cpu --out /tmp/x.json     # tiny sizes, code check

Main's landing thread (``pdd_sglang/decode/wan_staging.py``) takes each record from its staging
slot in host memory and scatters its pages into the KV pool: per pool buffer (a layer's K or V),
the record's pages copied host -> device and ``index_copy_`` into the buffer's page rows, on a
CUDA stream of its own (``PoolPages.scatter``), so the scheduler's decode steps on the default
stream go on beside it. This measures, for a pool of Llama-3-8B's KV geometry (32 layers, K and
V, 8 KV heads of 128, bf16, pages of ``--page-size`` tokens) and records of several sizes:

* ``scatter_gb_s``: record bytes landed per second, from pageable host memory (what the staging
  region is) and from pinned memory (what it could be), each on its own stream;
* ``step_ms_alone`` / ``step_ms_beside_scatter``: a stand-in decode step (a bf16 matmul of the
  8B model's hidden size) on the default stream, alone and while records are scattered on the
  side stream: what a copy landing costs main's other requests' ITL.

Timing: CUDA events (``time.perf_counter`` on CPU) around ``--repeats`` runs after a warm-up;
the median is reported. Without CUDA it says so and exits 0 unless --allow-cpu (then the sizes
are tiny and the figures mean nothing: a check that the code runs). ``scatter_like_pool`` is
``PoolPages.scatter``'s math; ``tests/unit/test_scatter_gpu_script.py`` checks it against
``PoolPages`` on CPU.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

LAYERS, KV_HEADS, HEAD_DIM, HIDDEN = 32, 8, 128, 4096
GPU_RECORD_MB = (1, 12, 32)
CPU_RECORD_MB = (0.25,)


def scatter_like_pool(views: list, pages: torch.Tensor, record: torch.Tensor,
                      stream=None) -> None:
    """``PoolPages.scatter``: the record's ``[buffers, pages, item_len]`` bytes into each
    buffer's page rows, on ``stream`` when given (synchronized before it returns)."""
    def run() -> None:
        index = pages.to(views[0].device, non_blocking=True)
        data = record.to(views[0].device, non_blocking=True)
        for view, part in zip(views, data):
            view.index_copy_(0, index, part)
    if stream is None:
        run()
        return
    with torch.cuda.stream(stream):
        run()
    stream.synchronize()


def _median_s(fn, device: torch.device, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        began = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def measure(record_mb: float, device: torch.device, page_size: int, repeats: int) -> dict:
    item_len = page_size * KV_HEADS * HEAD_DIM * 2  # one page of one buffer, bf16
    buffers = 2 * LAYERS
    pages_per_record = max(int(record_mb * (1 << 20)) // (item_len * buffers), 1)
    pool_pages = 4 * pages_per_record
    views = [torch.zeros(pool_pages, item_len, dtype=torch.uint8, device=device)
             for _ in range(buffers)]
    pages = torch.randperm(pool_pages)[:pages_per_record]
    record = torch.randint(0, 256, (buffers, pages_per_record, item_len), dtype=torch.uint8)
    stream = torch.cuda.Stream() if device.type == "cuda" else None
    row = {"record_mb": round(record.numel() / (1 << 20), 3), "pages": pages_per_record,
           "page_size": page_size}
    sources = {"pageable": record}
    if device.type == "cuda":
        sources["pinned"] = record.pin_memory()
    for name, source in sources.items():
        seconds = _median_s(lambda: scatter_like_pool(views, pages, source, stream), device,
                            repeats)
        row[f"scatter_gb_s_{name}"] = round(source.numel() / seconds / 1e9, 3)
    assert all(torch.equal(v[pages.to(device)].cpu(), r) for v, r in zip(views, record))
    size = HIDDEN if device.type == "cuda" else 256
    hidden = torch.randn(8, size, device=device, dtype=torch.bfloat16 if device.type == "cuda"
                         else torch.float32)
    weight = torch.randn(size, size, device=device, dtype=hidden.dtype) / size ** 0.5

    def step() -> None:
        for _ in range(LAYERS // 8):
            hidden.copy_(torch.tanh(hidden @ weight))
    row["step_ms_alone"] = round(_median_s(step, device, repeats) * 1e3, 3)
    stop = threading.Event()

    def land_records() -> None:
        while not stop.is_set():
            scatter_like_pool(views, pages, sources["pageable"], stream)
    lander = threading.Thread(target=land_records, daemon=True)
    lander.start()
    try:
        row["step_ms_beside_scatter"] = round(_median_s(step, device, repeats) * 1e3, 3)
    finally:
        stop.set()
        lander.join()
    return row


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for flag, kind, default in (("--out", Path, None), ("--repeats", int, 20),
                                ("--page-size", int, 16)):
        parser.add_argument(flag, type=kind, default=default, required=default is None)
    parser.add_argument("--allow-cpu", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    cuda = torch.cuda.is_available()
    if not (cuda or args.allow_cpu):
        print("scatter_gpu: no CUDA device here; nothing measured (--allow-cpu to check the code)")
        return 0
    device = torch.device("cuda" if cuda else "cpu")
    sizes, page_size = (GPU_RECORD_MB, args.page_size) if cuda else (CPU_RECORD_MB, 1)
    rows = []
    for size in sizes:  # each printed as measured: a run cut short still says something
        rows.append(measure(size, device, page_size, args.repeats))
        print(json.dumps(rows[-1]), flush=True)
    device_name = (torch.cuda.get_device_name() if device.type == "cuda"
                   else platform.processor())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "device": device_name, "torch": torch.__version__,
        "pool": f"{LAYERS} layers x K,V, {KV_HEADS} KV heads of {HEAD_DIM}, bf16",
        "repeats": args.repeats, "timing": "median wall time, synchronized", "sizes": rows},
        indent=2))
    print(f"scatter_gpu: wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
