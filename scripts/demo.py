#!/usr/bin/env python3
"""`make demo`: same-DC PD, naive cross-DC PD and PDD over an emulated WAN line, on real SGLang.

One agentic multi-turn workload (a long shared system prompt, growing histories, a few long-document
turns with a low cache hit, answers of 64-256 tokens; fixed seed) runs through the PDD router on
three setups, at two operating points: latency (one conversation at a time) and load (4 at a time).

  same_dc_pd   prefill, main decode (decode radix cache on), router and client all in cluster A
               (network namespace pddA-<pid>); P<->MD stays on A's loopback, the line stays idle.
  cross_dc_pd  prefill, router and client in cluster A; main decode in cluster B (pddB-<pid>),
               reachable only through the emulated WAN line (rate limit, RTT, jitter): Mooncake's
               KV transfer, the bootstrap handshake and the router's HTTP all cross it.
  pdd          prefill, relay decode, router and client in cluster A; main decode in cluster B.
               The router places each request on P->MD or P->RLD->MD (pdd_sglang.policy) by the
               TTFT budget, as we recommend deploying it, with --placement (congestion-aware by
               default); at the load point PDD runs again without a budget
               (setups.pdd_no_budget: --hide-wan-below-s decides), and without a budget with the
               other placement (setups.pdd_idle_line or pdd_congestion_aware: the placement is
               its one difference from pdd_no_budget), all in the same run.

TTFT budget (default 1.15 x same-DC PD's TTFT P50 at the same point, measured earlier in the
run; --ttft-slo-x F for another multiple, --ttft-slo-ms MS for a fixed one): pdd's router places
by it (P->MD only when the TTFT predicted through main fits it). The other placement's setup runs
without one because a budget sends few requests P->MD (0 or 1 of 24 in three fresh-clone runs),
and issue 34's goal on P->MD waits is checked on the idle-line setup's P->MD requests.
Every setup reports the share of its requests within the budget, PDD the relay's busy share (the
relay's decode tokens over all decode tokens: the cost side) and the WAN line's bytes by copy
class (needed-now, cache-only, cache-only dropped past the backlog bound: the prefill's
/pdd/line).
--frontier runs the load point only: same-DC and naive cross-DC PD, then PDD at four budgets
(1.0, 1.15, 1.5, 3.0 x same-DC's P50; the bar applies at 1.15), and draws frontier.png.
Every PDD setup's P->MD requests: their WAN wait (prefill's forward done -> main's first token)
over their copy alone on an idle line (p_to_md_wait_over_alone; pdd_sglang.dev.demo.wan_wait);
the bar checks the idle-line setup's P90 (<= 1.5, issue 34).

Equal compute per role: every SGLang server runs in its own cgroup v1 CPU group with the same
quota (pdd_sglang.dev.cpu_budget), the rest of the machine is headroom for the router, the line's
forwarder and the clients; per-server CPU, run-queue wait and throttled time go to demo.json, and
so does the CPU the router, the line's forwarder and the clients used. --cpu-layout shared (the
default) lets every process run on every core; --cpu-layout pinned also pins cluster A's servers
to the first half of the cores and cluster B's server, the router, the clients and the line to the
second, so that no setup's servers wait behind its extra processes; --cpu-layout prefill-apart
puts the prefill alone on the first half and every decode server with the rest on the second, so no
decode server's work takes the prefill's cycles (cpu_budget.server_cores).

Writes DIR/demo.json, DIR/ttft.png and DIR/stages.png (and DIR/frontier.png with --frontier;
DIR: --out, default out/demo).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pdd_sglang.dev import cpu_budget, results as published  # noqa: E402
from pdd_sglang.dev.demo import budget, figures, report, wan_wait  # noqa: E402
from pdd_sglang.dev.demo.setup_run import Aborted, cleanup, leftovers, run_setup  # noqa: E402
from pdd_sglang.dev.testing import agentic  # noqa: E402
from pdd_sglang.dev.testing.cluster import (NON_OVERLAP_LOOP_ARGS, RELAY_CPU_ARGS,  # noqa: E402
                                           Cluster, free_port)
from pdd_sglang.dev.testing.tiny_model import WAN_DEMO_MODEL, ensure_tiny_model  # noqa: E402
from pdd_sglang.dev.testing.wan_cluster import NetnsServer  # noqa: E402
from pdd_sglang.dev.wan_emulator import WanLine, check_prerequisites  # noqa: E402

DEMO_MODEL = WAN_DEMO_MODEL  # 8 KiB of KV per token: a 1000-token document is 8 MB on the wire
# The line: at 10 Mbit/s a 1000-token document's KV (8.2 MB) takes about 6.6 s to cross, a
# high-hit turn's suffix (about 60 tokens, 0.5 MB) about 0.4 s plus a few 40 ms round trips.
# Answers of 64-256 tokens take seconds to decode, so conversations send a turn every several
# seconds and the line stays under about 70 % busy on average (demo.json measures it per setup:
# line_utilisation_a_to_b).
RATE_MBIT, RTT_MS, JITTER_MS = 10.0, 40.0, 4.0
AGENTIC = dict(output_tokens=(64, 256), document_prob=0.12)
QUICK_ANSWERS = (128, 160)
POINTS = {  # operating point -> workload; latency: one conversation at a time, load: 4
    "full": {"latency": agentic.WorkloadSpec(conversations=1, turns=5, concurrency=1, **AGENTIC),
             # 4 x 6, not 6 x 5: at 4 at a time, 6 conversations ran in two waves and the full
             # demo took 17.8 min against its 15-minute aim; one wave of longer conversations.
             "load": agentic.WorkloadSpec(conversations=4, turns=6, concurrency=4, **AGENTIC)},
    # Quick: 2 latency turns and answers of 128-160 tokens. At 64-96 the relay (0.5 core, about
    # 45 ms a token at 4 at a time) finished turn 0 in 4.1-4.7 s, as the four copies sharing the
    # line landed at main (4.2-4.7 s): PDD's load point once ran with no handoff at all.
    "quick": {"latency": agentic.WorkloadSpec(conversations=1, turns=2, concurrency=1,
                                              system_tokens=1024, output_tokens=QUICK_ANSWERS,
                                              document_prob=0.12),
              "load": agentic.WorkloadSpec(conversations=4, turns=3, concurrency=4,
                                           system_tokens=1024, output_tokens=QUICK_ANSWERS,
                                           document_prob=0.12)},
}
MAX_TOTAL_TOKENS = 32768  # per server: the conversations in flight and the system prompt stay cached
TRANSPORT = ("--disaggregation-transfer-backend", "mooncake_tcp")
# SGLang's own per-request time stats: in the prefill's answer (the stage split) and in the logs.
TIME_STATS = ("--enable-metrics", "--enable-request-time-stats-logging")
# Relay and mains: SGLang's /metrics, for their decode work (the relay's busy share), and their
# per-request time stats in the logs (when each took a request in and registered with prefill).
METRICS = TIME_STATS
SERVERS_AT_ONCE = 3  # PDD's prefill, relay and main: the most one setup keeps busy
OTHER_PLACEMENT = {"congestion-aware": "idle-line", "idle-line": "congestion-aware"}
NO_BUDGET = "pdd_no_budget"  # the load point's PDD without a TTFT budget, beside the budget run


def _multiples(text: str) -> tuple:
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers separated by commas, got {text!r}")


def _raise_exit(signum, frame):
    raise SystemExit(128 + signum)


def plan_setups(args, main_a, main_b, relay, other: str | None) -> list[tuple]:
    """(point, setup, main, relay, placement, budget as a multiple of same-DC's P50 or None),
    in the order they run: same-DC PD first at each point, so its P50 is known before PDD's."""
    if args.frontier:
        return [("load", "same_dc_pd", main_a, None, args.placement, None),
                ("load", "cross_dc_pd", main_b, None, args.placement, None),
                *[("load", budget.setup_name(x), main_b, relay, args.placement, x)
                  for x in sorted(set(args.frontier_x))]]
    x = args.ttft_slo_x
    return [("latency", "same_dc_pd", main_a, None, args.placement, None),
            ("latency", "cross_dc_pd", main_b, None, args.placement, None),
            ("latency", "pdd", main_b, relay, args.placement, x),
            ("load", "same_dc_pd", main_a, None, args.placement, None),
            ("load", "cross_dc_pd", main_b, None, args.placement, None),
            ("load", "pdd", main_b, relay, args.placement, x),
            ("load", NO_BUDGET, main_b, relay, args.placement, None),
            ("load", other, main_b, relay, OTHER_PLACEMENT[args.placement], None)]


def check_machine(cgroup_root: Path, cpu_layout: str = "shared") -> str | None:
    """None when the demo can run here, else the one reason it cannot."""
    try:
        check_prerequisites()  # root, /dev/net/tun, iproute2
        cpu_budget.check_cpu_controller(cgroup_root)
        if cpu_layout != "shared":
            cpu_budget.check_cpuset_controller()
            cpu_budget.pinned_layout()
    except (PermissionError, FileNotFoundError, ValueError) as err:
        return str(err)
    return None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The demo's options, checked (argparse exits 2 with the reason on bad ones)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "out" / "demo")
    parser.add_argument("--quick", action="store_true",
                        help="a short run (under 7 minutes): fewer, shorter conversations")
    parser.add_argument("--placement", choices=sorted(OTHER_PLACEMENT),
                        default="congestion-aware", help="the router's placement for `pdd`")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--wan-kv-codec", choices=("auto", "raw", "lossless", "fp8"),
                        default="auto", help="the prefill's --pdd-wan-kv-codec (issue 36): auto "
                        "codes main-bound KV losslessly where it shortens the copy on the line")
    parser.add_argument("--rate-mbit", type=float, default=RATE_MBIT)
    parser.add_argument("--rtt-ms", type=float, default=RTT_MS)
    parser.add_argument("--jitter-ms", type=float, default=JITTER_MS)
    parser.add_argument("--server-cpu", type=float, default=None,
                        help="CPU quota of every SGLang server in cores (default: the machine "
                             "less 0.5 core of headroom, over the 3 servers PDD runs at once)")
    slo = parser.add_mutually_exclusive_group()
    slo.add_argument("--ttft-slo-ms", type=float, default=None, metavar="MS",
                     help="TTFT budget of pdd's router (its --ttft-slo-ms); pdd_no_budget and "
                          "the other placement's setup run without one")
    slo.add_argument("--ttft-slo-x", type=float, default=None, metavar="F",
                     help="TTFT budget of pdd's router: F x same-DC PD's "
                          f"TTFT P50 at the same point, measured first in the same run (default "
                          f"{budget.BAR_X}, unless --ttft-slo-ms)")
    parser.add_argument("--prefill-tokens-per-s", type=float, default=None,
                        help="the router's prefill rate for the budget's prediction (default: "
                             "measured in this run from same-DC PD's prefill forwards)")
    parser.add_argument("--frontier", action="store_true",
                        help="the load point only: same-DC and naive cross-DC PD, then PDD at "
                             "each budget of --frontier-x (x same-DC P50); draws frontier.png")
    parser.add_argument("--frontier-x", type=_multiples,
                        default=budget.FRONTIER_X, metavar="F,F,...",
                        help="the frontier's budgets, multiples of same-DC's P50 (default "
                             f"{','.join(map(str, budget.FRONTIER_X))})")
    parser.add_argument("--cpu-layout", choices=cpu_budget.LAYOUTS, default="shared",
                        help="shared (default): every process on every core; pinned: cluster A's "
                             "servers on the first half of the cores, cluster B's server, the "
                             "router, the clients and the line on the second; prefill-apart: "
                             "the prefill alone on the first half, every decode server, the "
                             "router, the clients and the line on the second")
    parser.add_argument("--cgroup-cpu-root", type=Path, default=cpu_budget.CPU_ROOT,
                        help=argparse.SUPPRESS)  # tests: a missing controller
    parser.add_argument("--inject-crash", type=int, default=None, metavar="N",
                        help=argparse.SUPPRESS)  # kill main after N requests of the first setup (tests)
    published.add_publish_flag(parser)
    args = parser.parse_args(argv)
    if args.publish and args.quick:
        parser.error("--publish: the current result is a full run, not --quick")
    for flag, value in (("--ttft-slo-ms", args.ttft_slo_ms), ("--ttft-slo-x", args.ttft_slo_x),
                        ("--prefill-tokens-per-s", args.prefill_tokens_per_s)):
        if value is not None and not value > 0:
            parser.error(f"{flag} must be > 0, got {value:g}")
    if args.frontier and (args.ttft_slo_ms is not None or args.ttft_slo_x is not None):
        parser.error("--frontier sets each PDD setup's budget itself (--frontier-x)")
    if not args.frontier_x or not all(x > 0 for x in args.frontier_x):
        parser.error(f"--frontier-x must be positive multiples, got {args.frontier_x}")
    if not args.frontier and args.ttft_slo_ms is None and args.ttft_slo_x is None:
        args.ttft_slo_x = budget.BAR_X  # PDD as we recommend deploying it: by the TTFT budget
    return args


