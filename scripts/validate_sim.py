"""Validate the simulator against a real CPU run (issue 6 item 6; issue 25).

    python scripts/validate_sim.py --measured out/demo/demo.json

Issue 25 (the default when the file has `latency_setups`): the servers and the line come from
the measured profiles of scripts/profile_cpu.py (--profile-dir, default configs/); what no
microbenchmark measures is fitted on the demo's latency point only and printed; the load point
(`setups`) is then predicted without refitting (pdd_sglang/sim/validation.py).  Prints both, with
the six-stage TTFT split and the stage that misses, and writes validation.json
({"latency": {SETUP: {QUANTITY: simulated / measured}}, "load": {...}}) and
validation_detail.json next to the measured file.

The earlier comparison (--legacy, or a file without `latency_setups`):

The simulator is configured like the CPU demo cluster: configs/hardware/cpu_demo.toml (its
[cluster] table: instance counts, model, links, workload size) gives the defaults, and whatever
the measured file states overrides them: the line's rate, RTT and jitter, the model's KV bytes
per token, the request count and the prompt / output lengths.  It then runs the same small
agentic workload through each setup and prints simulated against measured numbers and their
ratio.

Measured file (what scripts/demo.py writes as demo.json):

    {"setups": {"same_dc_pd":  {"ttft_p50_s": .., "ttft_p90_s": .., "ttft_p99_s": ..,
                                "itl_p50_ms": .., "itl_p99_ms": .., "wan_bytes": ..,
                                "requests": .., "errors": ..},
                "cross_dc_pd": {...},
                "pdd": {"status": "pending", ...}},            # or absent
     "workload": {"prompt_tokens": {"mean": ..}, "output_tokens": {"mean": ..}, ...},  # optional
     "line": {"rate_mbit": 30, "rtt_ms": 40, "jitter_ms": 4, "kv_bytes_per_token": 8192}}  # optional

A setup that is absent, marked with a "status" other than "done"/"ok", or without numbers is
listed as not measured and skipped; only measured quantities are compared.  Nothing here invents
measured numbers: without the file the script stops with a message.

When a setup carries its per-request `rows` (scripts/demo.py writes them), the simulator replays
exactly those requests (prompt and output lengths, conversations, send times; workload.replay_rows)
with a token-level prefix cache the size of the demo's KV pool (pools_after).  Otherwise it
falls back to the agentic generator scaled to the file's mean prompt and output.  The line's
goodput is its rate times the payload share of a packet (MTU less 52 header bytes) times the
share of packets the forwarder did not drop (forwarder_stats), when the file states them.

`--derive` prints the CPU profile numbers that configs/hardware/cpu_demo.toml takes from the
same-DC rows (a least-squares line of TTFT against uncached tokens, and the ITL P50).

Known limit: the demo's client is closed-loop (a fixed number of conversations in flight); the
simulator replays its measured send times open-loop (or, without rows, arrives at the rate in
[cluster]), so it cannot slow its client down when the servers fall behind.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import tomllib
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdd_sglang.dev import results as published  # noqa: E402
from pdd_sglang.sim.cluster import ClusterConfig, Setup, simulate  # noqa: E402
from pdd_sglang.sim.profiles import CONFIG_ROOT, load_table  # noqa: E402
from pdd_sglang.sim.workload import AgenticConfig, generate_agentic, replay_rows  # noqa: E402
from pdd_sglang.sim.profiles import InstanceCost, load_hardware, load_model  # noqa: E402
from pdd_sglang.sim.validation import (QUANTITIES as VALIDATED, MeasuredProfiles,  # noqa: E402
                                       Validator, validation_json)

TCP_IP_HEADER_BYTES = 52        # IPv4 20 + TCP 20 + timestamps option 12

QUANTITIES = (("ttft_p50_s", "ttft_p50_s"), ("ttft_p90_s", "ttft_p90_s"),
              ("ttft_p99_s", "ttft_p99_s"), ("itl_p50_ms", "itl_p50_ms"),
              ("itl_p99_ms", "itl_p99_ms"), ("wan_bytes", "wan_bytes"))
SETUP_NAMES = ("same_dc_pd", "cross_dc_pd", "pdd")
# The demo's setups as simulator setups.  Its cross_dc_pd runs main with its radix cache on, so
# only main's uncached suffix crosses the line: the simulator's cross_dc_pd_drc.  Its same-DC
# main runs on the same (CPU) hardware as prefill: same_dc_pd.
DEMO_SETUPS = {"same_dc_pd": Setup.SAME_DC_PD, "cross_dc_pd": Setup.CROSS_DC_PD_DRC,
               "pdd": Setup.PDD}


def measured_setups(measured: dict) -> tuple[dict, dict]:
    """(setups with numbers, {name: why skipped})."""
    done, skipped = {}, {}
    setups = measured.get("setups") or {}
    for name in SETUP_NAMES:
        entry = setups.get(name)
        if entry is None:
            skipped[name] = "absent"
        elif not isinstance(entry, dict):
            skipped[name] = "not an object"
        elif str(entry.get("status", "done")).lower() not in ("done", "ok", "measured"):
            skipped[name] = f"status {entry.get('status')!r}"
        elif not any(isinstance(entry.get(key), (int, float)) for key, _ in QUANTITIES):
            skipped[name] = "no measured numbers"
        else:
            done[name] = entry
    return done, skipped


def _number(obj: dict, key: str):
    value = (obj or {}).get(key)
    if isinstance(value, dict):                    # demo.py writes stats: {"mean": .., "p50": ..}
        value = value.get("mean", value.get("p50"))
    return float(value) if isinstance(value, (int, float)) else None


def profiles_from_file(table: dict, measured: dict, tmp: Path) -> tuple[str, str, dict]:
    """Write the WAN link and model profiles with the file's line and KV figures; returns
    (wan_link path, model path, {what: source})."""
    line = measured.get("line") or {}
    sources = {}
    with open(CONFIG_ROOT / "links" / f"{table['wan_link']}.toml", "rb") as handle:
        link = tomllib.load(handle)
    if _number(line, "rate_mbit"):
        link["bytes_per_s"] = _number(line, "rate_mbit") * 1e6 / 8
        sources["line rate"] = f"{_number(line, 'rate_mbit'):g} Mbit/s (measured file)"
        share = goodput_share(line)
        if share < 1.0:
            link["bytes_per_s"] *= share
            sources["goodput share"] = f"{share:.3f} of the rate (MTU and drops, measured file)"
    if _number(line, "rtt_ms") is not None:
        link["rtt_s"] = _number(line, "rtt_ms") / 1e3
        sources["RTT"] = f"{_number(line, 'rtt_ms'):g} ms (measured file)"
    if _number(line, "jitter_ms") is not None:
        link["jitter_s"] = _number(line, "jitter_ms") / 1e3
        sources["jitter"] = f"{_number(line, 'jitter_ms'):g} ms (measured file)"
    with open(CONFIG_ROOT / "models" / f"{table['model']}.toml", "rb") as handle:
        model = tomllib.load(handle)
    kv = _number(line, "kv_bytes_per_token") or _number(measured.get("model") or {},
                                                         "kv_bytes_per_token")
    if kv:
        model["kv_bytes_per_token"] = kv
        sources["KV bytes/token"] = f"{kv:g} (measured file)"
    link_path, model_path = tmp / "wan.toml", tmp / "model.toml"
    link_path.write_text(_to_toml(link))
    model_path.write_text(_to_toml(model))
    return str(link_path), str(model_path), sources


def goodput_share(line: dict) -> float:
    """Payload bytes per line byte: headers of a full packet, and retransmissions of the packets
    the forwarder dropped (A to B, the direction the KV crosses)."""
    share = 1.0
    mtu = _number(line, "mtu")
    if mtu and mtu > TCP_IP_HEADER_BYTES:
        share *= (mtu - TCP_IP_HEADER_BYTES) / mtu
    stats = ((line.get("forwarder_stats") or {}).get("a_to_b") or {})
    packets, drops = _number(stats, "packets"), _number(stats, "drops")
    if packets and drops is not None and 0 <= drops < packets:
        share *= 1 - drops / packets
    return share


def _to_toml(data: dict) -> str:
    return "".join(f"{key} = {json.dumps(value)}\n" for key, value in data.items()
                   if isinstance(value, (int, float, str)))


def demo_workload(table: dict, measured: dict, requests: int | None) -> AgenticConfig:
    workload = measured.get("workload") or {}
    line = measured.get("line") or {}
    base = AgenticConfig()
    scale = table["context_scale"]
    prompt_mean = (_number(workload, "prompt_tokens") or _number(workload, "prompt_token_stats")
                   or _number(line, "prompt_tokens"))
    if prompt_mean:          # scale the generator so its mean prompt matches the measured one
        requests_probe, _ = generate_agentic(replace(base, duration_s=600.0))
        mean = sum(r.input_tokens for r in requests_probe) / len(requests_probe)
        scale = prompt_mean / mean
    out_scale = table["output_scale"]
    output_mean = (_number(workload, "output_tokens") or _number(workload, "output_token_stats")
                   or _number(line, "output_tokens"))
    if output_mean:
        out_scale = output_mean / ((base.short_output_max + base.long_output_max) / 4)
    rate = _number(workload, "rate_per_s") or table["rate_per_s"]
    count = requests or int(_number(workload, "requests") or table["requests"])
    scaled = {name: max(1, int(getattr(base, name) * scale)) for name in (
        "system_prompt_tokens", "first_context_min", "first_context_max", "small_delta_min",
        "small_delta_max", "big_delta_min", "big_delta_max", "singular_input_min",
        "singular_input_max")}
    scaled["system_prompt_tokens"] = max(512, scaled["system_prompt_tokens"])
    scaled["short_output_max"] = max(17, int(base.short_output_max * out_scale))
    scaled["long_output_max"] = max(scaled["short_output_max"], int(base.long_output_max * out_scale))
    return replace(base, rate_per_s=rate, duration_s=count / rate,
                   turns_min=table["turns_min"], turns_max=table["turns_max"],
                   seed=int(workload.get("seed", table["seed"])), **scaled)


def usable_rows(entry: dict) -> list:
    keys = ("conversation", "turn", "prompt_tokens", "sent_at")
    rows = entry.get("rows") or []
    if rows and all(isinstance(r, dict) and all(r.get(k) is not None for k in keys)
                    for r in rows):
        return rows
    return []


def kv_pool_tokens(measured: dict) -> int | None:
    pools = measured.get("pools_after") or {}
    sizes = [p.get("max_total_num_tokens") for p in pools.values() if isinstance(p, dict)]
    sizes = [int(x) for x in sizes if isinstance(x, (int, float)) and x > 0]
    return min(sizes) if sizes else None


def demo_cluster(table: dict, setup: Setup, wan_link: str, model: str, cache_tokens: int = 1_000_000,
                 block_tokens: int = 512) -> ClusterConfig:
    return ClusterConfig(setup=setup, model=model, prefill_hardware="cpu_demo",
                         relay_hardware="cpu_demo", main_hardware="cpu_demo",
                         wan_link=wan_link, rdma_link=table["rdma_link"],
                         prefill_instances=table["prefill_instances"],
                         relay_instances=table["relay_instances"],
                         main_instances=table["main_instances"],
                         relay_max_running=table["max_running"],
                         main_max_running=table["max_running"],
                         prefill_cache_tokens=cache_tokens, main_cache_tokens=cache_tokens,
                         block_tokens=block_tokens)


def compare(measured: dict) -> list:
    """Rows (setup, quantity, simulated, measured, ratio) for every measured quantity."""
    table = load_table("hardware", "cpu_demo", "cluster")
    done, skipped = measured_setups(measured)
    for name, why in skipped.items():
        print(f"{name}: not compared ({why})")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        wan_link, model, sources = profiles_from_file(table, measured, Path(tmp))
        for what, source in sources.items():
            print(f"configured from the file: {what} = {source}")
        system = int(_number(measured.get("workload") or {}, "system_prompt_tokens")
                     or _number(measured.get("workload") or {}, "system_tokens") or 0)
        pool = kv_pool_tokens(measured) or 1_000_000
        for name, numbers in done.items():
            replay = usable_rows(numbers)
            if replay:
                print(f"{name}: replaying its {len(replay)} measured requests")
                requests, warmup = replay_rows(replay, system, block_tokens=1)
                cfg = demo_cluster(table, DEMO_SETUPS[name], wan_link, model, pool, block_tokens=1)
            else:
                count = numbers.get("requests")
                workload = demo_workload(table, measured, int(count) if count else None)
                requests, warmup = generate_agentic(workload)
                cfg = demo_cluster(table, DEMO_SETUPS[name], wan_link, model)
            summary, _ = simulate(cfg, requests, warmup)
            for key, attribute in QUANTITIES:
                real = numbers.get(key)
                if not isinstance(real, (int, float)):
                    continue
                sim_value = float(getattr(summary, attribute))
                ratio = sim_value / real if real else math.nan
                rows.append((name, key, sim_value, float(real), ratio))
    return rows


def derive_cpu_profile(measured: dict) -> dict:
    """The cpu_demo numbers implied by the same-DC rows: TTFT = a + b * uncached tokens (least
    squares over every request), so the prefill rate is 1/b tokens/s at the rows' contexts and
    a is the per-request latency that no token count explains; the decode step is the ITL P50.
    These are fitted to same-DC measurements only: cross-DC and PDD stay out of sample."""
    entry = (measured.get("setups") or {}).get("same_dc_pd") or {}
    rows = [r for r in usable_rows(entry) if isinstance(r.get("ttft_s"), (int, float))
            and isinstance(r.get("cached_tokens"), (int, float))]
    if len(rows) < 3:
        raise SystemExit("validate_sim --derive: the same-DC setup needs per-request rows")
    new = [r["prompt_tokens"] - r["cached_tokens"] for r in rows]
    ttft = [r["ttft_s"] for r in rows]
    n, mean_u, mean_t = len(rows), sum(new) / len(rows), sum(ttft) / len(rows)
    slope = (sum((u - mean_u) * (t - mean_t) for u, t in zip(new, ttft))
             / sum((u - mean_u) ** 2 for u in new))
    intercept = mean_t - slope * mean_u
    hardware, model = load_hardware("cpu_demo"), load_model("tiny_cpu")
    flops = sum((2 * model.active_params + model.attention_flops_per_token_pair
                 * (r["cached_tokens"] + u / 2)) * u for r, u in zip(rows, new))
    rate = flops / (slope * sum(new))
    cost = InstanceCost(hardware, model)
    context = int(sum(r["prompt_tokens"] for r in rows) / n)
    roofline_step = cost.forward_seconds(1, context) - hardware.step_overhead_s
    itl = _number(entry, "itl_p50_ms")
    out = {"rows": n, "ttft_intercept_s": intercept, "ttft_slope_s_per_token": slope,
           "prefill_tokens_per_s": 1 / slope, "effective_prefill_flops": rate,
           "prefill_mfu": rate / hardware.peak_flops,
           "dispatch_latency_s": intercept - hardware.prefill_overhead_s}
    if itl:
        out["step_overhead_s"] = itl / 1e3 - roofline_step
    return out


def calibrate_and_predict(measured: dict, measured_path: Path, profiles: MeasuredProfiles) -> int:
    """Issue 25: calibrate on the latency point, predict the load point; validation.json."""
    table = load_table("hardware", "cpu_demo", "cluster")
    with tempfile.TemporaryDirectory() as tmp:
        validator = Validator(measured, profiles, table["model"], Path(tmp))
        calibration = validator.calibrate()
        print("profiles (scripts/profile_cpu.py): " + ", ".join(
            str(p) for p in (profiles.hardware, profiles.wan, profiles.loopback)))
        print("calibrated at the latency point (latency_setups) only:")
        for key, value in calibration.as_dict().items():
            if key != "notes":
                print(f"  {key:24s} {value}")
        for key, note in calibration.notes.items():
            print(f"  ({key}: {note})")
        points = {"latency": validator.run_point(measured.get("latency_setups") or {}),
                  "load": validator.run_point(measured.get("setups") or {})}
    for point, results in points.items():
        title = "calibrated" if point == "latency" else "predicted, not refitted"
        print(f"\n{point} point ({title}): simulated / measured")
        print(f"{'setup':22s}" + "".join(f"{q:>12s}" for q in VALIDATED))
        for name, result in results.items():
            print(f"{name:22s}" + "".join(
                f"{result['ratios'][q]:12.2f}" if q in result["ratios"] else f"{'-':>12s}"
                for q in VALIDATED))
        for name, result in results.items():
            for pct in ("p50", "p90"):
                print(f"  {name} stages {pct.upper()} (measured / simulated, s): " + ", ".join(
                    f"{s} {_fmt(v[f'measured_{pct}_s'])}/{_fmt(v[f'simulated_{pct}_s'])}"
                    for s, v in result["stages"].items()))
            line = result.get("line_by_class") or {}
            if line.get("simulated") and line.get("measured"):
                print(f"  {name} line by class (measured / simulated, MB): " + ", ".join(
                    f"{k.replace('_bytes', '')} {line['measured'].get(k, 0) / 1e6:.2f}/"
                    f"{v / 1e6:.2f}" for k, v in line["simulated"].items()))
            ends = result.get("outcomes") or {}
            if ends.get("simulated") and any(ends["simulated"].values()):
                print(f"  {name} outcomes (measured / simulated): " + ", ".join(
                    f"{k} {ends['measured'].get(k, 0)}/{v}" for k, v in ends["simulated"].items()))
            for quantity, why in result["misses"].items():
                print(f"  MISS {name} {quantity}: {why}")
    out = measured_path.with_name("validation.json")
    out.write_text(json.dumps(validation_json(points), indent=2))
    detail = measured_path.with_name("validation_detail.json")
    detail.write_text(json.dumps({"calibration": calibration.as_dict(), "profiles": {
        "hardware": str(profiles.hardware), "wan": str(profiles.wan),
        "loopback": str(profiles.loopback)}, "points": points}, indent=1, default=str))
    print(f"\nwrote {out} and {detail}")
    return 0


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measured", type=Path, required=True,
                        help="demo.json from the real CPU run (see the module docstring)")
    parser.add_argument("--derive", action="store_true",
                        help="print the cpu_demo profile numbers the same-DC rows imply")
    parser.add_argument("--profile-dir", type=Path, default=CONFIG_ROOT,
                        help="where scripts/profile_cpu.py wrote its profiles (its --out-dir; "
                             "default configs/)")
    parser.add_argument("--cache-only-backlog-s", type=float, default=None,
                        help="the prefill's --pdd-wan-cache-only-backlog-s, for a demo.json "
                             "that does not record it (line.cache_only_backlog_s; without either, "
                             "10, the default until it was recorded)")
    parser.add_argument("--legacy", action="store_true",
                        help="the earlier comparison (cpu_demo.toml, no calibration)")
    published.add_publish_flag(parser)
    args = parser.parse_args(argv)
    if not args.measured.is_file():
        print(f"validate_sim: no measured file at {args.measured}. Run the real CPU demo first "
              "(scripts/demo.py) and pass its demo.json; this script never makes up measured "
              "numbers.", file=sys.stderr)
        return 2
    measured = json.loads(args.measured.read_text())
    if not isinstance(measured.get("setups"), dict):
        print("validate_sim: the measured file has no 'setups' object", file=sys.stderr)
        return 2
    line = measured.setdefault("line", {})
    if args.cache_only_backlog_s is not None:
        if line.get("cache_only_backlog_s") not in (None, args.cache_only_backlog_s):
            print(f"validate_sim: the demo recorded --pdd-wan-cache-only-backlog-s "
                  f"{line['cache_only_backlog_s']}, not {args.cache_only_backlog_s}",
                  file=sys.stderr)
            return 2
        line["cache_only_backlog_s"] = args.cache_only_backlog_s
    if args.derive:
        for key, value in derive_cpu_profile(measured).items():
            print(f"{key:24s} {value:.6g}")
        return 0
    profiles = MeasuredProfiles.under(args.profile_dir)
    if not args.legacy and measured.get("latency_setups"):
        missing = profiles.missing()
        if missing:
            print(f"validate_sim: no measured profile ({', '.join(missing)}); run "
                  "scripts/profile_cpu.py first (or --legacy)", file=sys.stderr)
            return 2
        try:
            code = calibrate_and_predict(measured, args.measured, profiles)
        except ValueError as err:
            print(f"validate_sim: {err}", file=sys.stderr)
            return 2
        if code == 0 and args.publish:
            ratios = json.loads(args.measured.with_name("validation.json").read_text())
            published.publish("validation", {**ratios, "line": {
                k: measured["line"].get(k) for k in ("rate_mbit", "rtt_ms")}})
        return code
    rows = compare(measured)
    if not rows:
        print("validate_sim: no setup in the file has measured numbers yet", file=sys.stderr)
        return 1
    print(f"{'setup':12s} {'quantity':11s} {'simulated':>12s} {'measured':>12s} {'sim/meas':>9s}")
    for name, key, sim_value, real, ratio in rows:
        print(f"{name:12s} {key:11s} {sim_value:12.4g} {real:12.4g} {ratio:9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
