"""One demo setup: the PDD router in front of a prefill, a main and maybe a relay, the agentic
workload through it, and what the run cost (CPU per server, line bytes, decode work per server,
the router's verdicts against the TTFT budget). scripts/demo.py runs one per setup."""

from __future__ import annotations

import contextlib
import os
import signal
import time
import urllib.request
from pathlib import Path
from typing import Optional

from pdd_sglang.dev import cpu_budget
from pdd_sglang.dev.demo import budget as budgets
from pdd_sglang.dev.demo import report
from pdd_sglang.dev.demo.progress import Progress
from pdd_sglang.dev.testing import agentic
from pdd_sglang.dev.testing.line_backlog import LineBacklog
from pdd_sglang.dev.testing.wan_cluster import NetnsServer, RouterProcess, in_namespace
from pdd_sglang.dev.wan_emulator import WanLine, netns


class Aborted(RuntimeError):
    pass


def line_bytes(line: WanLine) -> dict:
    a, b = line.counters("a"), line.counters("b")
    return {"a_to_b": a["tx_bytes"], "b_to_a": b["tx_bytes"]}


def ledger_main_bytes(prefill: NetnsServer) -> int:
    by_role = prefill.pdd_state()["transfers"]["by_role"]
    return sum(v["bytes"] + v.get("aux_bytes", 0) for role, v in by_role.items() if role != "relay")


LINE_CLASSES = ("needed_now_sent_bytes", "cache_only_sent_bytes", "dropped_cache_only_bytes")


def line_by_class(prefill: NetnsServer) -> dict:
    """The prefill's WAN line figures by copy class, summed over its mains (what its
    ``/pdd/line`` reports: bytes handed to the line per class, cache-only bytes dropped past
    ``--pdd-wan-cache-only-backlog-s``), read live from its ``/server_info``."""
    lines = prefill.pdd_state().get("wan_line") or {}
    return {key: sum(int(line.get(key) or 0) for line in lines.values()) for key in LINE_CLASSES}


def metrics_text(server: NetnsServer) -> str:
    with in_namespace(server.netns):
        with urllib.request.urlopen(server.url + "/metrics", timeout=30) as resp:
            return resp.read().decode()


def decode_tokens(servers: dict) -> dict:
    """name -> the tokens its decode iterations generated so far (None: not exported, or no
    answer: the figure is left out, the run goes on)."""
    counts = {}
    for name, server in servers.items():
        try:
            counts[name] = budgets.decode_tokens(metrics_text(server)) if server else 0.0
        except OSError:
            counts[name] = None
    return counts


def router_counts(router: RouterProcess) -> tuple[dict, dict]:
    """(placements by budget verdict, re-placements by cause) from the router's /metrics."""
    try:
        text = router.get_text("/metrics")
    except OSError:
        return {}, {}
    return budgets.router_verdicts(text), budgets.router_retries(text)