def make_servers(args, line: WanLine, groups: dict, model, log_dir: Path,
                 bootstrap_port: int) -> tuple:
    """(prefill, main_a, main_b, relay), not started: each in its cluster's namespace and its own
    CPU group. One torch thread per server, as every dev-tool server (cluster.CPU_SERVER_ENV)."""
    ns_a, ns_b = line.namespace("a"), line.namespace("b")
    common = dict(model_path=model, log_dir=log_dir, max_total_tokens=MAX_TOTAL_TOKENS)

    def where(side: str, name: str) -> tuple:
        return (*groups[name].exec_prefix(), *line.exec_prefix(side))

    prefill = NetnsServer("prefill", host=line.address("a"), exec_prefix=where("a", "prefill"),
                          netns=ns_a, extra_args=(
                              "--pdd-role", "prefill", "--disaggregation-bootstrap-port",
                              str(bootstrap_port), *TRANSPORT, *TIME_STATS,
                              *NON_OVERLAP_LOOP_ARGS, *line.prefill_flags(),
                              "--pdd-wan-kv-codec", args.wan_kv_codec), **common)
    main_a = NetnsServer("main-a", host="127.0.0.1", exec_prefix=where("a", "main-a"),
                         netns=ns_a, extra_args=("--pdd-role", "main", *TRANSPORT, *METRICS),
                         **common)
    main_b = NetnsServer("main-b", host=line.address("b"), exec_prefix=where("b", "main-b"),
                         netns=ns_b, extra_args=("--pdd-role", "main", *TRANSPORT, *METRICS),
                         **common)
    # Beside prefill in cluster A; it binds cluster A's line address, so main-b reaches its
    # control channel only across the line.
    relay = NetnsServer("relay", host=line.address("a"), exec_prefix=where("a", "relay"),
                        netns=ns_a, extra_args=("--pdd-role", "relay", *TRANSPORT, *METRICS,
                                                *RELAY_CPU_ARGS), **common)
    return prefill, main_a, main_b, relay


