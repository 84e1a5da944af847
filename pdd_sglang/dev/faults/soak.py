"""The chaos soak: continuous multi-turn load through the PDD router for some minutes while seeded
random faults strike one at a time; afterwards every completed answer is checked token for token
against a plain SGLang server, and nothing may be lost, leaked or dead.

Topology: the fault suite's (:class:`~pdd_sglang.dev.faults.suite.FaultCluster`): prefill,
relay, router and clients in cluster A, main in cluster B behind the emulated WAN line, with
:data:`SERVER_ARGS` on top: relay and main check main's WAN copy of each prompt against the
relay's (``--pdd-enable-kv-digest``; a mismatch is counted by the relay), and prefill chunks
prompts longer than :data:`CHUNK_TOKENS`. (``--pdd-debug-kv-digest`` stays off: it keeps every
room's per-token fingerprints in ``/server_info``, which the leak checks poll; it grows without
bound over a soak.)

Load (:class:`MultiTurnLoad`, a :class:`SteadyLoad`): each client holds one conversation at a
time: a shared system prompt and a task, then turns that re-send the whole history plus a short
tool result or, now and then, a long document, with answers of 96-768 tokens (greedy, EOS
ignored, so every answer has its exact length). A failed turn ends its conversation.

Faults (:data:`faults.SOAK`): a seeded shuffled deck (every kind once before any twice), one at a
time: wait for requests in flight (and up to 30 s for the moment the fault needs, e.g. a copy on
the WAN path), inject, hold, recover, wait for the first completed answer of a request sent after
the injection (``recovery_s``), then a seeded quiet gap. The long-prompt burst's requests
count with the load's; hang-up clients' requests are abandoned on purpose and only counted
(``soak_detail.json``).

After the load drains (``checks.py``): KV slots and tree-locked tokens per server against the
baseline taken before it, PDD rooms and handoff entries still open, tracebacks and dead threads
in every log since the start; then, with the cluster stopped, every completed request once more
on a plain server (the pristine wheel's, else the patched one without a role) and the answers
compared: an answer that leaves the plain server's only where its best two tokens are a
float32 rounding apart and goes on as the plain server does from there counts as a near-tie,
listed, not as a mismatch (``checks.judge``). :func:`run_soak` returns ``soak.json``'s figures;
``checks.bar`` says what fails.

Threads: the calling thread owns the cluster, the fault schedule, the counter samples, the drain
and every measurement. Each load client thread (``fault-load-N``) owns its conversation and
appends its requests to the load's list under the load's lock; it alone writes its records. A
fault's own threads (hang-up clients, the burst's load) live from its ``inject`` to its
``recover``, which joins them. The reference check's pool threads run after the cluster stopped,
one request each, and only read the records.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import signal
import time
from pathlib import Path
from typing import Any, Callable, Optional

from pdd_sglang.dev.faults import faults as fault_kinds
from pdd_sglang.dev.faults.checks import (NEAR_TIE_NATS, check_tokens, log_paths, open_rooms,
                                          scan_log)
from pdd_sglang.dev.faults.faults import wait_for
from pdd_sglang.dev.faults.load import LoadProfile, Sent, SteadyLoad, tally
from pdd_sglang.dev.faults.suite import FaultCluster

CHUNK_TOKENS = 512
# Every request placed P->RLD->MD while the relay is up (the router's P->MD shortcut for copies
# predicted under --hide-wan-below-s is off), so the handoff, the path a fault can catch half-way,
# is in play on every turn whose answer outlasts main's copy (issue 34: a quarter at least).
ROUTER_ARGS = ("--hide-wan-below-s", "0")
SERVER_ARGS = {"prefill": ("--chunked-prefill-size", str(CHUNK_TOKENS)),
               "relay": ("--pdd-enable-kv-digest",), "main": ("--pdd-enable-kv-digest",)}
PROFILE = LoadProfile(shared_tokens=512, unique_tokens=0, output_tokens=0, concurrency=3)
MAX_TURNS = 5
# Answers long enough that main's copy of the turn may land while the relay still decodes (issue
# 34: the handoff must be exercised under faults). Measured on the 20 Mbit/s line, 10 minutes:
# answers of 16-160 tokens handed off 8 of 990, of 32-320 tokens 14 of 185, of 48-512 tokens 4 of
# 115 (the relay decodes a 512-token answer in about 3 s, main's copy of a 2,000-token history
# takes 6 s unless main has cached it) and made the reference check slower. With the router
# placing every turn on the relay (ROUTER_ARGS) on a 100 Mbit/s line, 32-320 tokens handed off
# 31 of 215 (14 %): the relay still answered most turns before main's copy landed, hence
# 96-768.
OUTPUT_TOKENS = (96, 320, 512, 768)
# The KV digest's counters in /server_info's pdd.handoff: name -> (server, group, key).
COUNTERS = {"verified": ("relay", "events", "kv_digest_verified"),
            "mismatch": ("relay", "refused", "kv_digest_mismatch"),
            "main_refused": ("main", "events", "relay_refused_kv_digest_mismatch")}


class MultiTurnLoad(SteadyLoad):
    """Conversations instead of independent requests; ``profile.shared_tokens`` of system prompt."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._history: dict[int, tuple[list, int]] = {}  # client -> (history, next turn)

    def _next_body(self, index: int) -> tuple[int, dict]:
        with self._lock:
            number = self._count
            self._count += 1
        rng = random.Random(f"{self.seed}-turn-{number}")
        words = lambda n: [rng.randrange(10, 1000) for _ in range(n)]  # noqa: E731
        history, turn = self._history.pop(index, (None, 0))
        if history is None or turn >= MAX_TURNS:
            history, turn = self._prefix + words(rng.randint(64, 192)), 0
        elif rng.random() < 0.15:
            history = history + words(rng.randint(500, 900))  # a document: a low-hit turn
        else:
            history = history + words(rng.randint(24, 96))
        self._history[index] = (history, turn)
        return number, {"input_ids": history,
                        "sampling_params": {"max_new_tokens": rng.choice(OUTPUT_TOKENS),
                                            "temperature": 0.0, "ignore_eos": True}}

    def _finished(self, index: int, record: Sent) -> None:
        history, turn = self._history.pop(index)
        if record.status == "completed":
            self._history[index] = (history + record.result.output_ids, turn + 1)


