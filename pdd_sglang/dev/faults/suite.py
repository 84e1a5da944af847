"""Run a steady load through the router on a real P / RLD / MD cluster across the emulated WAN,
inject each fault in turn, and measure what it cost.

Per fault: requests sent, completed, errored (with a reason the client can read) and lost (no
answer within the client's timeout: must be 0); KV slots and tree-locked tokens in use on every
server after the load has drained, against the baseline taken before the fault (must match); and
the recovery time, from the injection to the first completed answer of a request sent after it
(``recovery_s``), and to the first token of one (``first_token_after_s``). One request (the
*probe*) is sent right after the injection, beside the clients' closed loop, whose next request
waits for one of theirs to end; ``first_request_after`` says what it went through and which WAN
bytes (needed-now, cache-only) were ahead of a new copy when it was sent. Beside them,
``line_floor_s``: one request's uncached KV over the line alone, the least a request placed P->MD
can take while no relay is up, whatever the router does.

Topology (as ``make demo``'s PDD setup): prefill, relay, router and clients in cluster A; main in
cluster B, reachable only through the line. Timeouts are the WAN-fitting values in
:data:`SERVER_TIMEOUTS` and :data:`SGLANG_TIMEOUT_ENV`, the ones the README recommends.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from pdd_sglang.dev.faults.faults import Fault, wait_for
from pdd_sglang.dev.faults.load import SteadyLoad, tally
from pdd_sglang.dev.testing.cluster import RELAY_CPU_ARGS, Cluster, free_port
from pdd_sglang.dev.testing.line_backlog import LineBacklog
from pdd_sglang.dev.testing.tiny_model import WAN_DEMO_MODEL, ensure_tiny_model
from pdd_sglang.dev.testing.wan_cluster import NetnsServer, RouterProcess, in_namespace
from pdd_sglang.dev.wan_emulator import WanLine

TRANSPORT = ("--disaggregation-transfer-backend", "mooncake_tcp")
# PDD's own deadlines, per path: seconds, not SGLang's 300 s defaults.
SERVER_TIMEOUTS = {
    "prefill": ("--pdd-relay-bootstrap-timeout", "3", "--pdd-main-bootstrap-timeout", "15",
                "--pdd-wan-transfer-timeout", "10"),
    "relay": (),
    "main": ("--pdd-handoff-timeout", "10"),
}
# SGLang's PD deadlines: a decode server notices a dead prefill by its bootstrap heartbeat, and
# gives up on a request whose KV never comes.
SGLANG_TIMEOUT_ENV = {
    "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2",
    "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "2",
    "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "30",
    "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "30",
}
MAX_TOTAL_TOKENS = 16384


@dataclass
class FaultCluster:
    """The line, the three servers and the router; every piece stopped by :meth:`stop`."""

    line: WanLine
    prefill: NetnsServer
    relay: NetnsServer
    main: NetnsServer
    router: Optional[RouterProcess] = None
    cluster: Optional[Cluster] = None

    @property
    def servers(self) -> list:
        return [self.prefill, self.relay, self.main]

    @classmethod
    def start(cls, log_dir: Path, rate_mbit: float, rtt_ms: float, seed: int = 0,
              extra_args: Optional[dict] = None,
              router_args: Sequence[str] = ()) -> "FaultCluster":
        """``extra_args``: more flags per role (``{"relay": (...)}``), e.g. the soak's;
        ``router_args``: more router flags."""
        extra = extra_args or {}
        line = WanLine(rate_mbit, rtt_ms, 0.0, seed=seed)
        line.start(log_path=str(log_dir / "wan.log"))
        model = ensure_tiny_model(WAN_DEMO_MODEL)
        common = dict(model_path=model, log_dir=log_dir, max_total_tokens=MAX_TOTAL_TOKENS,
                      env=dict(SGLANG_TIMEOUT_ENV))
        bootstrap_port, control_port = free_port(), free_port()

        def server(name: str, side: str, host: str, *args: str) -> NetnsServer:
            return NetnsServer(name, host=host, exec_prefix=tuple(line.exec_prefix(side)),
                               netns=line.namespace(side),
                               extra_args=(*args, *TRANSPORT, *extra.get(name, ())), **common)

        self = cls(
            line=line,
            prefill=server("prefill", "a", line.address("a"), "--pdd-role", "prefill",
                           "--disaggregation-bootstrap-port", str(bootstrap_port),
                           *SERVER_TIMEOUTS["prefill"], *line.prefill_flags()),
            # A fixed control port: a restarted relay is found where it was.
            relay=server("relay", "a", line.address("a"), "--pdd-role", "relay",
                         "--pdd-control-port", str(control_port), *RELAY_CPU_ARGS),
            main=server("main", "b", line.address("b"), "--pdd-role", "main",
                        *SERVER_TIMEOUTS["main"]),
        )
        try:
            self.cluster = Cluster(self.servers).__enter__()
            self.router = RouterProcess(log_dir / "router.log", [
                "--prefill", self.prefill.url, str(bootstrap_port), "--relay", self.relay.url,
                "--main", self.main.url, "--wan-gbps", repr(rate_mbit / 1e3),
                "--wan-rtt-ms", repr(rtt_ms), "--health-interval-s", "1",
                "--health-failures-to-remove", "1", "--read-timeout-s", "60",
                "--retry-after-first-token", *router_args],
                exec_prefix=line.exec_prefix("a"), netns_name=line.namespace("a"))
            self.router.start()
        except BaseException:
            self.stop()
            raise
        return self

    def client(self) -> Callable[[], object]:
        return lambda: in_namespace(self.line.namespace("a"))

    def pools(self) -> dict:
        """Tokens each server holds in KV slots or tree locks once idle (waits up to 60 s)."""
        return {s.name: s.wait_idle(60) for s in self.servers}

    def stop(self) -> None:
        for step in (lambda: self.router and self.router.stop(),
                     lambda: self.cluster and self.cluster.stop(),
                     lambda: [s.stop(grace_s=5.0) for s in self.servers],
                     self.line.stop):
            try:
                step()
            except Exception:  # noqa: BLE001 - every piece gets its chance to stop
                pass


def held_tokens(pools: dict) -> dict:
    return {name: pool["in_use_tokens"] + pool["locked_tokens"] for name, pool in pools.items()}


def run_fault(cluster: FaultCluster, fault: Fault, *, warmup_s: float, after_s: float,
              seed: int, answer_timeout_s: float = 120.0,
              progress: Callable[[str], None] = lambda _: None) -> dict:
    baseline = held_tokens(cluster.pools())
    load = SteadyLoad(cluster.router.host, cluster.router.port, fault.profile, seed=seed,
                      answer_timeout_s=answer_timeout_s, thread_setup=cluster.client(),
                      headers=cluster.router.headers)
    load.start()
    backlog: Optional[LineBacklog] = None
    try:
        time.sleep(warmup_s)
        # Inject while requests are in flight, so the fault catches some mid-way.
        wait_for(lambda: len(load.in_flight()) >= min(2, fault.profile.concurrency), 30)
        progress(f"{fault.name}: injecting ({len(load.in_flight())} requests in flight)")
        injected = time.monotonic()
        backlog = LineBacklog(cluster.prefill.pdd_state, injected)
        backlog.start()
        fault.inject(cluster)
        load.send_probe()
        time.sleep(fault.hold_s)
        progress(f"{fault.name}: recovering")
        fault.recover(cluster)
        recovered_at = time.monotonic()

        def first_good_answer() -> Optional[float]:
            done = [s.ended for s in list(load.sent)
                    if s.started > injected and s.ended is not None and s.status == "completed"]
            return min(done) if done else None

        def first_token_after() -> Optional[float]:
            firsts = [s.started + s.result.ttft_s for s in list(load.sent)
                      if s.started > injected and s.result.ttft_s is not None]
            return min(firsts) if firsts else None

        wait_for(lambda: first_good_answer() is not None, answer_timeout_s)
        time.sleep(after_s)
    finally:
        backlog_samples = backlog.stop() if backlog is not None else []
        progress(f"{fault.name}: draining")
        load.stop()
    good = first_good_answer()
    first_token = first_token_after()
    after = held_tokens(cluster.pools())
    counts = tally(load.sent)
    errors = sorted({s.result.error[:400] for s in load.sent if s.status == "errored"})
    outcomes: dict = {}
    for s in load.sent:
        if s.status == "completed":
            outcomes[s.result.outcome or "unknown"] = outcomes.get(s.result.outcome or "unknown", 0) + 1
    return {
        **counts,
        "leaked_slots": sum(after.values()) - sum(baseline.values()),
        "recovery_s": None if good is None else round(good - injected, 2),
        "first_token_after_s": None if first_token is None else round(first_token - injected, 2),
        "line_floor_s": line_floor_s(cluster.line.rate_mbit, fault.profile.unique_tokens),
        "restart_s": round(recovered_at - injected - fault.hold_s, 2),
        "held_tokens_before": baseline, "held_tokens_after": after,
        "completed_by_outcome": outcomes, "errors": errors[:8],
        "expectation": fault.expectation,
        "profile": {"shared_tokens": fault.profile.shared_tokens,
                    "unique_tokens": fault.profile.unique_tokens,
                    "output_tokens": fault.profile.output_tokens,
                    "concurrency": fault.profile.concurrency},
        "hold_s": fault.hold_s,
        "first_request_after": first_request_after(load.sent, injected, backlog_samples),
        "first_load_request_after": first_request_after(
            [s for s in load.sent if not s.probe], injected, backlog_samples),
        "wan_backlog": backlog_samples,
    }


def first_request_after(sent: list, injected: float, backlog: Sequence[dict] = ()) -> Optional[dict]:
    """The first request sent after the injection that completed: what it went through, and the
    WAN bytes by class ahead of a new copy when it was sent (the backlog sample nearest after)."""
    done = sorted((s for s in sent if s.started > injected and s.status == "completed"),
                  key=lambda s: s.started)
    if not done:
        return None
    first = done[0]
    sent_after = first.started - injected
    at_send = next((b for b in backlog if b.get("t_s") is not None and b["t_s"] >= sent_after
                    and b.get("bytes_ahead") is not None), None)
    return {"sent_after_s": round(sent_after, 2), "probe": first.probe,
            "outcome": first.result.outcome,
            "ttft_s": first.result.ttft_s and round(first.result.ttft_s, 2),
            "answer_s": round(first.ended - first.started, 2),
            "needed_now_bytes_ahead_at_send": at_send and at_send["needed_now_bytes_ahead"],
            "cache_only_bytes_ahead_at_send": at_send and at_send["cache_only_bytes_ahead"]}


def line_floor_s(rate_mbit: float, uncached_tokens: int) -> Optional[float]:
    """Seconds the line needs for ``uncached_tokens`` of the suite model's KV, nothing else on it."""
    if rate_mbit <= 0:
        return None
    return round(uncached_tokens * WAN_DEMO_MODEL.kv_bytes_per_token * 8 / (rate_mbit * 1e6), 2)