def run_plan(args, plan: list, points: dict, workloads: dict, line: WanLine, prefill,
             servers: list, groups: dict, log_dir: Path, bootstrap_port: int, other: str | None,
             results: dict, timings: dict) -> None:
    """Every setup of ``plan`` in order, into ``results[point][setup]``; shared servers start each
    setup with an empty cache. The budget-free setups (pdd_no_budget, the other placement's) get
    no budget; the rest theirs, from same-DC PD's P50 measured earlier at the same point."""
    for index, (point, name, main_server, relay_server, placement, slo_x) in enumerate(plan):
        if index:  # shared servers start each setup with an empty cache
            for server in (prefill, main_server):
                server.wait_idle(60)
                if server.post_raw("/flush_cache") != 200:
                    raise Aborted(f"{server.name} /flush_cache failed")
        spec = points[point]
        if name == "same_dc_pd":
            print(f"{point} point: {spec.conversations} conversations x {spec.turns} turns, "
                  f"{spec.concurrency} at a time", flush=True)
        started = time.perf_counter()
        try:
            budget_s, rate = budget.setup_budget(
                None if name in (NO_BUDGET, other) else args.ttft_slo_ms, slo_x,
                args.prefill_tokens_per_s,
                results[point].get("same_dc_pd"), len(workloads[point][0]))
        except ValueError as err:
            raise Aborted(f"{point}-{name}: {err}") from None
        results[point][name] = run_setup(
            f"{point}-{name}", line, prefill, main_server, relay_server, placement, servers,
            groups, workloads[point], log_dir, bootstrap_port,
            args.inject_crash if index == 0 else None, budget_s, rate)
        timings[f"{point}_{name}_s"] = round(time.perf_counter() - started, 1)


