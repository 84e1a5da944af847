#!/usr/bin/env python3
"""Measure the CPU demo's servers and line under the demo's own CPU budget; write the profile the
simulator reads (issue 25, item 1).

    sudo python3 scripts/profile_cpu.py                       # about 7 minutes
    sudo python3 scripts/profile_cpu.py --quick --out-dir DIR # about 1.5 minutes (tests)

Microbenchmarks only; nothing here looks at a demo run's TTFTs.

1. Server: one SGLang server of the demo's model (tiny Llama, 8 KiB of KV per token) with the
   demo's serving settings (CPU engine, OMP_NUM_THREADS=1: cluster.CPU_SERVER_ENV) in a cgroup v1
   CPU group with the demo's quota (cpu_budget.server_cpu_quota(3), 20 ms period), limited once
   it is ready, as scripts/demo.py does.
   - prefill: requests of N fresh tokens after C cached ones, B at once, max_new_tokens=1; the
     wall time until the last answer, least squares over the points:
         t = prefill_fixed_s + prefill_s_per_token x B N + prefill_s_per_token_pair x B N (C + N/2)
             + prefill_s_per_cached_token x B C
   - decode: B streams at context L, max_new_tokens M; the median gap between tokens, fitted:
         step = decode_fixed_s + decode_s_per_request x B + decode_s_per_context_token x B L
2. Line: the demo's emulated WAN (pdd_sglang.dev.wan_emulator.WanLine, same rate, RTT, jitter):
   TCP goodput (measure.bulk_rate) and round trips (measure.round_trips); then real Mooncake TCP
   writes of two payload sizes across it (wan_emulator.handoff_bench, no server): the line
   through both, t = fixed + bytes / rate, gives the per-transfer fixed cost, and the control
   channel's round trip is the handoff's own cost per message. Then how the line shares between
   two copies (wan_emulator.copy_overlap): a short turn's KV copy started 1.5 s into a document
   turn's; where it ends between fair sharing and waiting for the big copy's bytes sets the
   WAN profile's copy_order.
3. Loopback: TCP goodput over 127.0.0.1 in this process; its per-transfer fixed cost is the
   Mooncake fixed cost of step 2 less the line's RTT (assumed: the same engine, no line).

Writes OUT/hardware/cpu_demo_measured.toml, OUT/links/wan_demo_measured.toml,
OUT/links/loopback_measured.toml (OUT: --out-dir, default configs/) and profile.json beside the
hardware file (every sample).  Every figure's source is a [sources] entry of its file.  Needs
root (cgroups, namespaces).
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pdd_sglang.dev import cpu_budget  # noqa: E402
from pdd_sglang.dev.cpu_profile import (DEMO_JITTER_MS, DEMO_RATE_MBIT, DEMO_RTT_MS,  # noqa: E402
                                        PLANS, SERVERS_AT_ONCE, fit_server,
                                        profile_interference, profile_line, profile_server)
from pdd_sglang.sim.profiles import load_hardware  # noqa: E402

def toml_text(header: str, values: dict, sources: dict, extra: str = "") -> str:
    out = [f"# {line}" if line else "#" for line in header.splitlines()]
    for key, value in values.items():
        out.append(f"{key} = {json.dumps(value)}")
    out.append(extra.rstrip())
    out.append("\n[sources]")
    for key, value in sources.items():
        out.append(f"{json.dumps(key)} = {json.dumps(value)}")
    return "\n".join(x for x in out if x) + "\n"


def write_profiles(out_dir: Path, server: dict, line: dict, stamp: str) -> dict:
    base = load_hardware("cpu_demo")
    quota = server["quota_cores"]
    how = f"profile_cpu.py, {stamp}, one SGLang server under a {quota:g}-core cgroup quota"
    hardware = {
        "name": f"CPU demo instance, measured ({quota:g} core quota, tiny model)",
        "source": f"scripts/profile_cpu.py microbenchmarks ({stamp}); see [sources]",
        "gpus_per_instance": 1, "peak_flops": base.peak_flops, "hbm_bytes": base.hbm_bytes,
        "hbm_bytes_per_s": base.hbm_bytes_per_s, "prefill_mfu": base.prefill_mfu,
        "decode_mfu": base.decode_mfu, "memory_efficiency": base.memory_efficiency,
        "usable_memory_fraction": base.usable_memory_fraction,
        "step_overhead_s": server["decode_fit"]["decode_fixed_s"],
        "prefill_overhead_s": server["prefill_fit"]["prefill_fixed_s"],
        "cost_per_gpu_hour": 0.0,
        **{k: float(v) for k, v in server["prefill_fit"].items()},
        **{k: float(v) for k, v in server["decode_fit"].items()},
        "neighbour_slowdown": float((server.get("interference") or {}).get("neighbour_slowdown",
                                                                           0.0)),
    }
    sources = {
        **{k: f"MEASURED: least squares over {len(server['prefill_points'])} prefill points "
              f"(max_new_tokens=1, wall time of a batch; {how})"
           for k in server["prefill_fit"]},
        **{k: f"MEASURED: least squares over {len(server['decode_points'])} decode points "
              f"(median inter-token gap of B streams; {how})" for k in server["decode_fit"]},
        "fit": "least squares on each point's median over its repeats, weighted by 1/t",
        "step_overhead_s": "MEASURED: = decode_fixed_s", "prefill_overhead_s":
            "MEASURED: = prefill_fixed_s",
        "roofline fields": "unused while the measured coefficients are set (copied from "
                           "cpu_demo.toml)",
        "hbm_bytes": "cpu_demo.toml: the demo's 32,768-token pool",
        "neighbour_slowdown": (
            "MEASURED: median ratio - 1 of the same prefill and decode points with a second "
            "server under the same quota decoding 4 streams, over the points alone, "
            "alternated point by point "
            f"({(server.get('interference') or {}).get('ratios')})"
            if server.get("interference") else "not measured (--quick): 0")}
    goodput = line["bulk"].get("steady_goodput_mbit") or line["bulk"]["goodput_mbit"]
    rtt = statistics.median(line["rtt_ms"]) / 1e3
    fixed = max(line["mooncake_intercept_s"] - rtt, 0.0)
    wan = {"name": "emulated WAN of the CPU demo, measured", "source": f"profile_cpu.py ({stamp})",
           "bytes_per_s": goodput * 1e6 / 8, "rtt_s": rtt,
           "jitter_s": DEMO_JITTER_MS / 1e3, "cost_per_hour": 0.0,
           "per_transfer_fixed_s": fixed,
           "wire_per_payload_byte": (line.get("mooncake_wire_per_payload_byte")
                                     or line["bulk"]["wire_per_payload_byte"]),
           "ack_bytes_per_payload_byte": line["bulk"]["wire_bytes_b_to_a"] / line["bulk"]["bytes"],
           "bulk_wire_a_to_b_per_payload_byte": (line["bulk"]["wire_bytes_a_to_b"]
                                                 / line["bulk"]["bytes"]),
           **{k: float(v) for k, v in server["http"].items() if k != "points"}}
    overlap = line.get("copy_overlap") or {}
    wan["copy_order"] = overlap.get("copy_order") or "fair"
    wan_sources = {
        "bytes_per_s": f"MEASURED: TCP goodput across the line, measure.bulk_rate ({line['bulk']})",
        "rtt_s": f"MEASURED: median of {len(line['rtt_ms'])} TCP ping-pongs (measure.round_trips)",
        "jitter_s": "the line's setting (scripts/demo.py)",
        "wire_per_payload_byte": "MEASURED: the line's kernel byte counters (both directions: "
                                 "TCP/IP headers, retransmissions of dropped packets, ACKs) over "
                                 "the payload, during the Mooncake writes of "
                                 f"{line['mooncake_writes'][1]['bytes']} B (a single TCP bulk "
                                 f"flow: {line['bulk']['wire_per_payload_byte']:.4f})",
        "per_transfer_fixed_s": "MEASURED: intercept of two Mooncake TCP writes across the line "
                                f"({line['mooncake_writes']}) less one RTT",
        "control_round_trip_ms": "MEASURED (not used by the model): "
                                 f"{line['control_round_trip_ms']}",
        "stream_bytes_*": "MEASURED: bytes of streamed /generate answers of "
                          f"{[p['new_tokens'] for p in server['http']['points']]} tokens from the "
                          "server, least squares (what main streams to the router across the line)",
        "request_bytes_per_prompt_token": "MEASURED: JSON request body bytes per input id",
        "copy_order": (
            "MEASURED: a Mooncake copy of {small_bytes} B started {delay_s:g} s into one of "
            "{big_bytes} B to the same peer (wan_emulator.copy_overlap), {n} trials: where it "
            "ended between sharing the line fairly (0) and waiting for the big copy's bytes (1), "
            "median {median:.2f} of {positions}; in_order from 0.5".format(
                n=len(overlap["trials"]), median=overlap["median_position"],
                positions=[round(p, 2) for p in overlap["positions"]],
                small_bytes=overlap["small_bytes"], big_bytes=overlap["big_bytes"],
                delay_s=overlap["delay_s"])
            if overlap.get("positions") else "not measured (--quick): fair"),
        "ack_bytes_per_payload_byte": "MEASURED: B->A line bytes (ACKs) per payload byte of the "
                                      "bulk transfer",
        "bulk_wire_a_to_b_per_payload_byte": "MEASURED: A->B line bytes per payload byte of the "
                                             "bulk transfer (its goodput's overhead)"}
    loop = {"name": "loopback, measured", "source": f"profile_cpu.py ({stamp})",
            "bytes_per_s": line["loopback_bytes_per_s"], "rtt_s": 0.0001, "jitter_s": 0.0,
            "cost_per_hour": 0.0, "per_transfer_fixed_s": fixed}
    loop_sources = {"bytes_per_s": "MEASURED: TCP goodput over 127.0.0.1, 64 MiB, one process",
                    "rtt_s": "ASSUMED", "per_transfer_fixed_s": "ASSUMED: the WAN's Mooncake "
                    "fixed cost (the same engine, no line)"}
    paths = {"hardware": out_dir / "hardware" / "cpu_demo_measured.toml",
             "wan": out_dir / "links" / "wan_demo_measured.toml",
             "loopback": out_dir / "links" / "loopback_measured.toml"}
    for path in paths.values():
        path.parent.mkdir(parents=True, exist_ok=True)
    note = "Written by scripts/profile_cpu.py; do not edit by hand, rerun it.\n"
    paths["hardware"].write_text(toml_text(note + "The demo's server, measured.", hardware,
                                           sources))
    paths["wan"].write_text(toml_text(note + "The demo's emulated WAN, measured.", wan,
                                      wan_sources))
    paths["loopback"].write_text(toml_text(note + "Loopback TCP, measured.", loop, loop_sources))
    raw = paths["hardware"].with_name("cpu_demo_measured.json")
    raw.write_text(json.dumps({"server": server, "line": line, "stamp": stamp}, indent=1))
    return {k: str(v) for k, v in {**paths, "raw": raw}.items()}


def _raise_exit(signum, frame):
    raise SystemExit(128 + signum)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=REPO / "configs")
    parser.add_argument("--quick", action="store_true", help="fewer points (tests)")
    parser.add_argument("--server-cpu", type=float, default=None,
                        help="quota in cores (default: scripts/demo.py's, "
                             "cpu_budget.server_cpu_quota(3))")
    parser.add_argument("--reuse-server", type=Path, default=None, metavar="JSON",
                        help="take the server measurements from an earlier run's "
                             "cpu_demo_measured.json and measure only the line")
    parser.add_argument("--reuse-line", action="store_true",
                        help="with --reuse-server: take the line's measurements from it too "
                             "(refit and rewrite only)")
    parser.add_argument("--interference", action="store_true",
                        help="with --reuse-server: measure the neighbour slowdown (two servers)")
    parser.add_argument("--rate-mbit", type=float, default=DEMO_RATE_MBIT)
    parser.add_argument("--rtt-ms", type=float, default=DEMO_RTT_MS)
    parser.add_argument("--jitter-ms", type=float, default=DEMO_JITTER_MS)
    args = parser.parse_args(argv)
    if args.reuse_line and not args.reuse_server:
        parser.error("--reuse-line needs --reuse-server")
    try:
        cpu_budget.check_cpu_controller()
        from pdd_sglang.dev.wan_emulator import check_prerequisites
        check_prerequisites()
    except (PermissionError, FileNotFoundError) as err:
        print(f"profile_cpu: cannot run here: {err}", file=sys.stderr)
        return 2
    for sig in (signal.SIGTERM, signal.SIGHUP):   # unwind through the finally blocks
        signal.signal(sig, _raise_exit)
    plan = PLANS["quick" if args.quick else "full"]
    cores = args.server_cpu or cpu_budget.server_cpu_quota(SERVERS_AT_ONCE)

    def log(text):
        print(text, file=sys.stderr, flush=True)
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()) + (" --quick" if args.quick else "")
    with tempfile.TemporaryDirectory(prefix="pdd-profile-") as tmp:
        log_dir = Path(tmp)
        started = time.perf_counter()
        if args.reuse_server:
            earlier = json.loads(args.reuse_server.read_text())
            server = fit_server(earlier["server"])
            now, stamp = stamp, earlier["stamp"]
            stamp += "" if args.reuse_line else f"; line {now}"
            stamp += f"; interference {now}" if args.interference else ""
        else:
            server = profile_server(plan, cores, log_dir, log)
        if args.interference or (not args.reuse_server and not args.quick):
            server["interference"] = profile_interference(PLANS["full"], cores, log_dir, log)
        if args.reuse_line:
            line = json.loads(args.reuse_server.read_text())["line"]
        else:
            line = profile_line(plan, args.rate_mbit, args.rtt_ms, args.jitter_ms, log_dir, log)
        paths = write_profiles(args.out_dir, server, line, stamp)
    print(json.dumps({"prefill_fit": server["prefill_fit"], "decode_fit": server["decode_fit"],
                      "wan_goodput_mbit": line["bulk"], "mooncake_intercept_s":
                      line["mooncake_intercept_s"], "seconds": round(time.perf_counter() - started),
                      "written": paths}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
