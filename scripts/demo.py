#!/usr/bin/env python3
"""`make demo`: same-DC PD, naive cross-DC PD and PDD over an emulated WAN line, on real SGLang.

One agentic multi-turn workload (a long shared system prompt, growing histories, a skewed hit rate
with a few long-document turns, short outputs; fixed seed, bounded concurrency) runs through the
PDD router on three setups:

  same_dc_pd   prefill, main decode (decode radix cache on), router and client all in cluster A
               (network namespace pddA-<pid>); P<->MD stays on A's loopback, the line stays idle.
  cross_dc_pd  prefill, router and client in cluster A; main decode in cluster B (pddB-<pid>),
               reachable only through the emulated WAN line (rate limit, RTT, jitter): Mooncake's
               KV transfer, the bootstrap handshake and the router's HTTP all cross it.
  pdd          prefill, relay decode, router and client in cluster A; main decode in cluster B.
               The router places each request on P->MD or P->RLD->MD (pdd_sglang.policy); on
               P->RLD->MD the relay decodes while main's KV crosses the line, then hands its
               token IDs to main over the control channel, which crosses the line too.

The setups share one prefill server and the cluster-B main (both caches are flushed in between);
the same-DC setup has its own main, and each setup its own router. TTFT and inter-token latency
are measured at the client from the stream; WAN bytes come from the line's kernel counters and
the prefill's transfer ledger.

Writes DIR/demo.json and DIR/ttft.png (DIR: --out, default out/demo).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pdd_sglang.dev.testing import agentic  # noqa: E402
from pdd_sglang.dev.testing.cluster import RELAY_CPU_ARGS, Cluster, free_port  # noqa: E402
from pdd_sglang.dev.testing.tiny_model import WAN_DEMO_MODEL, ensure_tiny_model  # noqa: E402
from pdd_sglang.dev.testing.wan_cluster import NetnsServer, RouterProcess, in_namespace  # noqa: E402
from pdd_sglang.dev.wan_emulator import WanLine, check_prerequisites, netns  # noqa: E402

DEMO_MODEL = WAN_DEMO_MODEL  # 8 KiB of KV per token: a 1000-token document is 8 MB on the wire
# The line: at 10 Mbit/s a 1000-token document's KV (8.2 MB) takes about 6.6 s to cross, a
# high-hit turn's suffix (about 80 tokens, 0.65 MB) about 0.5 s plus a few 40 ms round trips.
# (Slower than a real leased line, like the model is smaller than a real one: on 2 shared CPU
# cores prefill and decode are slow too, and the ratio of WAN to compute time is what matters.)
RATE_MBIT, RTT_MS, JITTER_MS = 10.0, 40.0, 4.0
FULL = agentic.WorkloadSpec(conversations=12, turns=6, document_prob=0.15)
QUICK = agentic.WorkloadSpec(conversations=6, turns=5, system_tokens=1024, document_prob=0.15,
                             concurrency=3)
MAX_TOTAL_TOKENS = 32768  # per server: the conversations in flight and the system prompt stay cached
SETUPS = ("same_dc_pd", "cross_dc_pd", "pdd")
# The brief's bar, measured in one run: PDD's P99 TTFT within 1.15x same-DC PD's, naive
# cross-DC PD's at least 2x.
PDD_BAR, CROSS_BAR = 1.15, 2.0
TRANSPORT = ("--disaggregation-transfer-backend", "mooncake_tcp")


class Aborted(RuntimeError):
    pass


def _raise_exit(signum, frame):
    raise SystemExit(128 + signum)


class Progress:
    """One-line progress bar on stderr."""

    def __init__(self, label: str, total: int, width: int = 30):
        self.label, self.total, self.width = label, total, width
        self.done = self.errors = 0
        self.started = time.perf_counter()
        self.tty = sys.stderr.isatty()
        self._last_line = 0.0

    def update(self, result: agentic.RequestResult) -> None:
        self.done += 1
        self.errors += bool(result.error)
        now = time.perf_counter()
        if self.tty or now - self._last_line > 5 or self.done == self.total:
            self._last_line = now
            self.draw()

    def draw(self) -> None:
        filled = int(self.width * self.done / max(self.total, 1))
        bar = "#" * filled + "-" * (self.width - filled)
        end = "" if self.tty else "\n"
        sys.stderr.write(f"\r  {self.label:<12} [{bar}] {self.done:>4}/{self.total} requests  "
                         f"errors {self.errors}  {time.perf_counter() - self.started:6.1f} s{end}")
        sys.stderr.flush()

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\n")
            sys.stderr.flush()


def line_bytes(line: WanLine) -> dict:
    a, b = line.counters("a"), line.counters("b")
    return {"a_to_b": a["tx_bytes"], "b_to_a": b["tx_bytes"]}


def ledger_main_bytes(prefill: NetnsServer) -> int:
    by_role = prefill.pdd_state()["transfers"]["by_role"]
    return sum(v["bytes"] + v.get("aux_bytes", 0) for role, v in by_role.items() if role != "relay")


def summarize(name: str, results: list, wan: dict, kv_bytes: int, duration_s: float,
              main_location: str) -> dict:
    ok = [r for r in results if not r.error]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    itl = [g for r in ok for g in r.itl_s]
    pct = agentic.percentile
    hits = [(r.cached_tokens or 0) / r.prompt_tokens for r in ok if r.cached_tokens is not None]
    low = [r for r in ok if r.cached_tokens is not None and r.cached_tokens / r.prompt_tokens < 0.8]
    high = [r for r in ok if r.cached_tokens is not None and r.cached_tokens / r.prompt_tokens >= 0.95]
    cached = sum(r.cached_tokens or 0 for r in ok)
    prompt = sum(r.prompt_tokens for r in ok)
    pipelines: dict = {}
    for r in ok:
        pipelines[r.pipeline or "unknown"] = pipelines.get(r.pipeline or "unknown", 0) + 1

    def rnd(value, digits):
        return None if value is None else round(value, digits)

    return {
        "main_location": main_location,
        "ttft_p50_s": rnd(pct(ttft, 50), 4), "ttft_p90_s": rnd(pct(ttft, 90), 4),
        "ttft_p99_s": rnd(pct(ttft, 99), 4),
        "ttft_mean_s": rnd(sum(ttft) / len(ttft), 4) if ttft else None,
        "itl_p50_ms": rnd(pct(itl, 50) * 1e3, 2) if itl else None,
        "itl_p99_ms": rnd(pct(itl, 99) * 1e3, 2) if itl else None,
        "e2e_p50_s": rnd(pct([r.e2e_s for r in ok], 50), 4),
        "wan_bytes": wan["a_to_b"] + wan["b_to_a"],
        "wan_bytes_a_to_b": wan["a_to_b"], "wan_bytes_b_to_a": wan["b_to_a"],
        "kv_bytes_to_main": kv_bytes,
        "kv_bytes_over_wan": kv_bytes if main_location == "cluster B" else 0,
        "requests": len(results), "errors": len(results) - len(ok),
        "error_messages": sorted({r.error for r in results if r.error})[:5],
        "main_token_hit": rnd(cached / prompt, 4) if prompt else None,
        "requests_hit_ge_95pct": len(high), "requests_hit_lt_80pct": len(low),
        "ttft_p50_s_hit_ge_95pct": rnd(pct([r.ttft_s for r in high], 50), 4),
        "ttft_p50_s_hit_lt_80pct": rnd(pct([r.ttft_s for r in low], 50), 4),
        "median_request_hit": rnd(pct(hits, 50), 4),
        "pipelines": pipelines,
        "duration_s": round(duration_s, 2),
        "rows": [r.summary() for r in results],
    }


def run_setup(name: str, line: WanLine, prefill: NetnsServer, main: NetnsServer,
              relay: NetnsServer | None, servers: list, system: list, conversations: list,
              spec: agentic.WorkloadSpec, log_dir: Path, bootstrap_port: int,
              crash_after: int | None) -> dict:
    ns_a = line.namespace("a")
    relay_args = ("--relay", relay.url) if relay is not None else ()
    router = RouterProcess(log_dir / f"router-{name}.log", [
        "--prefill", prefill.url, str(bootstrap_port), *relay_args, "--main", main.url,
        "--wan-gbps", repr(line.rate_mbit / 1e3), "--wan-rtt-ms", repr(line.rtt_ms),
        "--health-interval-s", "5", "--read-timeout-s", "180"],
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
            raise Aborted(f"{name}: warm-up request failed: {warm.error}\n"
                          f"router log:\n{router.log_tail()}")
        for server in (prefill, main, *([relay] if relay else [])):
            server.wait_idle(60)
        wan_before, kv_before = line_bytes(line), ledger_main_bytes(prefill)
        progress = Progress(name, spec.conversations * spec.turns)
        crashed: list[str] = []

        def on_result(result):
            progress.update(result)
            if crash_after is not None and progress.done == crash_after:
                os.killpg(main.process.pid, signal.SIGKILL)  # --inject-crash: test the cleanup

        def should_abort() -> bool:
            if not crashed:
                dead = [s.name for s in servers if not s.alive()]
                if not router.alive():
                    dead.append("router")
                crashed.extend(dead)
            return bool(crashed)

        started = time.perf_counter()
        results = agentic.run(system, conversations, spec, router.host, router.port,
                              thread_setup=lambda: in_namespace(ns_a), on_result=on_result,
                              should_abort=should_abort, timeout_s=180.0)
        duration = time.perf_counter() - started
        progress.close()
        if crashed:
            logs = "\n".join(f"--- {s.name} ({s.log_path}):\n{s.log_tail(15)}"
                             for s in servers if s.name in crashed)
            raise Aborted(f"{name}: {', '.join(crashed)} died during the run\n{logs}")
        wan_after, kv_after = line_bytes(line), ledger_main_bytes(prefill)
    finally:
        router.stop()
    wan = {k: wan_after[k] - wan_before[k] for k in wan_before}
    location = "cluster B" if main.netns == line.namespace("b") else "cluster A"
    return summarize(name, results, wan, kv_after - kv_before, duration, location)


def print_table(setups: dict) -> None:
    header = (f"{'setup':<12} {'TTFT P50':>9} {'P90':>8} {'P99':>8} {'ITL P50':>8} {'P99':>8} "
              f"{'WAN MB':>8} {'KV->MD MB':>9} {'hit':>6} {'errors':>6} {'requests':>8}")
    print(header)
    print("-" * len(header))
    for name, s in setups.items():
        f = lambda v, unit="s": "-" if v is None else (f"{v:.2f}{unit}")  # noqa: E731
        print(f"{name:<12} {f(s['ttft_p50_s']):>9} {f(s['ttft_p90_s']):>8} {f(s['ttft_p99_s']):>8} "
              f"{f(s['itl_p50_ms'], 'ms'):>8} {f(s['itl_p99_ms'], 'ms'):>8} "
              f"{s['wan_bytes'] / 1e6:>8.2f} {s['kv_bytes_to_main'] / 1e6:>9.2f} "
              f"{(s['main_token_hit'] or 0):>6.1%} {s['errors']:>6} {s['requests']:>8}")


def plot(setups: dict, line_info: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"same_dc_pd": "tab:blue", "cross_dc_pd": "tab:red", "pdd": "tab:green"}
    fig, (cdf, scatter) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in SETUPS:
        rows = [r for r in setups[name]["rows"] if r["error"] is None and r["ttft_s"] is not None]
        values = sorted(r["ttft_s"] for r in rows)
        if not values:
            continue
        ys = [(i + 1) / len(values) for i in range(len(values))]
        cdf.step(values, ys, where="post", color=colors[name], label=name)
        for q, style in ((90, ":"), (99, "--")):
            cdf.axvline(setups[name][f"ttft_p{q}_s"], color=colors[name], linestyle=style,
                        linewidth=0.8)
        scatter.scatter([r["prompt_tokens"] - (r["cached_tokens"] or 0) for r in rows],
                        [r["ttft_s"] for r in rows], s=12, color=colors[name], label=name,
                        alpha=0.7)
    cdf.set_xscale("log")
    cdf.set_xlabel("TTFT at the client (s, log)")
    cdf.set_ylabel("fraction of requests")
    cdf.set_title("TTFT distribution (dotted P90, dashed P99)")
    cdf.legend(loc="lower right")
    scatter.set_xlabel("tokens main decode lacked (prompt - main's cache hit)")
    scatter.set_ylabel("TTFT (s)")
    scatter.set_title("the WAN copy grows with the uncached suffix")
    scatter.legend(loc="upper left")
    fig.suptitle(f"main decode behind a {line_info['rate_mbit']:g} Mbit/s line, RTT {line_info['rtt_ms']:g}"
                 f" ms +-{line_info['jitter_ms']:g} ms; KV {line_info['kv_bytes_per_token']} B/token")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def workload_stats(spec: agentic.WorkloadSpec, system: list, conversations: list,
                   setups: dict) -> dict:
    rows = [r for name in SETUPS for r in setups[name]["rows"] if r["error"] is None]
    prompts = [r["prompt_tokens"] for r in rows]
    outputs = [r["output_tokens"] for r in rows]
    pct = agentic.percentile
    stats = lambda v: {"min": min(v), "p50": pct(v, 50), "p90": pct(v, 90),  # noqa: E731
                       "max": max(v), "mean": round(sum(v) / len(v), 1)} if v else None
    documents = sum(1 for c in conversations for new, _ in c.turns
                    if len(new) >= spec.document_tokens[0])
    return {**spec.to_json(), "kind": "agentic multi-turn", "requests_per_setup":
            spec.conversations * spec.turns, "document_turns": documents,
            "system_prompt_tokens": len(system), "prompt_token_stats": stats(prompts),
            "output_token_stats": stats(outputs),
            "warmup": "one unmeasured request with the shared system prompt per setup",
            "placement": "router with --prefill and --main only: every request P->MD"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "out" / "demo")
    parser.add_argument("--quick", action="store_true",
                        help="a short run (about 2-3 minutes): fewer, shorter conversations")
    parser.add_argument("--conversations", type=int, default=None)
    parser.add_argument("--turns", type=int, default=None)
    parser.add_argument("--concurrency", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rate-mbit", type=float, default=RATE_MBIT)
    parser.add_argument("--rtt-ms", type=float, default=RTT_MS)
    parser.add_argument("--jitter-ms", type=float, default=JITTER_MS)
    parser.add_argument("--inject-crash", type=int, default=None, metavar="N",
                        help=argparse.SUPPRESS)  # kill main after N requests of the first setup (tests)
    args = parser.parse_args(argv)

    try:
        check_prerequisites()
    except (PermissionError, FileNotFoundError) as err:
        print(f"demo: cannot emulate the WAN line here: {err}", file=sys.stderr)
        return 2

    spec = QUICK if args.quick else FULL
    overrides = {k: getattr(args, k) for k in ("conversations", "turns", "concurrency")
                 if getattr(args, k) is not None}
    spec = replace(spec, seed=args.seed, **overrides)
    system, conversations = agentic.build(spec)
    t0 = time.perf_counter()
    model = ensure_tiny_model(DEMO_MODEL)
    log_dir = Path(tempfile.mkdtemp(prefix="pdd-demo-logs-"))
    # Our own handlers first (WanLine installs its own only where none is set): SIGTERM/SIGHUP
    # unwind through the finally below like Ctrl-C does.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_exit)

    line = WanLine(args.rate_mbit, args.rtt_ms, args.jitter_ms, seed=args.seed)
    setups: dict = {}
    timings: dict = {}
    pools: dict = {}
    pids: list[int] = []
    cluster = None
    failure = None
    try:
        print(f"starting the WAN line ({args.rate_mbit:g} Mbit/s, RTT {args.rtt_ms:g} ms "
              f"+-{args.jitter_ms:g} ms) and 4 servers (logs: {log_dir}) ...", flush=True)
        line.start(log_path=str(log_dir / "wan.log"))
        ns_a, ns_b = line.namespace("a"), line.namespace("b")
        bootstrap_port = free_port()
        common = dict(model_path=model, log_dir=log_dir, max_total_tokens=MAX_TOTAL_TOKENS,
                      env={"OMP_NUM_THREADS": "1"})
        cores = cpu_plan()

        def where(side: str, role: str) -> tuple:
            return (*line.exec_prefix(side), *cores[role])

        prefill = NetnsServer("prefill", host=line.address("a"), exec_prefix=where("a", "prefill"),
                              netns=ns_a, extra_args=(
                                  "--pdd-role", "prefill", "--disaggregation-bootstrap-port",
                                  str(bootstrap_port), *TRANSPORT), **common)
        main_a = NetnsServer("main-a", host="127.0.0.1", exec_prefix=where("a", "decode"),
                             netns=ns_a, extra_args=("--pdd-role", "main", *TRANSPORT), **common)
        main_b = NetnsServer("main-b", host=line.address("b"), exec_prefix=where("b", "decode"),
                             netns=ns_b, extra_args=("--pdd-role", "main", *TRANSPORT), **common)
        # Beside prefill in cluster A; it binds cluster A's line address, so main-b reaches its
        # control channel only across the line.
        relay = NetnsServer("relay", host=line.address("a"), exec_prefix=where("a", "decode"),
                            netns=ns_a, extra_args=("--pdd-role", "relay", *TRANSPORT,
                                                    *RELAY_CPU_ARGS), **common)
        servers = [prefill, main_a, main_b, relay]
        cluster = Cluster(servers).__enter__()
        pids = [s.process.pid for s in servers]
        timings["startup_s"] = round(time.perf_counter() - t0, 1)
        print(f"servers ready in {timings['startup_s']:.0f} s; "
              f"{len(conversations)} conversations x {spec.turns} turns per setup, "
              f"{spec.concurrency} at a time", flush=True)
        for name, main_server, relay_server in (("same_dc_pd", main_a, None),
                                                ("cross_dc_pd", main_b, None),
                                                ("pdd", main_b, relay)):
            # Shared servers start each setup with an empty cache.
            for server in {prefill, main_server} if setups else ():
                server.wait_idle(60)
                status = server.post_raw("/flush_cache")
                if status != 200:
                    raise Aborted(f"{server.name} /flush_cache answered {status}")
            started = time.perf_counter()
            setups[name] = run_setup(
                name, line, prefill, main_server, relay_server, servers, system, conversations,
                spec, log_dir, bootstrap_port, args.inject_crash if name == SETUPS[0] else None)
            timings[f"{name}_s"] = round(time.perf_counter() - started, 1)
        pools = {s.name: s.wait_idle(60) for s in servers}
    except Aborted as err:
        failure = str(err)
    except BaseException as err:
        failure = f"{type(err).__name__}: {err}"
        if not isinstance(err, Exception):  # Ctrl-C, SIGTERM: clean up, then leave
            _cleanup(cluster, line)
            print(f"\ndemo interrupted ({failure}); servers and the WAN line stopped", file=sys.stderr)
            raise
    finally:
        _cleanup(cluster, line)

    left_ns = [n for n in line.namespaces.values() if netns.exists(n)]
    left_pids = [p for p in pids if netns._alive(p)]
    leaks = {n: p for n, p in pools.items() if p["in_use_tokens"] or p["locked_tokens"]}
    timings["total_s"] = round(time.perf_counter() - t0, 1)
    if failure:
        print(f"\ndemo FAILED: {failure}", file=sys.stderr)
        print(f"cleanup: namespaces {sorted(line.namespaces.values())} left {left_ns}, "
              f"server processes {pids} left {left_pids}", file=sys.stderr)
        return 1

    line_info = {"rate_mbit": args.rate_mbit, "rtt_ms": args.rtt_ms, "jitter_ms": args.jitter_ms,
                 "queue_bytes": line.queue_bytes(), "mtu": line.mtu,
                 "kv_bytes_per_token": DEMO_MODEL.kv_bytes_per_token,
                 "seconds_per_1000_uncached_tokens": round(
                     1000 * DEMO_MODEL.kv_bytes_per_token * 8 / (args.rate_mbit * 1e6), 3),
                 "forwarder_stats": line.last_stats}
    summary = {
        "setups": setups,
        "bar": the_bar(setups),
        "workload": workload_stats(spec, system, conversations, setups),
        "line": line_info,
        "model": {**DEMO_MODEL.__dict__, "kv_bytes_per_token": DEMO_MODEL.kv_bytes_per_token,
                  "dtype": "float32", "path": str(model)},
        "topology": {
            "same_dc_pd": "router, client, prefill and main-a in namespace pddA (cluster A); "
                          "P<->MD over A's loopback",
            "cross_dc_pd": "router, client, prefill in pddA; main-b in pddB (cluster B), reached "
                           "only via the TUN delay line",
            "pdd": "router, client, prefill and relay in pddA; main-b in pddB; KV to main-b, "
                   "the relay<->main control channel and main-b's HTTP cross the line",
            "shared": "one prefill serves every setup and main-b both cluster-B setups; their "
                      "caches are flushed in between"},
        "cpu_affinity": {role: " ".join(argv[2:]) or "any" for role, argv in cpu_plan().items()},
        "pools_after": pools, "leaks": leaks,
        "cleanup": {"namespaces_left": left_ns, "server_processes_left": left_pids},
        "timings": timings, "logs": str(log_dir),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "demo.json").write_text(json.dumps(summary, indent=2))
    png = args.out / "ttft.png"
    try:
        plot(setups, line_info, png)
    except Exception as err:  # noqa: BLE001 - the numbers matter more than the figure
        print(f"warning: figure not written: {err}", file=sys.stderr)

    print()
    print_table(setups)
    same = setups["same_dc_pd"]
    for other in ("cross_dc_pd", "pdd"):
        s = setups[other]
        if same["ttft_p90_s"] and s["ttft_p90_s"]:
            print(f"\n{other} / same_dc_pd TTFT: P50 x{s['ttft_p50_s'] / same['ttft_p50_s']:.2f}, "
                  f"P90 x{s['ttft_p90_s'] / same['ttft_p90_s']:.2f}, "
                  f"P99 x{s['ttft_p99_s'] / same['ttft_p99_s']:.2f}", end="")
    bar = summary["bar"]
    print(f"\nthe bar (P99 TTFT): PDD x{bar['pdd_over_same_dc_p99']} (<= {PDD_BAR}: "
          f"{'met' if bar['pdd_met'] else 'NOT met'}), naive cross-DC "
          f"x{bar['cross_dc_over_same_dc_p99']} (>= {CROSS_BAR}: "
          f"{'met' if bar['cross_dc_met'] else 'NOT met'})")
    print(f"timings: {timings}")
    errors = sum(setups[n]["errors"] for n in SETUPS)
    print("KV slots and tree locks back to baseline on every server" if not leaks
          else f"LEAK: {leaks}")
    if left_ns or left_pids:
        print(f"LEFTOVERS: namespaces {left_ns}, processes {left_pids}")
    print(f"wrote {args.out / 'demo.json'} and {png}")
    return 1 if (errors or leaks or left_ns or left_pids) else 0


def cpu_plan() -> dict:
    """Which cores each role runs on: prefill on its own core, every decode server on the others.

    In the systems being emulated each role has its own accelerator; on a small CPU machine the
    three servers of PDD would otherwise compete for the cores that same-DC PD's two servers
    share, and PDD's TTFT would measure that contention rather than the WAN. Pinning prefill
    alone gives it the same speed in every setup; the decode servers share what is left (relay
    and main together in PDD, main alone in the PD setups). One OpenMP thread per server keeps
    processes from spinning on each other's cores.
    """
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2 or not shutil.which("taskset"):
        return {"prefill": (), "decode": ()}
    rest = ",".join(str(c) for c in cpus[1:])
    return {"prefill": ("taskset", "-c", str(cpus[0])), "decode": ("taskset", "-c", rest)}


def the_bar(setups: dict) -> dict:
    """PDD's P99 TTFT against same-DC PD's, and naive cross-DC's, from this one run."""
    same = setups["same_dc_pd"]["ttft_p99_s"]
    ratio = lambda name: (round(setups[name]["ttft_p99_s"] / same, 3)  # noqa: E731
                          if same and setups[name]["ttft_p99_s"] else None)
    pdd, cross = ratio("pdd"), ratio("cross_dc_pd")
    return {"pdd_over_same_dc_p99": pdd, "cross_dc_over_same_dc_p99": cross,
            "pdd_bound": PDD_BAR, "cross_dc_bound": CROSS_BAR,
            "pdd_met": pdd is not None and pdd <= PDD_BAR,
            "cross_dc_met": cross is not None and cross >= CROSS_BAR}


def _cleanup(cluster, line: WanLine) -> None:
    with contextlib.suppress(Exception):
        if cluster is not None:
            cluster.stop()
    with contextlib.suppress(Exception):
        line.stop()


if __name__ == "__main__":
    sys.exit(main())