def announce_and_pin(args, server_cpu: float, machine_cores: int, cores: dict | None,
                     log_dir: Path) -> None:
    """Say the fairness rule and the line; under a pinned layout, pin this process (the line,
    the router and the clients inherit it) to the second half of the cores."""
    print(f"CPU budget: every SGLang server {server_cpu:g} core (cgroup cpu quota, "
          f"{cpu_budget.PERIOD_US // 1000} ms period) of {machine_cores}; "
          f"the rest for the router, the line and the clients", flush=True)
    if cores:
        rest = cpu_budget.pinned_layout()["b"]
        print(f"CPU layout {args.cpu_layout}: {cores}; the router, the clients and the line "
              f"on {rest}", flush=True)
        cpu_budget.pin_self(rest)
    print(f"starting the WAN line ({args.rate_mbit:g} Mbit/s, RTT {args.rtt_ms:g} ms "
          f"+-{args.jitter_ms:g} ms) and the servers (logs: {log_dir}) ...", flush=True)


def codec_state(prefill) -> dict:
    """What --pdd-wan-kv-codec did over the run (copies coded and raw, KV and wire bytes)."""
    try:
        return prefill.pdd_state().get("wan_codec")
    except Exception as err:  # a figure, never the run's outcome
        return {"unread": repr(err)}


