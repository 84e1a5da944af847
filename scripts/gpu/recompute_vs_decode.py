#!/usr/bin/env python3
"""Is MD's recompute of handed tokens nearly free? EXTEND of N tokens vs one decode step, on a GPU.

PDD's handoff sends the relay's token IDs, and the main recomputes their KV in one EXTEND forward
over the prompt's cached KV. The report argues this costs almost nothing because decode is
memory-bound: an EXTEND of N tokens reads the same weights and the same 64K-token KV cache as one
decode step, and only its (small) compute grows with N. This script measures that claim in pure
torch (no SGLang: the lent GPU machines have torch, not our pinned SGLang), on dummy weights at a
real model's layer shapes (Llama-3-70B: hidden 8192, 64 query heads, 8 KV heads of 128, MLP
28672, bf16), over a ``--layers``-deep stack:

* decode: a batch of ``--batch`` requests, each with a ``--context``-token KV cache, one token each;
* extend N: the same batch where one request feeds N tokens (N = 1, 16, 64, 100) instead of one.

It prints the median time of each and its ratio to the decode step, last, as a short table.
Without CUDA it says so and exits 0 (``--allow-cpu`` runs tiny shapes on the CPU to check the code).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def build(torch, layers, hidden, heads, kv_heads, head_dim, mlp, device, dtype):
    gen = torch.Generator(device="cpu").manual_seed(0)

    def weight(*shape):
        return (torch.randn(*shape, generator=gen) * 0.02).to(device=device, dtype=dtype)

    return [
        {
            "qkv": weight(hidden, (heads + 2 * kv_heads) * head_dim),
            "out": weight(heads * head_dim, hidden),
            "up": weight(hidden, 2 * mlp),
            "down": weight(mlp, hidden),
        }
        for _ in range(layers)
    ]


def forward(torch, stack, x, caches, new_tokens, heads, kv_heads, head_dim):
    """x: [total_new_tokens, hidden]; caches: per layer (k, v) of [batch, kv_heads, ctx, dim];
    new_tokens: tokens per request (the KV of new tokens is computed but, as in a real step,
    attends over the cached context plus itself)."""
    F = torch.nn.functional
    for layer, (k_cache, v_cache) in zip(stack, caches):
        qkv = x @ layer["qkv"]
        q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        outputs, offset = [], 0
        for req, n in enumerate(new_tokens):
            qr = q[offset:offset + n].view(n, heads, head_dim).transpose(0, 1).unsqueeze(0)
            kr = k[offset:offset + n].view(n, kv_heads, head_dim).transpose(0, 1).unsqueeze(0)
            vr = v[offset:offset + n].view(n, kv_heads, head_dim).transpose(0, 1).unsqueeze(0)
            keys = torch.cat([k_cache[req:req + 1], kr], dim=2)
            values = torch.cat([v_cache[req:req + 1], vr], dim=2)
            out = F.scaled_dot_product_attention(qr, keys, values, enable_gqa=True)
            outputs.append(out.squeeze(0).transpose(0, 1).reshape(n, heads * head_dim))
            offset += n
        x = x + torch.cat(outputs) @ layer["out"]
        gate, up = (x @ layer["up"]).chunk(2, dim=-1)
        x = x + (F.silu(gate) * up) @ layer["down"]
    return x


def time_step(torch, fn, iters, cuda):
    for _ in range(3):
        fn()
    samples = []
    for _ in range(iters):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=65536)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--extend", type=int, nargs="+", default=[1, 16, 64, 100])
    parser.add_argument("--allow-cpu", action="store_true", help="tiny shapes on the CPU (code check)")
    args = parser.parse_args(argv)

    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.allow_cpu:
        print("no CUDA device: skipping (run on a GPU machine; --allow-cpu checks the code)")
        return 0
    if cuda:
        device, dtype = "cuda", torch.bfloat16
        hidden, heads, kv_heads, head_dim, mlp = 8192, 64, 8, 128, 28672
        context, batch, layers = args.context, args.batch, args.layers
    else:
        device, dtype = "cpu", torch.float32
        hidden, heads, kv_heads, head_dim, mlp = 256, 8, 2, 32, 512
        context, batch, layers = 512, 2, 2

    stack = build(torch, layers, hidden, heads, kv_heads, head_dim, mlp, device, dtype)
    caches = [
        (torch.randn(batch, kv_heads, context, head_dim, device=device, dtype=dtype),
         torch.randn(batch, kv_heads, context, head_dim, device=device, dtype=dtype))
        for _ in range(layers)
    ]
    rows = []
    with torch.inference_mode():
        for extend in [1, *[n for n in args.extend if n != 1]]:
            new_tokens = [extend] + [1] * (batch - 1)
            x = torch.randn(sum(new_tokens), hidden, device=device, dtype=dtype)
            seconds = time_step(
                torch, lambda: forward(torch, stack, x, caches, new_tokens, heads, kv_heads, head_dim),
                args.iters, cuda,
            )
            rows.append((extend, seconds))
    base = rows[0][1]
    name = torch.cuda.get_device_name() if cuda else "cpu (tiny shapes: a code check, not a figure)"
    shape = "Llama-3-70B layer shape" if cuda else f"hidden {hidden}"
    print(f"\ndevice: {name}; {layers} layers, {shape}; context {context}; batch {batch}")
    print(f"{'step':<28}{'median ms':>10}{'x decode':>10}")
    for extend, seconds in rows:
        label = "decode (1 token each)" if extend == 1 else f"one request extends {extend}"
        print(f"{label:<28}{seconds * 1e3:>10.2f}{seconds / base:>10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
