#!/usr/bin/env python3
"""What each WAN KV codec buys on the line (issue 36): ratio, CPU cost, token agreement, copy time.

On real KV: the WAN demo's tiny model (``WAN_DEMO_MODEL``: 4 layers x 8 KV heads x head dim 32,
float32) runs in-process (transformers) over the demo's prompts (its agentic conversations' first
turns and a document turn) and the tests' word prompts; each layer's K and V of each prompt,
laid out as SGLang's pool holds them (``[tokens, heads, head_dim]``), is one frame, as a window
of contiguous pages would be. The same KV cast to bfloat16 stands for a bf16 pool. No trained
model can be had here (nothing can be downloaded), so **the tiny model's random float32 weights
may compress unlike a trained bf16 model's KV**: read the ratios as this model's, not a forecast.

- ``ratio``: raw bytes over frame bytes (header included); ``compress_mb_s`` and
  ``decompress_mb_s``: raw MB per second on one core (``torch.set_num_threads(1)``), best of 3.
- ``token_agreement``: greedy decoding from KV that went through the codec, against exact KV: the
  prefill's first token is computed on exact KV (as in PD); main decodes ``--new-tokens`` more
  over the coded prompt KV and its own exact KV of new tokens. The share of those tokens equal to
  exact's at the same place (``first_divergence`` per prompt says where they part). Lossless is
  also checked bit-exact here, so its 1.0 is measured, not assumed.
- ``copy``: a copy of ``--copy-tokens`` tokens of KV (4000: 32 MB raw, four demo documents) as
  wire bytes, one per codec and line, through the prefill's own WAN engine across the emulated
  line (``line_bench.run_point``, windowed rule) at 10 and 100 Mbit/s and near the forwarder's
  ceiling (measured first, no rate limit), RTT ``--rtt-ms``. The codec does not run inside these
  copies (the wire path is not wired: issue 36 item 2): ``serial_s`` adds one core's encode and
  decode of the whole copy to the measured copy; ``pipelined_s`` is
  ``policy.wan_codec.coded_copy_seconds`` (per-window overlap) at the line's measured rate;
  ``auto`` is what ``choose_wan_codec`` picks there. On this machine the codec would share its
  2 cores with the line's forwarder and both Mooncake engines, so near the ceiling the CPU
  figures are optimistic.

    sudo .venv/bin/python scripts/bench_wan_codec.py       # out/wan_codec/wan_codec_bench.json
    sudo .venv/bin/python scripts/bench_wan_codec.py --demo  # and the demo, codec on and off
    .venv/bin/python scripts/bench_wan_codec.py --no-line  # codecs only (no root needed)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from pdd_sglang.dev import results as published  # noqa: E402
from pdd_sglang.dev.testing import agentic  # noqa: E402
from pdd_sglang.dev.testing.conversation import word_ids  # noqa: E402
from pdd_sglang.dev.testing.tiny_model import WAN_DEMO_MODEL, ensure_tiny_model  # noqa: E402
from pdd_sglang.kv_codec import CODECS  # noqa: E402
from pdd_sglang.policy.wan_codec import (CodecCost, choose_wan_codec,  # noqa: E402
                                         coded_copy_seconds)

LINE_RATES_MBIT = (10.0, 100.0)
CEILING_SHARE = 0.9   # "near the forwarder's ceiling": this share of its unlimited goodput
KV_SOURCE = ("tiny model (WAN_DEMO_MODEL: random float32 weights, seed 1234), in-process "
             "transformers forward; no trained model is available here")


def prompts() -> dict[str, list[int]]:
    """The demo's prompts (its quick workload: the system prompt and each conversation's task,
    and one document turn) and the tests' word prompts."""
    spec = agentic.WorkloadSpec(conversations=4, turns=3, system_tokens=1024, document_prob=0.34)
    system, conversations = agentic.build(spec)
    found = {f"demo_conversation_{c.index}": system + c.task for c in conversations}
    document = next(new for c in conversations for new, _ in c.turns if len(new) >= 800)
    found["demo_document"] = system + conversations[0].task + document
    for start, count in ((0, 24), (100, 200), (500, 600)):
        found[f"test_words_{start}_{count}"] = word_ids(start, count)
    return found