def backlog_setting(prefill) -> float | None:
    """The prefill's --pdd-wan-cache-only-backlog-s, from its /server_info (None: unread)."""
    try:
        return prefill.get_json("/server_info").get("pdd_wan_cache_only_backlog_s")
    except Exception:  # noqa: BLE001 - a figure, never the run's outcome
        return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    reason = check_machine(args.cgroup_cpu_root, args.cpu_layout)
    if reason:
        print(f"demo: cannot run here: {reason}", file=sys.stderr)
        return 2
    points = {point: replace(spec, seed=args.seed)
              for point, spec in POINTS["quick" if args.quick else "full"].items()}
    workloads = {point: (*agentic.build(spec), spec) for point, spec in points.items()}
    server_cpu = args.server_cpu or cpu_budget.server_cpu_quota(SERVERS_AT_ONCE)
    t0 = time.perf_counter()
    model = ensure_tiny_model(DEMO_MODEL)
    log_dir = Path(tempfile.mkdtemp(prefix="pdd-demo-logs-"))
    # Our own handlers first (WanLine installs its own only where none is set): SIGTERM/SIGHUP
    # unwind through the finally below like Ctrl-C does.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_exit)

    line = WanLine(args.rate_mbit, args.rtt_ms, args.jitter_ms, seed=args.seed)
    cluster_of = {"prefill": "a", "main-a": "a", "relay": "a", "main-b": "b"}
    cores = cpu_budget.server_cores(args.cpu_layout, cluster_of)
    groups = {name: cpu_budget.CpuGroup(f"pdd-demo-{os.getpid()}-{name}", server_cpu,
                                        cpus=cores[name] if cores else None)
              for name in cluster_of}
    own_cpus = os.sched_getaffinity(0)
    results: dict = {"latency": {}, "load": {}}
    timings: dict = {}
    pools: dict = {}
    servers: list = []
    cluster = None
    failure = None
    other = None if args.frontier else f"pdd_{OTHER_PLACEMENT[args.placement].replace('-', '_')}"
    try:
        announce_and_pin(args, server_cpu, len(own_cpus), cores, log_dir)
        for group in groups.values():  # unthrottled while the servers start
            group.create()
        line.start(log_path=str(log_dir / "wan.log"))
        bootstrap_port = free_port()

        prefill, main_a, main_b, relay = make_servers(args, line, groups, model, log_dir,
                                                      bootstrap_port)
        plan = plan_setups(args, main_a, main_b, relay, other)
        if args.inject_crash is not None:  # the crash run ends in its first setup: start only
            plan = plan[:1]                # that setup's servers
        needed = {s.name for _, _, *used, _, _ in plan for s in used if s is not None}
        servers = [s for s in (prefill, main_a, main_b, relay) if s.name in needed | {"prefill"}]
        cluster = Cluster(servers).__enter__()
        for group in groups.values():  # the fairness rule holds from the first request on
            group.limit()
        timings["startup_s"] = round(time.perf_counter() - t0, 1)
        print(f"servers ready in {timings['startup_s']:.0f} s", flush=True)
        run_plan(args, plan, points, workloads, line, prefill, servers, groups, log_dir,
                 bootstrap_port, other, results, timings)
        dead = [s.name for s in servers if not s.alive()]
        if dead:
            raise Aborted(f"{', '.join(dead)} died during the run")
        pools = {s.name: s.wait_idle(60) for s in servers}
        args.wan_codec_state = codec_state(prefill)
        args.cache_only_backlog_s = backlog_setting(prefill)
    except Aborted as err:
        failure = str(err)
    except BaseException as err:
        failure = f"{type(err).__name__}: {err}"
        if not isinstance(err, Exception):  # Ctrl-C, SIGTERM: clean up, then leave
            pids = [s.process.pid for s in servers if s.process is not None]
            cleanup(cluster, line, groups)
            print(f"\ndemo interrupted ({failure}); servers, cgroups and the WAN line stopped",
                  file=sys.stderr)
            leftovers(line, pids, groups, report_to=sys.stderr)
            raise
    finally:
        pids = [s.process.pid for s in servers if s.process is not None]
        cleanup(cluster, line, groups)
        os.sched_setaffinity(0, own_cpus)

    leaks = {n: p for n, p in pools.items() if p["in_use_tokens"] or p["locked_tokens"]}
    timings["total_s"] = round(time.perf_counter() - t0, 1)
    if failure:
        print(f"\ndemo FAILED: {failure}", file=sys.stderr)
        leftovers(line, pids, groups, report_to=sys.stderr)
        return 1
    left = leftovers(line, pids, groups)
    return write_and_print(args, results, line, server_cpu, cores, workloads, pools, leaks, left,
                           timings, log_dir, model, other)