def run_suite(faults: Sequence[Fault], log_dir: Path, *, rate_mbit: float, rtt_ms: float,
              warmup_s: float, after_s: float, seed: int = 0,
              progress: Callable[[str], None] = print,
              cluster: Optional[FaultCluster] = None) -> dict:
    """Each fault in turn on ``cluster`` (left running), or on a cluster of its own (stopped)."""
    started = time.monotonic()
    own = cluster is None
    if own:
        progress(f"starting the line ({rate_mbit:g} Mbit/s, RTT {rtt_ms:g} ms) and P, RLD, MD, "
                 f"router (logs: {log_dir})")
        cluster = FaultCluster.start(log_dir, rate_mbit, rtt_ms, seed)
    results: dict[str, Any] = {}
    try:
        for number, fault in enumerate(faults):
            if cluster.router is None or not cluster.router.alive():
                raise RuntimeError(f"the router died before {fault.name}")
            try:
                results[fault.name] = run_fault(cluster, fault, warmup_s=warmup_s,
                                                after_s=after_s, seed=seed * 1000 + number,
                                                progress=progress)
            except Exception as err:  # noqa: BLE001 - one broken fault must not hide the others
                results[fault.name] = {"error": f"{type(err).__name__}: {err}"}
                progress(f"{fault.name}: the suite itself failed: {results[fault.name]['error']}")
                continue
            progress(f"{fault.name}: {_line(results[fault.name])}")
    finally:
        if own:
            cluster.stop()
    return {"faults": results,
            "line": {"rate_mbit": rate_mbit, "rtt_ms": rtt_ms},
            "timeouts": {"servers": {k: list(v) for k, v in SERVER_TIMEOUTS.items()},
                         "sglang_env": SGLANG_TIMEOUT_ENV},
            "duration_s": round(time.monotonic() - started, 1), "logs": str(log_dir)}


def _line(row: dict) -> str:
    return (f"sent {row['sent']}, completed {row['completed']}, errored {row['errored']}, "
            f"lost {row['lost']}, leaked {row['leaked_slots']}, recovery {row['recovery_s']} s "
            f"(first token {row.get('first_token_after_s')} s, line floor {row.get('line_floor_s')} s)")