def load_model():
    from transformers import LlamaForCausalLM
    path = ensure_tiny_model(WAN_DEMO_MODEL)
    return LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def prompt_kv(model, ids: list[int]):
    """(the prefill's first token, its cache, each layer's K and V as [tokens, heads, head_dim])"""
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
    cache = out.past_key_values
    frames = [t[0].transpose(0, 1).contiguous() for layer in cache.layers
              for t in (layer.keys, layer.values)]
    return int(out.logits[0, -1].argmax()), cache, frames


def measure_codec(name: str, tensors: list[torch.Tensor], repeats: int = 3) -> dict:
    """Best of ``repeats`` (the 2 cores are shared: the fastest run is the codec's own cost)."""
    codec = CODECS[name]
    raw = sum(t.numel() * t.element_size() for t in tensors)
    back = [torch.empty_like(t) for t in tensors]
    encode_s = decode_s = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        frames = [codec.encode(t) for t in tensors]
        encode_s = min(encode_s, time.perf_counter() - began)
        began = time.perf_counter()
        for frame, into in zip(frames, back):
            codec.decode(frame, into)
        decode_s = min(decode_s, time.perf_counter() - began)
    exact = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                for a, b in zip(tensors, back))
    if codec.lossless and not exact:
        raise AssertionError(f"codec {name} is declared lossless but changed the KV")
    return {"codec": name, "lossless": codec.lossless, "raw_bytes": raw,
            "wire_bytes": sum(len(f) for f in frames), "ratio": raw / sum(len(f) for f in frames),
            "compress_mb_s": raw / 1e6 / encode_s, "decompress_mb_s": raw / 1e6 / decode_s,
            "bit_exact": exact}


def greedy(model, first: int, cache, new_tokens: int) -> list[int]:
    tokens = [first]
    with torch.no_grad():
        for _ in range(new_tokens):
            out = model(torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True)
            tokens.append(int(out.logits[0, -1].argmax()))
    return tokens[1:]


def through_codec(cache, name: str) -> None:
    """Replace the prompt's KV in ``cache`` by what main would hold after the codec."""
    codec = CODECS[name]
    for layer in cache.layers:
        for tensor in (layer.keys, layer.values):
            pages = tensor[0].transpose(0, 1).contiguous()
            codec.decode(codec.encode(pages), pages)
            tensor[0].copy_(pages.transpose(0, 1))


def token_agreement(model, prompt_ids: dict[str, list[int]], names, new_tokens: int) -> dict:
    per_codec = {name: {"agree": 0, "total": 0, "first_divergence": {}} for name in names}
    for label, ids in prompt_ids.items():
        first, cache, _ = prompt_kv(model, ids)
        exact = greedy(model, first, cache, new_tokens)
        for name in names:
            _, cache, _ = prompt_kv(model, ids)
            through_codec(cache, name)
            got = greedy(model, first, cache, new_tokens)
            entry = per_codec[name]
            entry["agree"] += sum(a == b for a, b in zip(exact, got))
            entry["total"] += len(exact)
            entry["first_divergence"][label] = next(
                (i for i, (a, b) in enumerate(zip(exact, got)) if a != b), None)
    return {name: dict(e, token_agreement=e["agree"] / e["total"]) for name, e in per_codec.items()}