def write_and_print(args, results: dict, line: WanLine, server_cpu: float, cores: dict | None,
                    workloads: dict, pools: dict, leaks: dict, left: dict, timings: dict,
                    log_dir: Path, model, other: str | None) -> int:
    load = results["load"]
    references = {point: budget.reference_budget(
        args.ttft_slo_ms, args.ttft_slo_x or (budget.BAR_X if args.frontier else None),
        setups.get("same_dc_pd")) for point, setups in results.items()}
    for point, setups in results.items():
        budget.annotate(setups, references[point])
    line_info = {"rate_mbit": args.rate_mbit, "rtt_ms": args.rtt_ms, "jitter_ms": args.jitter_ms,
                 "queue_bytes": line.queue_bytes(), "mtu": line.mtu,
                 "kv_bytes_per_token": DEMO_MODEL.kv_bytes_per_token,
                 "seconds_per_1000_uncached_tokens": round(
                     1000 * DEMO_MODEL.kv_bytes_per_token * 8 / (args.rate_mbit * 1e6), 3),
                 "forwarder_stats": line.last_stats}
    # What the prefill dropped cache-only copies past (its flag, read from its /server_info).
    line_info["cache_only_backlog_s"] = getattr(args, "cache_only_backlog_s", None)
    frontier_x = {budget.setup_name(x): x for x in set(args.frontier_x)} if args.frontier else {}
    bar_setup = "pdd"
    if args.frontier:  # the bar at the budget nearest 1.15 x same-DC's P50
        bar_setup = min(frontier_x, key=lambda n: abs(frontier_x[n] - budget.BAR_X))
    codec = {"flag": args.wan_kv_codec, **(getattr(args, "wan_codec_state", None) or {})}
    # Issue 34: each PDD setup's P->MD requests' WAN wait against their copy alone on the line.
    p_to_md = wan_wait.wait_over_alone(load, line_info, DEMO_MODEL.kv_bytes_per_token, codec,
                                       results.get("latency"))
    # PDD's place in the bar: the setup at ~1.15 x (frontier); errors: every setup's, once.
    bar = report.the_bar({**{n: s for n, s in load.items() if n != bar_setup},
                          "pdd": load[bar_setup]}, leaks, p_to_md)
    bar["pdd_setup"] = bar_setup
    bar["pdd_relay_busy_share"] = load[bar_setup].get("relay_busy_share")
    bar["pdd_within_budget_share"] = load[bar_setup].get("within_budget_share")
    summary = {
        "setups": load, "latency_setups": results["latency"], "placement": args.placement,
        "other_placement_setup": other, "bar": bar,
        "ttft_budget": {"slo_ms": args.ttft_slo_ms, "slo_x_of_same_dc_p50": args.ttft_slo_x,
                        "budget_free_setup": None if args.frontier else NO_BUDGET,
                        "reference_budget_s": {p: None if b is None else round(b, 4)
                                               for p, b in references.items()},
                        "within_budget": "share of a setup's requests with a client TTFT <= its "
                                         "budget (its own; the reference one without)",
                        "relay_busy_share": budget.frontier({}, {})["busy_share"]},
        **({"frontier": budget.frontier(load, frontier_x)} if args.frontier else {}),
        # The load point's workload at the top (what scripts/validate_sim.py reads), the latency
        # point's under "latency".
        "workload": {**report.workload_stats(*workloads["load"], load),
                     "latency": report.workload_stats(*workloads["latency"], results["latency"])},
        "cpu_budget": cpu_budget_info(args, server_cpu, cores),
        "line": line_info,
        "wan_kv_codec": codec,
        wan_wait.KEY: p_to_md,
        "model": {**DEMO_MODEL.__dict__, "kv_bytes_per_token": DEMO_MODEL.kv_bytes_per_token,
                  "dtype": "float32", "path": str(model)},
        "topology": TOPOLOGY,
        "pools_after": pools, "leaks": leaks, "cleanup": left,
        "timings": timings, "logs": str(log_dir),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "demo.json").write_text(json.dumps(summary, indent=2))
    plots = write_figures(args, load, line_info, summary)
    if args.publish:  # docs/results/demo.json, or frontier.json and frontier.png
        published.publish("frontier" if args.frontier else "demo", summary, files={
            "frontier.png": args.out / "frontier.png"} if args.frontier else None)
    return print_results(args, results, summary, bar_setup, plots)


