#!/usr/bin/env python3
"""A measured GPU profile in the simulator's format, in one command (issue 25, item 6).

    python scripts/gpu/profile_gpu.py --base gpu_a --out configs/hardware/gpu_a_measured.toml
    python scripts/gpu/profile_gpu.py --allow-cpu --out /tmp/x.toml     # tiny shapes, code check

The GPU counterpart of scripts/profile_cpu.py, in pure torch (the lent GPU machines have torch,
not our pinned SGLang): dummy weights at a real model's layer shapes (default Llama-3-70B-like:
hidden 8192, 64 query heads, 8 KV heads of 128, MLP 28672, bf16) over a --layers-deep stack,
scaled to --model-layers (the layers are identical, so a forward's time is linear in them).

* prefill: one forward of B requests of N new tokens after C cached ones (SDPA over the cache
  plus the new tokens), least squares
      t = prefill_fixed_s + prefill_s_per_token x B N + prefill_s_per_token_pair x B N (C + N/2)
* decode: one token for each of B requests at context L, least squares
      step = decode_fixed_s + decode_s_per_request x B + decode_s_per_context_token x B L
* KV copies on the instance: device-to-device and pinned host-to-device copy rates (a lower
  bound on what a transfer engine's copy in and out of the paged pool costs).

It writes a hardware profile (the --base profile's roofline fields, which the simulator ignores
while the measured coefficients are set, plus the coefficients and a [sources] table) and prints
the fits.  What it cannot measure: the model's real kernels (FlashMLA, DeepEP), tensor and expert
parallelism across GPUs (one GPU, no collectives), and the WAN.  Without CUDA it says so and
exits 0 unless --allow-cpu.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import tomllib
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

from recompute_vs_decode import build, forward, time_step  # noqa: E402

GPU_SHAPE = dict(hidden=8192, heads=64, kv_heads=8, head_dim=128, mlp=28672)
CPU_SHAPE = dict(hidden=256, heads=8, kv_heads=2, head_dim=32, mlp=512)
GPU_PLAN = {"prefill": [(512, 0, 1), (2048, 0, 1), (8192, 0, 1), (2048, 16384, 1), (512, 0, 4),
                        (1024, 32768, 1)],
            "decode": [(1, 4096), (8, 4096), (32, 4096), (8, 32768), (32, 16384), (64, 8192)]}
CPU_PLAN = {"prefill": [(16, 0, 1), (2048, 0, 1), (512, 1024, 1), (512, 0, 2)],
            "decode": [(1, 64), (8, 2048), (4, 256)]}


def least_squares(rows, targets):
    import torch
    a = torch.tensor(rows, dtype=torch.float64)
    b = torch.tensor(targets, dtype=torch.float64).unsqueeze(1)
    solution = torch.linalg.lstsq(a, b).solution.squeeze(1).tolist()
    return [max(v, 0.0) for v in solution]


def copy_rates(torch, cuda: bool, megabytes: int = 256) -> dict:
    n = megabytes << 20
    src = torch.empty(n, dtype=torch.uint8, device="cuda" if cuda else "cpu")
    dst = torch.empty_like(src)
    d2d = time_step(torch, lambda: dst.copy_(src), 5, cuda)
    host = torch.empty(n, dtype=torch.uint8, pin_memory=cuda)
    h2d = time_step(torch, lambda: src.copy_(host, non_blocking=False), 5, cuda)
    return {"device_to_device_bytes_per_s": n / d2d, "host_to_device_bytes_per_s": n / h2d}


def measure(torch, shape: dict, layers: int, plan: dict, iters: int, device, dtype, cuda) -> dict:
    stack = build(torch, layers, shape["hidden"], shape["heads"], shape["kv_heads"],
                  shape["head_dim"], shape["mlp"], device, dtype)

    def caches(batch, context):
        return [(torch.randn(batch, shape["kv_heads"], context, shape["head_dim"], device=device,
                             dtype=dtype),) * 2 for _ in range(layers)]

    def step(batch, context, new):
        kv = caches(batch, context)
        x = torch.randn(batch * new, shape["hidden"], device=device, dtype=dtype)
        return lambda: forward(torch, stack, x, kv, [new] * batch, shape["heads"],
                               shape["kv_heads"], shape["head_dim"])
    points = ([("prefill", {"fresh": new, "cached": cached, "batch": batch}, (batch, cached, new))
               for new, cached, batch in plan["prefill"]]
              + [("decode", {"batch": batch, "context": context}, (batch, context, 1))
                 for batch, context in plan["decode"]])
    samples: list = [[] for _ in points]
    with torch.inference_mode():
        steps = [step(*args) for _, _, args in points]
        # Round-robin, one timed step a point a round, the median of the rounds: a stall of a
        # shared machine then costs one sample of a few points, not every sample of one (which,
        # point after point, once emptied the prefill fit of a CPU check).
        for _ in range(iters):
            for index, fn in enumerate(steps):
                samples[index].append(time_step(torch, fn, 1, cuda))
    out: dict = {"prefill": [], "decode": []}
    for (kind, fields, _), times in zip(points, samples):
        out[kind].append({**fields, "s": statistics.median(times)})
        label = ("prefill N={fresh} C={cached} B={batch}" if kind == "prefill"
                 else "decode B={batch} L={context}").format(**fields)
        print(f"{label}: {out[kind][-1]['s'] * 1e3:.2f} ms", file=sys.stderr)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="gpu_a", help="hardware profile whose roofline fields "
                        "the output keeps (configs/hardware/NAME.toml)")
    parser.add_argument("--out", type=Path, required=True, help="the hardware TOML to write")
    parser.add_argument("--layers", type=int, default=4, help="layers actually run")
    parser.add_argument("--model-layers", type=int, default=80,
                        help="the served model's layers (times scale by model-layers / layers)")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--allow-cpu", action="store_true", help="tiny shapes on the CPU")
    args = parser.parse_args(argv)
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.allow_cpu:
        print("no CUDA device: nothing measured (run on a GPU machine; --allow-cpu checks the "
              "code on tiny shapes)")
        return 0
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    shape, plan = (GPU_SHAPE, GPU_PLAN) if cuda else (CPU_SHAPE, CPU_PLAN)
    points = measure(torch, shape, args.layers, plan, args.iters, device, dtype, cuda)
    scale = args.model_layers / args.layers
    p_rows = [[1.0, p["batch"] * p["fresh"],
               p["batch"] * p["fresh"] * (p["cached"] + p["fresh"] / 2)]
              for p in points["prefill"]]
    p_fit = least_squares(p_rows, [p["s"] * scale for p in points["prefill"]])
    d_rows = [[1.0, d["batch"], d["batch"] * d["context"]] for d in points["decode"]]
    d_fit = least_squares(d_rows, [d["s"] * scale for d in points["decode"]])
    copies = copy_rates(torch, cuda)
    with open(REPO / "configs" / "hardware" / f"{args.base}.toml", "rb") as handle:
        base = {k: v for k, v in tomllib.load(handle).items() if not isinstance(v, dict)}
    device_name = torch.cuda.get_device_name() if cuda else "cpu (tiny shapes: a code check)"
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    measured = dict(zip(("prefill_fixed_s", "prefill_s_per_token", "prefill_s_per_token_pair"),
                        p_fit))
    measured.update(zip(("decode_fixed_s", "decode_s_per_request", "decode_s_per_context_token"),
                        d_fit))
    decode_sum = sum(v for k, v in measured.items() if k.startswith("decode_"))
    if not measured["prefill_s_per_token"] > 0 or not decode_sum > 0:
        print(f"profile_gpu: a fit came out empty ({measured}); not written", file=sys.stderr)
        return 1
    values = {**base, "name": f"{base.get('name', args.base)}, measured on {device_name}",
              "source": f"scripts/gpu/profile_gpu.py ({stamp}); see [sources]", **measured}
    how = (f"MEASURED: pure-torch forward on {device_name}, {args.layers} layers of "
           f"{shape} scaled to {args.model_layers}; least squares over")
    sources = {**{k: f"{how} {len(points['prefill'])} prefill points" for k in
                  ("prefill_fixed_s", "prefill_s_per_token", "prefill_s_per_token_pair")},
               **{k: f"{how} {len(points['decode'])} decode points" for k in
                  ("decode_fixed_s", "decode_s_per_request", "decode_s_per_context_token")},
               "roofline fields": f"configs/hardware/{args.base}.toml (unused while the measured "
                                  "coefficients are set)",
               "kv_copies": f"MEASURED (not used by the model): {copies}"}
    lines = ["# Written by scripts/gpu/profile_gpu.py; rerun it rather than edit."]
    lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    lines += ["", "[sources]"] + [f"{json.dumps(k)} = {json.dumps(v)}" for k, v in sources.items()]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    args.out.with_suffix(".json").write_text(json.dumps({"points": points, "copies": copies,
                                                         "scale": scale}, indent=1))
    print(json.dumps({**measured, **copies, "written": str(args.out)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
