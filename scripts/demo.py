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
               The router places each request on P->MD or P->RLD->MD (pdd_sglang.policy), with
               --placement (congestion-aware by default); at the load point PDD runs a second
               time with the other placement (setups.pdd_idle_line or pdd_congestion_aware).

Equal compute per role: every SGLang server runs in its own cgroup v1 CPU group with the same
quota (pdd_sglang.dev.cpu_budget), the rest of the machine is headroom for the router, the line's
forwarder and the clients; per-server CPU, run-queue wait and throttled time go to demo.json.

Writes DIR/demo.json, DIR/ttft.png and DIR/stages.png (DIR: --out, default out/demo).
"""

from __future__ import annotations

import argparse
import contextlib
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

from pdd_sglang.dev import cpu_budget  # noqa: E402
from pdd_sglang.dev.demo import figures, report  # noqa: E402
from pdd_sglang.dev.demo.progress import Progress  # noqa: E402
from pdd_sglang.dev.testing import agentic  # noqa: E402
from pdd_sglang.dev.testing.cluster import RELAY_CPU_ARGS, Cluster, free_port  # noqa: E402
from pdd_sglang.dev.testing.tiny_model import WAN_DEMO_MODEL, ensure_tiny_model  # noqa: E402
from pdd_sglang.dev.testing.wan_cluster import NetnsServer, RouterProcess, in_namespace  # noqa: E402
from pdd_sglang.dev.wan_emulator import WanLine, check_prerequisites, netns  # noqa: E402

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
SERVERS_AT_ONCE = 3  # PDD's prefill, relay and main: the most one setup keeps busy
OTHER_PLACEMENT = {"congestion-aware": "idle-line", "idle-line": "congestion-aware"}


class Aborted(RuntimeError):
    pass


def _raise_exit(signum, frame):
    raise SystemExit(128 + signum)


def line_bytes(line: WanLine) -> dict:
    a, b = line.counters("a"), line.counters("b")
    return {"a_to_b": a["tx_bytes"], "b_to_a": b["tx_bytes"]}


def ledger_main_bytes(prefill: NetnsServer) -> int:
    by_role = prefill.pdd_state()["transfers"]["by_role"]
    return sum(v["bytes"] + v.get("aux_bytes", 0) for role, v in by_role.items() if role != "relay")


def run_setup(label: str, line: WanLine, prefill: NetnsServer, main: NetnsServer,
              relay: NetnsServer | None, placement: str, servers: list, groups: dict,
              workload: tuple, log_dir: Path, bootstrap_port: int,
              crash_after: int | None) -> dict:
    system, conversations, spec = workload
    ns_a = line.namespace("a")
    relay_args = ("--relay", relay.url) if relay is not None else ()
    log_path = log_dir / f"router-{label}.log"
    router = RouterProcess(log_path, [
        "--prefill", prefill.url, str(bootstrap_port), *relay_args, "--main", main.url,
        "--wan-gbps", repr(line.rate_mbit / 1e3), "--wan-rtt-ms", repr(line.rtt_ms),
        "--placement", placement, "--health-interval-s", "5", "--read-timeout-s", "180"],
        exec_prefix=line.exec_prefix("a"), netns_name=ns_a)
    try:
        router.start()
        # Warm-up, not measured: the shared system prompt once, so both caches hold it and the
        # transfer connections exist, as in a service that has been running.
        warm = agentic.RequestResult(-1, 0, len(system) + 8, 8, 4)
        with in_namespace(ns_a):
            agentic.stream_generate(router.host, router.port, {
                "input_ids": system + [5, 6, 7, 8, 9, 10, 11, 12],
                "sampling_params": {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}},
                300.0, warm)
        if warm.error:
            raise Aborted(f"{label}: warm-up request failed: {warm.error}\n"
                          f"router log:\n{router.log_tail()}")
        for server in (prefill, main, *([relay] if relay else [])):
            server.wait_idle(60)
        wan_before, kv_before = line_bytes(line), ledger_main_bytes(prefill)
        cpu_before = {name: group.snapshot() for name, group in groups.items()}
        progress = Progress(label, spec.conversations * spec.turns)
        crashed: list[str] = []

        def on_result(result):
            progress.update(result)
            if crash_after is not None and progress.done == crash_after:
                os.killpg(main.process.pid, signal.SIGKILL)  # --inject-crash: test the cleanup

        def should_abort() -> bool:
            if not crashed:
                crashed.extend([s.name for s in servers if not s.alive()]
                               + ([] if router.alive() else ["router"]))
            return bool(crashed)

        started = time.perf_counter()
        results = agentic.run(system, conversations, spec, router.host, router.port,
                              thread_setup=lambda: in_namespace(ns_a), on_result=on_result,
                              should_abort=should_abort, timeout_s=180.0)
        duration = time.perf_counter() - started
        progress.close()
        if any(r.error for r in results):
            # A server SIGKILLed mid-run can fail the last requests before its process has
            # exited (a 2.7 GB process takes a moment): give a death the time to show.
            deadline = time.monotonic() + 15
            while not should_abort() and time.monotonic() < deadline:
                time.sleep(0.2)
        if crashed:
            logs = "\n".join(f"--- {s.name} ({s.log_path}):\n{s.log_tail(15)}"
                             for s in servers if s.name in crashed)
            raise Aborted(f"{label}: {', '.join(crashed)} died during the run\n{logs}")
        cpu = {name: group.usage_between(cpu_before[name], group.snapshot())
               for name, group in groups.items()}
        wan_after, kv_after = line_bytes(line), ledger_main_bytes(prefill)
    finally:
        router.stop()
    wan = {k: wan_after[k] - wan_before[k] for k in wan_before}
    location = "cluster B" if main.netns == line.namespace("b") else "cluster A"
    summary = report.summarize(results, report.prefill_stats_from_log(log_path), wan,
                               kv_after - kv_before, duration, location, line.rate_mbit)
    return {**summary, "placement": placement if relay is not None else None, "cpu": cpu}


def check_machine(cgroup_root: Path) -> str | None:
    """None when the demo can run here, else the one reason it cannot."""
    try:
        check_prerequisites()  # root, /dev/net/tun, iproute2
        cpu_budget.check_cpu_controller(cgroup_root)
    except (PermissionError, FileNotFoundError) as err:
        return str(err)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "out" / "demo")
    parser.add_argument("--quick", action="store_true",
                        help="a short run (under 7 minutes): fewer, shorter conversations")
    parser.add_argument("--placement", choices=sorted(OTHER_PLACEMENT),
                        default="congestion-aware", help="the router's placement for `pdd`")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rate-mbit", type=float, default=RATE_MBIT)
    parser.add_argument("--rtt-ms", type=float, default=RTT_MS)
    parser.add_argument("--jitter-ms", type=float, default=JITTER_MS)
    parser.add_argument("--server-cpu", type=float, default=None,
                        help="CPU quota of every SGLang server in cores (default: the machine "
                             "less 0.5 core of headroom, over the 3 servers PDD runs at once)")
    parser.add_argument("--cgroup-cpu-root", type=Path, default=cpu_budget.CPU_ROOT,
                        help=argparse.SUPPRESS)  # tests: a missing controller
    parser.add_argument("--inject-crash", type=int, default=None, metavar="N",
                        help=argparse.SUPPRESS)  # kill main after N requests of the first setup (tests)
    args = parser.parse_args(argv)

    reason = check_machine(args.cgroup_cpu_root)
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
    names = ("prefill", "main-a", "main-b", "relay")
    groups = {name: cpu_budget.CpuGroup(f"pdd-demo-{os.getpid()}-{name}", server_cpu)
              for name in names}
    results: dict = {"latency": {}, "load": {}}
    timings: dict = {}
    pools: dict = {}
    servers: list = []
    cluster = None
    failure = None
    other = f"pdd_{OTHER_PLACEMENT[args.placement].replace('-', '_')}"
    try:
        print(f"CPU budget: every SGLang server {server_cpu:g} core (cgroup cpu quota, "
              f"{cpu_budget.PERIOD_US // 1000} ms period) of {len(os.sched_getaffinity(0))}; "
              f"the rest for the router, the line and the clients", flush=True)
        print(f"starting the WAN line ({args.rate_mbit:g} Mbit/s, RTT {args.rtt_ms:g} ms "
              f"+-{args.jitter_ms:g} ms) and the servers (logs: {log_dir}) ...", flush=True)
        for group in groups.values():  # unthrottled while the servers start
            group.create()
        line.start(log_path=str(log_dir / "wan.log"))
        ns_a, ns_b = line.namespace("a"), line.namespace("b")
        bootstrap_port = free_port()
        # One torch thread per server, as every dev-tool server (cluster.CPU_SERVER_ENV).
        common = dict(model_path=model, log_dir=log_dir, max_total_tokens=MAX_TOTAL_TOKENS)

        def where(side: str, name: str) -> tuple:
            return (*groups[name].exec_prefix(), *line.exec_prefix(side))

        prefill = NetnsServer("prefill", host=line.address("a"), exec_prefix=where("a", "prefill"),
                              netns=ns_a, extra_args=(
                                  "--pdd-role", "prefill", "--disaggregation-bootstrap-port",
                                  str(bootstrap_port), *TRANSPORT, *TIME_STATS), **common)
        main_a = NetnsServer("main-a", host="127.0.0.1", exec_prefix=where("a", "main-a"),
                             netns=ns_a, extra_args=("--pdd-role", "main", *TRANSPORT), **common)
        main_b = NetnsServer("main-b", host=line.address("b"), exec_prefix=where("b", "main-b"),
                             netns=ns_b, extra_args=("--pdd-role", "main", *TRANSPORT), **common)
        # Beside prefill in cluster A; it binds cluster A's line address, so main-b reaches its
        # control channel only across the line.
        relay = NetnsServer("relay", host=line.address("a"), exec_prefix=where("a", "relay"),
                            netns=ns_a, extra_args=("--pdd-role", "relay", *TRANSPORT,
                                                    *RELAY_CPU_ARGS), **common)
        plan = [("latency", "same_dc_pd", main_a, None, args.placement),
                ("latency", "cross_dc_pd", main_b, None, args.placement),
                ("latency", "pdd", main_b, relay, args.placement),
                ("load", "same_dc_pd", main_a, None, args.placement),
                ("load", "cross_dc_pd", main_b, None, args.placement),
                ("load", "pdd", main_b, relay, args.placement),
                ("load", other, main_b, relay, OTHER_PLACEMENT[args.placement])]
        if args.inject_crash is not None:  # the crash run ends in its first setup: start only
            plan = plan[:1]                # that setup's servers
        needed = {s.name for _, _, *used, _ in plan for s in used if s is not None}
        servers = [s for s in (prefill, main_a, main_b, relay) if s.name in needed | {"prefill"}]
        cluster = Cluster(servers).__enter__()
        for group in groups.values():  # the fairness rule holds from the first request on
            group.limit()
        timings["startup_s"] = round(time.perf_counter() - t0, 1)
        print(f"servers ready in {timings['startup_s']:.0f} s", flush=True)
        for index, (point, name, main_server, relay_server, placement) in enumerate(plan):
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
            results[point][name] = run_setup(
                f"{point}-{name}", line, prefill, main_server, relay_server, placement, servers,
                groups, workloads[point], log_dir, bootstrap_port,
                args.inject_crash if index == 0 else None)
            timings[f"{point}_{name}_s"] = round(time.perf_counter() - started, 1)
        dead = [s.name for s in servers if not s.alive()]
        if dead:
            raise Aborted(f"{', '.join(dead)} died during the run")
        pools = {s.name: s.wait_idle(60) for s in servers}
    except Aborted as err:
        failure = str(err)
    except BaseException as err:
        failure = f"{type(err).__name__}: {err}"
        if not isinstance(err, Exception):  # Ctrl-C, SIGTERM: clean up, then leave
            pids = [s.process.pid for s in servers if s.process is not None]
            _cleanup(cluster, line, groups)
            print(f"\ndemo interrupted ({failure}); servers, cgroups and the WAN line stopped",
                  file=sys.stderr)
            _leftovers(line, pids, groups, report_to=sys.stderr)
            raise
    finally:
        pids = [s.process.pid for s in servers if s.process is not None]
        _cleanup(cluster, line, groups)

    leaks = {n: p for n, p in pools.items() if p["in_use_tokens"] or p["locked_tokens"]}
    timings["total_s"] = round(time.perf_counter() - t0, 1)
    if failure:
        print(f"\ndemo FAILED: {failure}", file=sys.stderr)
        _leftovers(line, pids, groups, report_to=sys.stderr)
        return 1
    left = _leftovers(line, pids, groups)
    return write_and_print(args, results, line, server_cpu, workloads, pools, leaks, left,
                           timings, log_dir, model, other)


def write_and_print(args, results: dict, line: WanLine, server_cpu: float, workloads: dict,
                    pools: dict, leaks: dict, left: dict, timings: dict, log_dir: Path, model,
                    other: str) -> int:
    load = results["load"]
    line_info = {"rate_mbit": args.rate_mbit, "rtt_ms": args.rtt_ms, "jitter_ms": args.jitter_ms,
                 "queue_bytes": line.queue_bytes(), "mtu": line.mtu,
                 "kv_bytes_per_token": DEMO_MODEL.kv_bytes_per_token,
                 "seconds_per_1000_uncached_tokens": round(
                     1000 * DEMO_MODEL.kv_bytes_per_token * 8 / (args.rate_mbit * 1e6), 3),
                 "forwarder_stats": line.last_stats}
    bar = report.the_bar(load, leaks)
    summary = {
        "setups": load, "latency_setups": results["latency"], "placement": args.placement,
        "other_placement_setup": other, "bar": bar,
        # The load point's workload at the top (what scripts/validate_sim.py reads), the latency
        # point's under "latency".
        "workload": {**report.workload_stats(*workloads["load"], load),
                     "latency": report.workload_stats(*workloads["latency"], results["latency"])},
        "cpu_budget": {"server_cores": server_cpu, "period_us": cpu_budget.PERIOD_US,
                       "machine_cores": len(os.sched_getaffinity(0)),
                       "rule": "every SGLang server in every setup: its own cgroup v1 cpu group, "
                               "the same quota; the rest is headroom for router, line, clients",
                       "fields": "per setup, cpu.<server>: cpu_s (cpuacct.usage), cores_used, "
                                 "run_queue_wait_s (schedstat wait summed over the server's "
                                 "threads alive throughout, so it can exceed wall time), "
                                 "throttled_s and throttled_periods (cpu.stat)"},
        "line": line_info,
        "model": {**DEMO_MODEL.__dict__, "kv_bytes_per_token": DEMO_MODEL.kv_bytes_per_token,
                  "dtype": "float32", "path": str(model)},
        "topology": {
            "same_dc_pd": "router, client, prefill and main-a in namespace pddA (cluster A)",
            "cross_dc_pd": "router, client, prefill in pddA; main-b in pddB (cluster B), reached "
                           "only via the TUN delay line",
            "pdd": "router, client, prefill and relay in pddA; main-b in pddB; KV to main-b, "
                   "the relay<->main control channel and main-b's HTTP cross the line",
            "shared": "one prefill serves every setup and main-b every cluster-B setup; their "
                      "caches are flushed in between"},
        "pools_after": pools, "leaks": leaks, "cleanup": left,
        "timings": timings, "logs": str(log_dir),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "demo.json").write_text(json.dumps(summary, indent=2))
    for name, plot in (("ttft.png", lambda p: figures.plot_ttft(load, line_info, p)),
                       ("stages.png", lambda p: figures.plot_stages(load, p))):
        try:
            plot(args.out / name)
        except Exception as err:  # noqa: BLE001 - the numbers matter more than the figures
            print(f"warning: {name} not written: {err}", file=sys.stderr)

    report.print_table(results["latency"], "latency point (one conversation at a time)")
    report.print_table(load, "load point (4 conversations at a time)")
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
              f"{load['pdd']['outcomes']}): the demo does not show PDD working")
    print(f"wrote {args.out / 'demo.json'}, {args.out / 'ttft.png'} and {args.out / 'stages.png'}")
    return 1 if (bar["errors"] or leaks or leftovers or no_handoff) else 0


def _leftovers(line: WanLine, pids: list, groups: dict, report_to=None) -> dict:
    """What cleanup left behind (nothing, or a defect); printed where a test can read it."""
    left = {"namespaces_left": [n for n in line.namespaces.values() if netns.exists(n)],
            "server_processes_left": [p for p in pids if netns._alive(p)],
            "cgroups_left": [g.name for g in groups.values() if g.exists()]}
    if report_to is not None:
        print(f"cleanup: namespaces {sorted(line.namespaces.values())} left "
              f"{left['namespaces_left']}, server processes {pids} left "
              f"{left['server_processes_left']}, cgroups {[g.name for g in groups.values()]} "
              f"left {left['cgroups_left']}", file=report_to)
    return left


def _cleanup(cluster, line: WanLine, groups: dict) -> None:
    with contextlib.suppress(Exception):
        if cluster is not None:
            cluster.stop()
    with contextlib.suppress(Exception):
        line.stop()
    for group in groups.values():
        with contextlib.suppress(Exception):
            group.remove()


if __name__ == "__main__":
    sys.exit(main())