def cpu_budget_info(args, server_cpu: float, cores: dict | None) -> dict:
    """demo.json's ``cpu_budget``: the quota every server ran under, and the rule beside it."""
    rule = ("every SGLang server in every setup: its own cgroup v1 cpu group, the same quota; the "
            "rest is headroom for router, line, clients")
    if cores:
        rule += ("; each server on its cores_by_server (the same in every setup), the router, the "
                 "clients and the line on the second half of the cores")
    return {"server_cores": server_cpu, "period_us": cpu_budget.PERIOD_US,
            "machine_cores": len(os.sched_getaffinity(0)), "layout": args.cpu_layout,
            "cores_by_server": {k: list(v) for k, v in cores.items()} if cores else None,
            "rule": rule,
            "fields": "per setup, cpu.<server>: cpu_s (cpuacct.usage), cores_used, "
                      "run_queue_wait_s (schedstat wait summed over the server's threads alive "
                      "throughout, so it can exceed wall time), throttled_s and throttled_periods "
                      "(cpu.stat); host_cpu: CPU seconds of the router, the line's forwarder and "
                      "the demo process (the clients)"}


TOPOLOGY = {
    "same_dc_pd": "router, client, prefill and main-a in namespace pddA (cluster A)",
    "cross_dc_pd": "router, client, prefill in pddA; main-b in pddB (cluster B), reached only via "
                   "the TUN delay line",
    "pdd": "router, client, prefill and relay in pddA; main-b in pddB; KV to main-b, the "
           "relay<->main control channel and main-b's HTTP cross the line",
    "shared": "one prefill serves every setup and main-b every cluster-B setup; their caches are "
              "flushed in between"}