def run_setup(label: str, line: WanLine, prefill: NetnsServer, main: NetnsServer,
              relay: Optional[NetnsServer], placement: str, servers: list, groups: dict,
              workload: tuple, log_dir: Path, bootstrap_port: int,
              crash_after: Optional[int], budget_s: Optional[float] = None,
              prefill_rate: Optional[float] = None) -> dict:
    system, conversations, spec = workload
    ns_a = line.namespace("a")
    relay_args = ("--relay", relay.url) if relay is not None else ()
    budget_args = () if budget_s is None else ("--ttft-slo-ms", f"{budget_s * 1e3:.1f}")
    if budget_s is not None and prefill_rate:
        budget_args += ("--prefill-tokens-per-s", f"{prefill_rate:.1f}")
    log_path = log_dir / f"router-{label}.log"
    router = RouterProcess(log_path, [
        "--prefill", prefill.url, str(bootstrap_port), *relay_args, "--main", main.url,
        "--wan-gbps", repr(line.rate_mbit / 1e3), "--wan-rtt-ms", repr(line.rtt_ms),
        "--placement", placement, "--health-interval-s", "5", "--read-timeout-s", "180",
        "--log-prefill-stats", *budget_args], exec_prefix=line.exec_prefix("a"), netns_name=ns_a)
    decoders = {"relay": relay, "main": main}
    try:
        router.start()
        # Warm-up, not measured: the shared system prompt once, so both caches hold it and the
        # transfer connections exist, as in a service that has been running.
        warm = agentic.RequestResult(-1, 0, len(system) + 8, 8, 4)
        with in_namespace(ns_a):
            agentic.stream_generate(router.host, router.port, {
                "input_ids": system + [5, 6, 7, 8, 9, 10, 11, 12],
                "sampling_params": {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}},
                300.0, warm, router.headers)
        if warm.error:
            raise Aborted(f"{label}: warm-up request failed: {warm.error}\n"
                          f"router log:\n{router.log_tail()}")
        for server in (prefill, main, *([relay] if relay else [])):
            server.wait_idle(60)
        wan_before, kv_before = line_bytes(line), ledger_main_bytes(prefill)
        classes_before = line_by_class(prefill)
        cpu_before = {name: group.snapshot() for name, group in groups.items()}
        host_pids = {"router": router.process.pid, "line_forwarder": line.forwarder_pid,
                     "clients": os.getpid()}
        host_before = {name: cpu_budget.process_cpu_s(pid) for name, pid in host_pids.items()}
        decode_before, (verdicts_before, retries_before) = (decode_tokens(decoders),
                                                            router_counts(router))
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
        # The line as the prefill sees it, through the run until its copies have landed: what
        # its drops of cache-only copies went by (bytes ahead against its measured rate).
        backlog = LineBacklog(prefill.pdd_state, time.monotonic())
        backlog.start()
        results = agentic.run(system, conversations, spec, router.host, router.port,
                              thread_setup=lambda: in_namespace(ns_a), on_result=on_result,
                              should_abort=should_abort, timeout_s=180.0,
                              headers=router.headers)
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
        host_cpu = {name: _used(host_before[name], cpu_budget.process_cpu_s(pid), duration)
                    for name, pid in host_pids.items()}
        wan_in_run = line_bytes(line)  # the line's load while the requests ran
        for server in (main, *([relay] if relay else [])):  # every decode step counted
            server.wait_idle(60)
        decode_after, (verdicts_after, retries_after) = (decode_tokens(decoders),
                                                          router_counts(router))
        # The copies still on the line when the last answer came (cache-only ones, last in
        # order and in a small window) land before their bytes are read: the setup's WAN bytes
        # are all its requests sent, as the simulator counts them.
        prefill.wait_idle(60)
        line_samples = backlog.stop()
        wan_after, kv_after = line_bytes(line), ledger_main_bytes(prefill)
        classes_after = line_by_class(prefill)
    finally:
        router.stop()
    wan = {k: wan_after[k] - wan_before[k] for k in wan_before}
    in_run = {k: wan_in_run[k] - wan_before[k] for k in wan_before}
    location = "cluster B" if main.netns == line.namespace("b") else "cluster A"
    intake = report.scheduler_intake_from_logs(
        {server.name: server.log_path for server in (prefill, main, *([relay] if relay else []))})
    summary = report.summarize(results, report.prefill_stats_from_log(log_path), wan,
                               kv_after - kv_before, duration, location, line.rate_mbit, intake,
                               wan_in_run=in_run)
    decoded = {name: (None if decode_after[name] is None or decode_before[name] is None
                      else int(decode_after[name] - decode_before[name])) for name in decoders}
    return {**summary, "placement": placement if relay is not None else None, "cpu": cpu,
            "host_cpu": host_cpu,
            "ttft_budget_s": None if budget_s is None else round(budget_s, 4),
            "router_prefill_tokens_per_s": prefill_rate if budget_s is not None else None,
            "decode_tokens": decoded,
            "relay_busy_share": budgets.busy_share(decoded["relay"], decoded["main"]),
            "router_verdicts": budgets.counter_delta(verdicts_before, verdicts_after),
            "router_retries": budgets.counter_delta(retries_before, retries_after),
            "wan_line_by_class": {k: classes_after[k] - classes_before[k] for k in LINE_CLASSES},
            "wan_line_samples": line_samples}


def _used(before: Optional[float], after: Optional[float], wall_s: float) -> Optional[dict]:
    if before is None or after is None:
        return None
    return {"cpu_s": round(after - before, 2), "cores_used": round((after - before) / wall_s, 3)}


def leftovers(line: WanLine, pids: list, groups: dict, report_to=None) -> dict:
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


def cleanup(cluster, line: WanLine, groups: dict) -> None:
    with contextlib.suppress(Exception):
        if cluster is not None:
            cluster.stop()
    with contextlib.suppress(Exception):
        line.stop()
    for group in groups.values():
        with contextlib.suppress(Exception):
            group.remove()