def line_copies(codecs: list[dict], copy_raw_bytes: int, rtt_ms: float, out_dir: Path) -> dict:
    from bench_wan_line import LONG_FAT_LINE_SYSCTLS, ceiling

    from pdd_sglang.dev.wan_emulator import check_prerequisites
    from pdd_sglang.dev.wan_emulator.line_bench import run_point
    from pdd_sglang.prefill.wan_engine import window_for_line

    check_prerequisites()
    ceiling_mbit = ceiling(rtt_ms)
    rates = [*LINE_RATES_MBIT, round(CEILING_SHARE * ceiling_mbit)]
    points = []
    for rate in rates:
        window = window_for_line(rate / 1e3, rtt_ms)
        for entry in codecs:
            wire = int(copy_raw_bytes / entry["ratio"])
            point = run_point(out_dir, rate_mbit=rate, rtt_ms=rtt_ms, copy_bytes=wire,
                              window=window, concurrent=1, sysctls=LONG_FAT_LINE_SYSCTLS)
            run = next(r for r in point["runs"] if r["rule"] == "window")
            copy_s = run["copy_s"][0]
            cost = codec_cost(entry)
            cpu_s = (copy_raw_bytes / cost.encode_bytes_per_s
                     + copy_raw_bytes / cost.decode_bytes_per_s)
            points.append({"rate_mbit": rate, "rtt_ms": rtt_ms, "codec": entry["codec"],
                           "raw_bytes": copy_raw_bytes, "wire_bytes": wire,
                           "line_goodput_mbit": point["goodput_mbit"], "copy_s": copy_s,
                           "serial_s": copy_s + cpu_s,
                           "pipelined_s": coded_copy_seconds(copy_raw_bytes, wire / copy_s, cost,
                                                             window.window_bytes)})
    for rate in rates:
        at_rate = [p for p in points if p["rate_mbit"] == rate]
        raw = next(p for p in at_rate if p["codec"] == "raw")
        chosen = choose_wan_codec(copy_raw_bytes, raw["wire_bytes"] / raw["copy_s"],
                                  [codec_cost(e) for e in codecs],
                                  window_for_line(rate / 1e3, rtt_ms).window_bytes)
        for p in at_rate:
            p["auto"] = chosen.name
    return {"forwarder_ceiling_mbit": ceiling_mbit, "points": points}


def codec_cost(entry: dict) -> CodecCost:
    if entry["codec"] == "raw":
        return CodecCost("raw", 1.0, float("inf"), float("inf"))
    return CodecCost(entry["codec"], entry["ratio"], entry["compress_mb_s"] * 1e6,
                     entry["decompress_mb_s"] * 1e6, entry["lossless"])


def bench(args) -> dict:
    torch.set_num_threads(1)   # per-core figures
    model = load_model()
    prompt_ids = prompts()
    tensors, document_tokens = [], 0
    for label, ids in prompt_ids.items():
        tensors += prompt_kv(model, ids)[2]
        if label == "demo_document":
            document_tokens = len(ids)
    names = list(CODECS)
    codecs = [measure_codec(name, tensors) for name in names]
    agreement = token_agreement(model, prompt_ids, names, args.new_tokens)
    for entry in codecs:
        entry.update(token_agreement=agreement[entry["codec"]]["token_agreement"],
                     first_divergence=agreement[entry["codec"]]["first_divergence"])
    as_bf16 = [measure_codec(name, [t.to(torch.bfloat16) for t in tensors]) for name in names]
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M"), "kv_source": KV_SOURCE,
        "caveat": "the tiny model's random float32 weights may compress unlike a trained bf16 "
                  "model's KV; codecs_bf16_cast is the same KV cast to bfloat16, still this "
                  "model's statistics",
        "prompts": {label: len(ids) for label, ids in prompt_ids.items()},
        "kv_bytes_per_token": WAN_DEMO_MODEL.kv_bytes_per_token,
        "new_tokens": args.new_tokens, "codecs": codecs, "codecs_bf16_cast": as_bf16,
        "demo": None,
        "demo_not_run": "run with --demo (root, the emulated WAN): the quick demo with the "
                        "codec on (--wan-kv-codec auto) and off (raw)",
    }
    if not args.no_line:
        copy_raw = args.copy_tokens * WAN_DEMO_MODEL.kv_bytes_per_token
        result["copy"] = line_copies(codecs, copy_raw, args.rtt_ms, Path(args.out))
        result["copy"]["note"] = ("one copy of --copy-tokens tokens of KV as wire bytes, windowed "
                                  "rule; serial_s and pipelined_s add the codec's one-core cost "
                                  "(measured above), which did not run inside the copy; the codec "
                                  "shares 2 cores with the forwarder and both engines")
    result["document_tokens"] = document_tokens
    if args.demo:
        result["demo"] = demo_on_off(Path(args.out), args.demo_args)
        result.pop("demo_not_run")
    return result