class CounterSum:
    """A server counter summed over its restarts: a value below the last one seen is a new
    process, which counts from zero (what it counted between the last sample and its death is
    lost, so samples are taken before every injection)."""

    def __init__(self) -> None:
        self.base, self.last = 0, 0

    def restarted(self) -> None:
        """The soak restarted the server: its next value counts from zero."""
        self.base, self.last = self.base + self.last, 0

    def see(self, value: int) -> None:
        if value < self.last:
            self.base += self.last
        self.last = value

    @property
    def total(self) -> int:
        return self.base + self.last


class Soak:
    def __init__(self, cluster: FaultCluster, minutes: float, seed: int,
                 progress: Callable[[str], None] = print, answer_timeout_s: float = 120.0):
        self.cluster, self.minutes, self.seed = cluster, minutes, seed
        self.progress, self.answer_timeout_s = progress, answer_timeout_s
        self.rng = random.Random(seed)
        self.records: list[Sent] = []  # the bursts' (the load's are in self.load.sent)
        self.timeline: list[dict] = []
        self.abandoned = 0
        self.counters = {key: CounterSum() for key in COUNTERS}

    # ---- sampling -----------------------------------------------------------------------
    def sample_counters(self) -> None:
        for key, (server, group, name) in COUNTERS.items():
            with contextlib.suppress(Exception):  # a server down or restarting: next time
                handoff = getattr(self.cluster, server).pdd_state()["handoff"]
                self.counters[key].see(int(handoff[group].get(name, 0)))

    def pause(self, seconds: float) -> None:
        end = min(time.monotonic() + seconds, self.deadline)
        while time.monotonic() < end:
            self.sample_counters()
            time.sleep(max(0.0, min(3.0, end - time.monotonic())))

    # ---- the run ------------------------------------------------------------------------
    def run(self) -> None:
        cluster = self.cluster
        self.baseline = cluster.pools()
        self.log_offsets = {name: path.stat().st_size if path.exists() else 0
                            for name, path in log_paths(cluster).items()}
        self.sample_counters()
        self.load = MultiTurnLoad(cluster.router.host, cluster.router.port, PROFILE, seed=self.seed,
                                  answer_timeout_s=self.answer_timeout_s,
                                  thread_setup=cluster.client(), headers=cluster.router.headers)
        self.started = time.monotonic()
        self.deadline = self.started + self.minutes * 60
        deck: list = []
        self.load.start()
        try:
            self.pause(10.0)  # warm-up: conversations under way
            while time.monotonic() < self.deadline:
                if not cluster.router.alive():
                    self.progress("soak: the router died; no more faults")
                    break
                if not deck:
                    deck = list(fault_kinds.SOAK)
                    self.rng.shuffle(deck)
                fault = deck.pop()
                try:
                    self.strike(fault)
                except Exception as err:  # noqa: BLE001 - it ends the faults, not the report
                    now = round(self.elapsed(), 1)
                    self.timeline.append({"fault": fault.name, "at_s": now, "until_s": now,
                                          "recovery_s": None,
                                          "error": f"{type(err).__name__}: {err}"[:800]})
                    self.progress(f"soak: {fault.name} failed ({self.timeline[-1]['error']}); "
                                  f"no more faults")
                    self.release()
                    break
                self.pause(self.rng.uniform(5.0, 15.0))
        finally:
            self.progress("soak: draining")
            self.load.stop()
        self.ended = time.monotonic()

    def strike(self, template: Any) -> None:
        fault = (dataclasses.replace(template, seed=self.rng.randrange(1 << 30))
                 if hasattr(template, "seed") else template)
        wait_for(lambda: len(self.load.in_flight()) >= 1, 30)
        ready = wait_for(lambda: _quietly(fault.ready, self.cluster, False), 30)
        self.sample_counters()  # before a server's counters die with it
        failed_before = _failed_batches(self.cluster)
        in_flight = len(self.load.in_flight())
        self.progress(f"soak {self.elapsed():.0f} s: {fault.name} ({in_flight} in flight)")
        injected = time.monotonic()
        fault.inject(self.cluster)
        time.sleep(fault.hold_s)
        fault.recover(self.cluster)
        recovered = time.monotonic()
        if isinstance(fault, fault_kinds.ServerDies):
            for key, (server, _, _) in COUNTERS.items():
                if server == fault.role:
                    self.counters[key].restarted()
        self.records += getattr(getattr(fault, "load", None), "sent", [])
        self.abandoned += getattr(fault, "abandoned", 0)

        def first_good() -> Optional[float]:
            done = [s.ended for s in list(self.load.sent) if s.started > injected
                    and s.ended is not None and s.status == "completed"]
            return min(done) if done else None

        wait_for(lambda: first_good() is not None, self.answer_timeout_s)
        good = first_good()
        first_tokens = [s.started + s.result.ttft_s for s in list(self.load.sent)
                        if s.started > injected and s.result.ttft_s is not None]
        self.timeline.append({
            "fault": fault.name, "at_s": round(injected - self.started, 1),
            "in_flight": in_flight, "ready": ready, "hold_s": fault.hold_s,
            "wan_batches_failed": max(0, _failed_batches(self.cluster) - failed_before),
            "recover_s": round(recovered - injected - fault.hold_s, 1),
            "recovery_s": None if good is None else round(good - injected, 2),
            "first_token_after_s": round(min(first_tokens) - injected, 2) if first_tokens else None,
            "until_s": round(time.monotonic() - self.started, 1)})
        self.progress(f"soak: {fault.name} recovered in {self.timeline[-1]['recovery_s']} s")

    def release(self) -> None:
        """After a fault that failed half-way: nothing stays stopped (SIGCONT to the line and to
        every server's group; a no-op where nothing was stopped)."""
        pids = [self.cluster.line.forwarder_pid] + [s.process.pid for s in self.cluster.servers
                                                    if s.process is not None]
        for index, pid in enumerate(pids):
            with contextlib.suppress(Exception):
                (os.kill if index == 0 else os.killpg)(pid, signal.SIGCONT)

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def all_records(self) -> list[Sent]:
        return list(self.load.sent) + self.records

    def during(self, record: Sent) -> Optional[str]:
        for row in self.timeline:
            start, end = self.started + row["at_s"], self.started + row["until_s"]
            if record.started <= end and (record.ended or record.started) >= start:
                return row["fault"]
        return None

    # ---- after the drain (cluster still up) ---------------------------------------------
    def measure(self) -> dict:
        cluster = self.cluster
        after = cluster.pools()
        self.sample_counters()
        dead = [{"server": name, "thread": "process", "error": "not running after the soak"}
                for name, server in [*((s.name, s) for s in cluster.servers),
                                     ("router", cluster.router)] if not server.alive()]
        handled = []
        for name, path in log_paths(cluster).items():
            for found in scan_log(path, self.log_offsets.get(name, 0)):
                (handled if "handled" in found else dead).append({"server": name, **found})
        rooms, rooms_source = open_rooms(cluster)
        return {
            "leaked_slots": {n: after[n]["in_use_tokens"] - self.baseline[n]["in_use_tokens"]
                             for n in after},
            "leaked_locks": {n: after[n]["locked_tokens"] - self.baseline[n]["locked_tokens"]
                             for n in after},
            "rooms": rooms, "rooms_source": rooms_source, "dead_threads": dead,
            "handled": handled, "prefill_after": _quietly(_prefill_view, cluster, None),
            "pools_before": self.baseline, "pools_after": after,
        }


