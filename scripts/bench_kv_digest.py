"""What --pdd-enable-kv-digest costs a decode scheduler's step, before and after #14 item 5.

A stand-in scheduler loop runs fixed "decode steps" (a matmul of about a tiny model's step) on
its thread while a request's prompt KV is digested, as the relay and main do when it lands:

  off     no digest;
  before  the old path: copy the prompt's KV rows to the host and blake2b each token in a
          Python loop, on the scheduler thread (kept here as the reference);
  after   kv_digest.PendingHashes: started on the scheduler thread, hashed by vectorized
          integer passes on a worker thread (on a GPU: queued on the stream), read once ready.

The KV pool has a real model's layout (default 24 layers x 4 KV heads x head dim 128 in bf16,
48 KiB per token, the issue's ~50 KB) and the prompt's slots are scattered as pages are. For
8K and 32K prompt tokens it prints and writes to OUT/kv_digest_bench.json: the scheduler
thread's stall to start the digest, the longest step while digesting, the median step, and
the hashing's own wall time. CPU figures: they say what the scheduler thread pays, not what a
GPU server's step costs (on a GPU the hash is a few kernels over data already on the device).

    python scripts/bench_kv_digest.py --out out/bench
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from pdd_sglang.diagnostics import kv_digest


class Pool:
    def __init__(self, slots: int, layers: int, heads: int, dim: int, dtype: torch.dtype):
        self.start_layer, self.layer_num = 0, layers
        gen = torch.Generator().manual_seed(1)
        self.k = [torch.randn(slots, heads, dim, generator=gen).to(dtype) for _ in range(layers)]
        self.v = [torch.randn(slots, heads, dim, generator=gen).to(dtype) for _ in range(layers)]

    def get_key_buffer(self, layer):
        return self.k[layer]

    def get_value_buffer(self, layer):
        return self.v[layer]


def scheduler_with(pool: Pool, tokens: int, capacity: int):
    slots = torch.randperm(capacity, generator=torch.Generator().manual_seed(2))[:tokens]
    scheduler = SimpleNamespace(
        req_to_token_pool=SimpleNamespace(req_to_token=slots.view(1, -1)),
        token_to_kv_pool_allocator=SimpleNamespace(get_kvcache=lambda: pool))
    req = SimpleNamespace(origin_input_ids=range(tokens), kv=SimpleNamespace(req_pool_idx=0))
    return scheduler, req


def old_token_hashes(scheduler, req) -> bytes:
    """The path this change replaced: host copy, then blake2b per token in Python."""
    raw = kv_digest._token_rows(scheduler, req).view(torch.uint8).numpy()
    return b"".join(hashlib.blake2b(row.tobytes(), digest_size=8).digest() for row in raw)


def step_times(mode: str, scheduler, req, steps: int, work: torch.Tensor) -> dict:
    """Run ``steps`` decode steps; digest the request at the third. Per-step seconds."""
    times, pending, started, stall = [], None, None, 0.0
    hashing_s = None
    for step in range(steps):
        began = time.perf_counter()
        if step == 2 and mode != "off":
            started = time.perf_counter()
            if mode == "before":
                old_token_hashes(scheduler, req)
                hashing_s = time.perf_counter() - started
            else:
                pending = kv_digest.PendingHashes.start(scheduler, req, background=True)
            stall = time.perf_counter() - started
        if pending is not None and hashing_s is None and pending.ready():
            hashing_s = time.perf_counter() - started
            pending.result()
        work @ work  # the step's own work
        times.append(time.perf_counter() - began)
    if pending is not None and hashing_s is None:
        pending.result()
        hashing_s = time.perf_counter() - started
    return {"stall_s": stall, "max_step_s": max(times), "median_step_s": statistics.median(times),
            "hashing_s": hashing_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    capacity = max(args.tokens) + 1024
    pool = Pool(capacity, args.layers, args.heads, args.head_dim, torch.bfloat16)
    bytes_per_token = args.layers * 2 * args.heads * args.head_dim * 2
    work = torch.randn(384, 384)
    results = {"bytes_per_token": bytes_per_token, "torch_threads": torch.get_num_threads(),
               "device": "cpu", "by_tokens": {}}
    print(f"KV {bytes_per_token / 1024:.0f} KiB/token, {args.steps} steps per run, CPU")
    print(f"{'tokens':>7} {'mode':>7} {'stall ms':>9} {'max step ms':>12} "
          f"{'median step ms':>15} {'hashing ms':>11}")
    for tokens in args.tokens:
        scheduler, req = scheduler_with(pool, tokens, capacity)
        assert kv_digest.token_hashes(scheduler, req) == kv_digest.token_hashes(scheduler, req)
        row = {}
        for mode in ("off", "before", "after"):
            row[mode] = step_times(mode, scheduler, req, args.steps, work)
            r = row[mode]
            hashing = "-" if r["hashing_s"] is None else f"{r['hashing_s'] * 1e3:.1f}"
            print(f"{tokens:>7} {mode:>7} {r['stall_s'] * 1e3:>9.2f} "
                  f"{r['max_step_s'] * 1e3:>12.1f} {r['median_step_s'] * 1e3:>15.2f} {hashing:>11}")
        results["by_tokens"][str(tokens)] = row
    kv_digest.PendingHashes.shutdown()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kv_digest_bench.json").write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out / 'kv_digest_bench.json'}")


if __name__ == "__main__":
    main()