DEMO_FIELDS = ("wan_bytes", "ttft_p50_s", "ttft_p99_s", "relay_busy_share")


def demo_on_off(out: Path, extra: list[str]) -> dict:
    """``scripts/demo.py`` twice, the same workload and line: the prefill's WAN codec on
    (``auto``, its default: lossless where it shortens the copy on the demo's line) and off
    (``raw``); PDD's setup's figures from each run's demo.json."""
    import subprocess

    demo = {"note": "scripts/demo.py " + " ".join(extra) + " with --wan-kv-codec auto (on) and "
                    "raw (off), one after the other; PDD's setup (its TTFT budget) in each"}
    for side, codec in (("on", "auto"), ("off", "raw")):
        run_dir = out / f"demo_{side}"
        started = time.perf_counter()
        proc = subprocess.run([sys.executable, str(Path(__file__).with_name("demo.py")), *extra,
                               "--wan-kv-codec", codec, "--out", str(run_dir)])
        summary = json.loads((run_dir / "demo.json").read_text()) if proc.returncode == 0 \
            else None
        if summary is None:
            demo[side] = {"codec": codec, "failed": f"demo.py exited {proc.returncode}"}
            continue
        pdd = summary["setups"]["pdd"]
        demo[side] = {"codec": codec, **{k: pdd.get(k) for k in DEMO_FIELDS},
                      "handoff_share": summary["bar"]["pdd_handoff_share"],
                      "kv_bytes_to_main": pdd.get("kv_bytes_to_main"),
                      "errors": summary["bar"]["errors"], "leaks": summary["leaks"],
                      "wan_kv_codec": summary.get("wan_kv_codec"),
                      "run_s": round(time.perf_counter() - started, 1)}
    return demo


def print_table(result: dict) -> None:
    print("| codec | ratio | compress MB/s | decompress MB/s | token agreement "
          "| ratio (bf16 cast) |")
    print("|---|---|---|---|---|---|")
    for entry, bf16 in zip(result["codecs"], result["codecs_bf16_cast"]):
        print(f"| {entry['codec']} | {entry['ratio']:.3f} | {entry['compress_mb_s']:.0f} | "
              f"{entry['decompress_mb_s']:.0f} | {entry['token_agreement']:.3f} | "
              f"{bf16['ratio']:.3f} |")
    if "copy" in result:
        print("\n| Mbit/s | codec | wire MB | copy s | serial s | pipelined s | auto |")
        print("|---|---|---|---|---|---|---|")
        for p in result["copy"]["points"]:
            print(f"| {p['rate_mbit']:g} | {p['codec']} | {p['wire_bytes'] / 1e6:.2f} | "
                  f"{p['copy_s']:.2f} | {p['serial_s']:.2f} | {p['pipelined_s']:.2f} | "
                  f"{p['auto']} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--copy-tokens", type=int, default=4000,
                        help="tokens of KV per timed copy (32 MB: long enough that a copy's start "
                             "does not dominate at the ceiling; the demo's documents are 1000)")
    parser.add_argument("--rtt-ms", type=float, default=40.0, help="the demo's line: 40 ms")
    parser.add_argument("--no-line", action="store_true", help="skip the copies (no root needed)")
    parser.add_argument("--out", default="out/wan_codec")
    parser.add_argument("--demo", action="store_true",
                        help="also run the demo with the codec on and off (root, as make demo)")
    parser.add_argument("--demo-args", nargs="*", default=["--quick"],
                        help="scripts/demo.py's arguments for both runs (default: --quick)")
    published.add_publish_flag(parser)
    args = parser.parse_args()
    if args.new_tokens < 1 or args.copy_tokens < 1 or args.rtt_ms <= 0:
        parser.error("--new-tokens, --copy-tokens and --rtt-ms must be positive")
    result = bench(args)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    path = Path(args.out) / "wan_codec_bench.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print_table(result)
    print(f"wrote {path}")
    if args.publish:
        published.publish("wan_codec_bench", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