def write_figures(args, load: dict, line_info: dict, summary: dict) -> list:
    """ttft.png, stages.png and (--frontier) frontier.png beside demo.json; their names."""
    plots = [("ttft.png", lambda p: figures.plot_ttft(load, line_info, p)),
             ("stages.png", lambda p: figures.plot_stages(load, p))]
    if args.frontier:
        plots.append(("frontier.png", lambda p: figures.plot_frontier(summary["frontier"], p)))
    for name, plot in plots:
        try:
            plot(args.out / name)
        except Exception as err:  # noqa: BLE001 - the numbers matter more than the figures
            print(f"warning: {name} not written: {err}", file=sys.stderr)
    return plots


def print_results(args, results: dict, summary: dict, bar_setup: str, plots: list) -> int:
    """The tables, the line's classes, the bar and what was left behind; the exit code."""
    load, bar, p_to_md = results["load"], summary["bar"], summary[wan_wait.KEY]
    timings, leaks, left = summary["timings"], summary["leaks"], summary["cleanup"]
    if results["latency"]:
        report.print_table(results["latency"], "latency point (one conversation at a time)")
        budget.print_budget_table(results["latency"])
    report.print_table(load, "load point (4 conversations at a time)")
    budget.print_budget_table(load)
    report.print_intake(load)
    report.print_line_classes(load)
    print(f"\n{wan_wait.summary_line(p_to_md)}")
    if args.frontier:
        budget.print_frontier(summary["frontier"])
    if bar_setup != "pdd":
        print(f"\nthe bar with PDD = {bar_setup}")
    report.print_bar(bar)
    print(f"timings: {timings}")
    busy = {n: s["line_utilisation_a_to_b"] for n, s in load.items() if s["line_utilisation_a_to_b"]}
    if any(u > report.LINE_UTILISATION_LIMIT for u in busy.values()):
        print(f"NOTE: the line was over {report.LINE_UTILISATION_LIMIT:.0%} busy on average: {busy}")
    print("KV slots and tree locks back to baseline on every server" if not leaks
          else f"LEAK: {leaks}")
    leftovers = any(left.values())
    if leftovers:
        print(f"LEFTOVERS: {left}")
    no_handoff = bar["pdd_handoff_share"] == 0
    if no_handoff:
        print("FAILED: PDD made no handoff at the load point (outcomes "
              f"{load[bar_setup]['outcomes']}): the demo does not show PDD working")
    print(f"wrote {args.out / 'demo.json'} and {', '.join(name for name, _ in plots)}")
    return 1 if (bar["errors"] or leaks or leftovers or no_handoff) else 0


if __name__ == "__main__":
    sys.exit(main())
