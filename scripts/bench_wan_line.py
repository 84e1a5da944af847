#!/usr/bin/env python3
"""Does one WAN copy fill the line, whatever its bandwidth-delay product? (issue 34, item 1)

Over a grid of rate x RTT on the emulated line, real copies through the prefill's own WAN engine
(Mooncake TCP; ``pdd_sglang/dev/wan_emulator/line_bench.py``): one copy, then ``--concurrent``
at once, each at least ``--bdp-multiple`` bandwidth-delay products, the same sender in the same
run under three rules:

- ``one_slice``: the old rule, a window of one 4 MiB slice, each waited for before the next;
- ``window``: one-sided into main's pages, slices of four BDPs with twelve more in flight
  (:func:`~pdd_sglang.prefill.wan_engine.window_for_line`), each slice one Mooncake request per
  KV buffer (``--kv-buffers``: a layer's K and V each, so the model's depth divides the slice);
- ``packed``: the same window, the copy as raw records of half a BDP packed into main's staging
  range through the sender's real ring (:mod:`pdd_sglang.prefill.wan_coded`).

Then, as a reference that is not the product, the same copy over one warm ZMQ TCP stream with one
acknowledgement at its end (:mod:`~pdd_sglang.dev.wan_emulator.stream_reference`,
``stream_reference``, the median of three copies): the best a TCP transport can do for one copy
on that line, so what a rule misses beside it is the transport's and what the reference misses
is the line's and the congestion control's.

Each point says which of the last two the product takes for that model
(:func:`~pdd_sglang.policy.wan_codec.stage_raw`, ``product_rule``). Before each rule's timed copies, ``--warm-copies``
untimed ones open the pooled lanes' congestion windows, as a serving prefill's persistent lanes
are (with ``tcp_slow_start_after_idle=0`` they stay open between copies). ``utilization`` is the
achieved rate over the line's own TCP goodput at that point (``line_bench.line_goodput``:
``measure.bulk_rate`` as ``scripts/wan_check.py`` measures it, its warm-up scaled to the RTT). Also
measures the forwarder's ceiling (no rate limit), which bounds the grid.

Both namespaces get the host tuning a long fat line needs, as any bulk-transfer host does:
``tcp_slow_start_after_idle=0`` (Mooncake's pooled connections idle between copies) and socket
buffers up to 64 MiB (``tcp_rmem``/``tcp_wmem``; Linux's default 4 MiB send buffer caps one
connection's window below a 5 MB BDP). docs/operations.md says the same for real hosts.

    sudo .venv/bin/python scripts/bench_wan_line.py                 # the default grid
    sudo .venv/bin/python scripts/bench_wan_line.py --points 200x100 --concurrent 2
Writes ``out/wan_line_bench/wan_line_bench.json`` (``--out``).

``--serving``: instead, copies through real PDD prefill and main servers on the KV-realistic
models (32 layers with rooms of 256 and 1,024 tokens, 80 layers with 256; ``--serving-copies``)
at 100 x 40 and 200 x 100 (``--points``), one row per copy in the file's ``serving`` list
(:mod:`pdd_sglang.dev.wan_emulator.serving_bench` says what each field measures). Hold
/tmp/pdd-servers.lock on a shared machine:

    sudo flock /tmp/pdd-servers.lock .venv/bin/python scripts/bench_wan_line.py --serving --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pdd_sglang.dev import results as published  # noqa: E402
from pdd_sglang.dev.wan_emulator import WanLine, check_prerequisites  # noqa: E402
from pdd_sglang.dev.wan_emulator import serving_bench  # noqa: E402
from pdd_sglang.dev.wan_emulator.line_bench import line_goodput, run_point, tune  # noqa: E402
from pdd_sglang.policy.wan_codec import stage_raw  # noqa: E402
from pdd_sglang.prefill.wan_engine import TCP_TRANSPORT_ENV, window_for_line  # noqa: E402

# rate (Mbit/s) x RTT (ms): BDPs from 0.5 MB to 10 MB, past the 4 MiB slice, within the
# forwarder's ceiling (it holds a set rate up to about 400 Mbit/s on 2 cores).
DEFAULT_POINTS = ("100x40", "200x100", "200x200", "400x100", "400x200")
LONG_FAT_LINE_SYSCTLS = {"net.ipv4.tcp_slow_start_after_idle": 0,
                         "net.ipv4.tcp_rmem": "4096 131072 67108864",
                         "net.ipv4.tcp_wmem": "4096 131072 67108864"}
MIN_COPY_BYTES = 32 << 20


def parse_point(text: str) -> tuple[float, float]:
    try:
        rate, rtt = (float(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a point is RATExRTT in Mbit/s and ms, got {text!r}")
    if rate <= 0 or rtt <= 0:
        raise argparse.ArgumentTypeError(f"rate and RTT must be positive, got {text!r}")
    return rate, rtt


def ceiling(rtt_ms: float) -> float:
    """The forwarder's ceiling: no rate limit, the hosts tuned as at the grid's points."""
    with WanLine(0, rtt_ms, 0) as line:
        tune(line, LONG_FAT_LINE_SYSCTLS)
        return line_goodput(line, rtt_ms)


def bench(args) -> dict:
    out_dir = Path(args.out)
    points = []
    for rate, rtt in args.points:
        bdp = int(rate * 1e6 / 8 * rtt / 1e3)
        copy_bytes = max(args.bdp_multiple * bdp, MIN_COPY_BYTES)
        copy_bytes -= copy_bytes % (1 << 20)
        window = window_for_line(rate / 1e3, rtt)
        print(f"== {rate:g} Mbit/s x {rtt:g} ms: BDP {bdp / 1e6:.2f} MB, copies of "
              f"{copy_bytes / 1e6:.0f} MB, slices {window.slice_bytes / 1e6:.2f} MB, window "
              f"{window.window_bytes / 1e6:.1f} MB", flush=True)
        product = ("packed" if stage_raw(window.slice_bytes, args.kv_buffers, window.block_bytes)
                   else "window")
        point = run_point(out_dir, rate_mbit=rate, rtt_ms=rtt, copy_bytes=copy_bytes,
                          window=window, concurrent=args.concurrent,
                          blocks=args.kv_buffers, sysctls=LONG_FAT_LINE_SYSCTLS,
                          warm_copies=args.warm_copies)
        for run in point["runs"]:
            points.append({"rate_mbit": rate, "rtt_ms": rtt, "bdp_bytes": bdp,
                           "copy_bytes": run["copy_bytes"], "concurrent": run["concurrent"],
                           "rule": run["rule"], "product_rule": product,
                           "window_bytes": run["window_bytes"],
                           "slice_bytes": run["slice_bytes"],
                           "request_bytes": run["request_bytes"],
                           "achieved_mbit": run["achieved_mbit"],
                           "line_goodput_mbit": point["goodput_mbit"],
                           "utilization": run["achieved_mbit"] / point["goodput_mbit"],
                           "copy_s": run["copy_s"]})
        # The reference: the median of its timed copies (each rule above is one copy).
        stream_s = sorted(point["stream_copy_s"])[len(point["stream_copy_s"]) // 2]
        points.append({"rate_mbit": rate, "rtt_ms": rtt, "bdp_bytes": bdp,
                       "copy_bytes": copy_bytes, "concurrent": 1, "rule": "stream_reference",
                       "product_rule": product, "window_bytes": 0, "slice_bytes": 0,
                       "request_bytes": copy_bytes,
                       "achieved_mbit": copy_bytes * 8 / stream_s / 1e6,
                       "line_goodput_mbit": point["goodput_mbit"],
                       "utilization": copy_bytes * 8 / stream_s / 1e6 / point["goodput_mbit"],
                       "copy_s": point["stream_copy_s"]})
    result = {"points": points, "kv_buffers": args.kv_buffers,
              "bdp_multiple": args.bdp_multiple, "warm_copies": args.warm_copies,
              "mooncake_tcp_env": TCP_TRANSPORT_ENV, "sysctls": LONG_FAT_LINE_SYSCTLS,
              "date": time.strftime("%Y-%m-%d %H:%M"),
              "note": "2 shared cores: the forwarder, both Mooncake engines and the bench share "
                      "them; utilization = achieved / the same line's bulk TCP goodput"}
    if not args.no_ceiling:
        result["forwarder_ceiling_mbit"] = {f"rtt_{rtt:g}ms": ceiling(rtt)
                                            for rtt in sorted({r for _, r in args.points})[:2]}
        print(f"forwarder ceiling (no rate limit): {result['forwarder_ceiling_mbit']}")
    return result


def parse_copy(text: str) -> tuple[int, int]:
    try:
        layers, tokens = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a copy is LAYERSxTOKENS, got {text!r}")
    if layers not in serving_bench.MODELS or tokens <= 0:
        raise argparse.ArgumentTypeError(
            f"layers must be one of {sorted(serving_bench.MODELS)}, tokens > 0; got {text!r}")
    return layers, tokens


def serving(args) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"serving": [], "null_reasons": serving_bench.NULL_REASONS,
              "sysctls": LONG_FAT_LINE_SYSCTLS, "kv_codec": args.serving_codec,
              "main_staging_mb": args.serving_staging_mb,
              "date": time.strftime("%Y-%m-%d %H:%M"), "loadavg_1m_before": args.loadavg,
              "note": "2 shared cores: the forwarder, the prefill, main and the bench share "
                      "them; utilization = the copy's bytes on the wire over its time on the "
                      "line / the line's bulk TCP goodput"}
    for rate, rtt in args.points:
        result["serving"] += serving_bench.run_point(
            rate, rtt, tuple(args.serving_copies), out, LONG_FAT_LINE_SYSCTLS,
            codec=args.serving_codec, reference_copies=args.serving_reference_copies,
            staging_mb=args.serving_staging_mb)
        # each point's rows as soon as they are measured: a later point's failure keeps them
        (out / "wan_line_bench.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def print_serving(result: dict) -> None:
    print("| Mbit/s x ms | layers | tokens | MB | mode | utilization | reference | ITL ratio | "
          "landed after last byte s | peak staging MB | CPU s/GB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")

    def f(value, fmt):
        return "n/a" if value is None else format(value, fmt)
    for r in result["serving"]:
        print(f"| {r['rate_mbit']:g} x {r['rtt_ms']:g} | {r['layers']} | {r['tokens']} | "
              f"{r['copy_bytes'] / 1e6:.0f} | {r['mode']} | {r['utilization']:.2f} | "
              f"{r['reference_utilization']:.2f} | {f(r['main_itl_ratio'], '.2f')} | "
              f"{r['landed_after_last_record_s']:.2f} | "
              f"{f(r['peak_staging_bytes'] and r['peak_staging_bytes'] / 1e6, '.0f')} | "
              f"{r['cpu_s_per_gb']:.2f} |")


def print_table(result: dict) -> None:
    print("| rate Mbit/s | RTT ms | BDP MB | copies | rule | window MB | request MB | "
          "achieved Mbit/s | utilization |")
    print("|---|---|---|---|---|---|---|---|---|")
    for p in result["points"]:
        rule = p["rule"] + (" (the product's)" if p["rule"] == p["product_rule"] else "")
        print(f"| {p['rate_mbit']:g} | {p['rtt_ms']:g} | {p['bdp_bytes'] / 1e6:.2f} | "
              f"{p['concurrent']} | {rule} | {p['window_bytes'] / 1e6:.1f} | "
              f"{p['request_bytes'] / 1e6:.2f} | {p['achieved_mbit']:.1f} | "
              f"{p['utilization']:.2f} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", nargs="+", type=parse_point, default=None,
                        help=f"RATExRTT (Mbit/s x ms); default {' '.join(DEFAULT_POINTS)}, "
                             f"with --serving 100x40 200x100")
    parser.add_argument("--concurrent", type=int, default=4)
    parser.add_argument("--bdp-multiple", type=int, default=20)
    parser.add_argument("--kv-buffers", type=int, default=64,
                        help="the model's KV buffers (a layer's K and V each; 64: a 32-layer "
                             "model such as Llama-3-8B): a one-sided slice is one Mooncake "
                             "request per buffer")
    parser.add_argument("--warm-copies", type=int, default=1,
                        help="untimed copies per rule first (the lanes of a serving prefill are warm)")
    parser.add_argument("--no-ceiling", action="store_true")
    parser.add_argument("--out", default="out/wan_line_bench")
    published.add_publish_flag(parser)
    parser.add_argument("--serving", action="store_true",
                        help="copies through real prefill and main servers instead (module "
                             "docstring); --points defaults to 100x40 200x100")
    parser.add_argument("--serving-copies", nargs="+", type=parse_copy,
                        default=list(serving_bench.SERVING_COPIES),
                        help="LAYERSxTOKENS per copy (layers 32 or 80)")
    parser.add_argument("--serving-codec", default="auto",
                        choices=("auto", "raw", "lossless"), help="the prefill's --pdd-wan-kv-codec")
    parser.add_argument("--serving-staging-mb", type=float, default=None,
                        help="main's --pdd-wan-staging-mb (default: its own)")
    parser.add_argument("--serving-reference-copies", type=int, default=1,
                        help="timed stream-reference copies per row (after one warm)")
    args = parser.parse_args()
    if args.concurrent < 1 or args.bdp_multiple < 1 or args.kv_buffers < 1:
        parser.error("--concurrent, --bdp-multiple and --kv-buffers must be >= 1")
    if args.warm_copies < 0 or args.serving_reference_copies < 1:
        parser.error("--warm-copies must be >= 0, --serving-reference-copies >= 1")
    check_prerequisites()
    if args.points is None:
        args.points = (list(serving_bench.SERVING_POINTS) if args.serving
                       else [parse_point(p) for p in DEFAULT_POINTS])
    if args.serving:
        args.loadavg = os.getloadavg()[0]
        result = serving(args)
    else:
        result = bench(args)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    path = Path(args.out) / "wan_line_bench.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    (print_serving if args.serving else print_table)(result)
    print(f"wrote {path}")
    if args.publish:
        published.publish("wan_line_bench", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