def _quietly(call: Callable, cluster: FaultCluster, default: Any) -> Any:
    try:
        return call(cluster)
    except Exception:  # noqa: BLE001 - a server restarting: the default
        return default


def _prefill_view(cluster: FaultCluster) -> dict:
    pdd = cluster.prefill.pdd_state()
    return {key: pdd.get(key) for key in ("wan_line", "fanout")}


def _failed_batches(cluster: FaultCluster) -> int:
    """WAN batches to main the prefill has failed so far (its ``wan_line.*.failed_batches``)."""
    lines = _quietly(fault_kinds.wan_line, cluster, {})
    return sum(line.get("failed_batches", 0) for line in lines.values())


def run_soak(log_dir: Path, *, minutes: float, seed: int, rate_mbit: float, rtt_ms: float,
             reference_url: Optional[str] = None,
             before: Optional[Callable[[FaultCluster], None]] = None,
             progress: Callable[[str], None] = print) -> tuple[dict, dict]:
    """Start the cluster, run ``before(cluster)`` (e.g. the quick fault suite), soak, stop, check
    the tokens: (``soak.json``'s report, the details behind it)."""
    progress(f"soak: starting the line ({rate_mbit:g} Mbit/s, RTT {rtt_ms:g} ms) and P, RLD, MD, "
             f"router (logs: {log_dir})")
    cluster = FaultCluster.start(log_dir, rate_mbit, rtt_ms, seed, extra_args=SERVER_ARGS,
                                 router_args=ROUTER_ARGS)
    try:
        if before is not None:
            before(cluster)
        soak = Soak(cluster, minutes, seed, progress)
        soak.run()
        measured = soak.measure()
    finally:
        cluster.stop()
    records = soak.all_records()
    mismatches, near_ties, reference = check_tokens(records, log_dir, reference_url, progress)
    counts = tally(records)
    recovery: dict = {}
    for row in soak.timeline:
        recovery.setdefault(row["fault"], []).append(row["recovery_s"])
    report = {
        "requests": counts["sent"], "completed": counts["completed"], "lost": counts["lost"],
        "errored": counts["errored"],
        "errors": [{"reason": r.result.error, "at_s": round(r.started - soak.started, 1),
                    "during": soak.during(r), "prompt_tokens": len(r.body["input_ids"])}
                   for r in records if r.status == "errored"],
        "token_mismatches": len(mismatches), "token_near_ties": len(near_ties),
        "digest_mismatches": soak.counters["mismatch"].total,
        "leaked_slots": measured["leaked_slots"], "leaked_locks": measured["leaked_locks"],
        "leaked_rooms": measured["rooms"], "dead_threads": measured["dead_threads"],
        "faults": {name: len(times) for name, times in recovery.items()},
        "recovery_s": recovery, "minutes": minutes, "seed": seed,
        "completed_by_outcome": _by_outcome(records),
        "handoff_share": _handoff_share(records),
        "line": {"rate_mbit": rate_mbit, "rtt_ms": rtt_ms},
    }
    detail = {
        "logs": str(log_dir), "load_s": round(soak.ended - soak.started, 1),
        "reference": reference, "timeline": soak.timeline, "token_mismatches": mismatches,
        "token_near_ties": near_ties, "near_tie_nats": NEAR_TIE_NATS,
        "lost": [{"at_s": round(r.started - soak.started, 1), "during": soak.during(r),
                  "reason": r.result.error} for r in records if r.status == "lost"],
        "abandoned_by_hang_up_clients": soak.abandoned,
        "kv_digests_verified": soak.counters["verified"].total,
        "main_dropped_copies_on_digest_mismatch": soak.counters["main_refused"].total,
        "completed_by_outcome": _by_outcome(records),
        "pools_before": measured["pools_before"], "pools_after": measured["pools_after"],
        "prefill_rooms_read_from": measured["rooms_source"],
        "logged_tracebacks_not_counted": measured["handled"],
        "prefill_wan_line_and_fanout_after": measured["prefill_after"],
        "server_args": {k: list(v) for k, v in SERVER_ARGS.items()},
        "router_args": list(ROUTER_ARGS),
    }
    return report, detail


def _handoff_share(records: list[Sent]) -> Optional[float]:
    """Completed requests that handed off from the relay to main, over all completed."""
    outcomes = _by_outcome(records)
    completed = sum(outcomes.values())
    handoffs = sum(n for outcome, n in outcomes.items() if outcome.startswith("handoff"))
    return round(handoffs / completed, 3) if completed else None


def _by_outcome(records: list[Sent]) -> dict:
    out: dict = {}
    for r in records:
        if r.status == "completed":
            key = r.result.outcome or "unknown"
            out[key] = out.get(key, 0) + 1
    return out
