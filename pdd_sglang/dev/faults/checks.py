"""What the soak checks once its load has drained, and the bar it must clear.

On the live cluster: PDD's per-room state still open (:func:`open_rooms`) and every traceback,
uncaught thread exception and dead Mooncake worker its servers, router and line logged
(:func:`scan_log`). With the cluster stopped: every completed request again on a plain greedy
server, token for token (:func:`check_tokens`). :func:`bar` says what fails a ``soak.json``.
"""

from __future__ import annotations

import contextlib
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Optional

from pdd_sglang.dev.faults.load import Sent
from pdd_sglang.dev.faults.suite import MAX_TOTAL_TOKENS
from pdd_sglang.dev.testing.cluster import Cluster, SGLangServer
from pdd_sglang.dev.testing.pristine import pristine_env, pristine_sglang
from pdd_sglang.dev.testing.tiny_model import WAN_DEMO_MODEL, ensure_tiny_model

LOG_MARKERS = ("Traceback", "Exception in thread", "is dead")
# Tracebacks that are logged by code that goes on, not died of: the log line that prints them ->
# why. Each is listed in soak_detail.json, never counted as a dead thread.
HANDLED = {
    "post-warmup freeze_gc failed": (
        "SGLang's warm-up thread (--skip-server-warmup) asks its own HTTP server to freeze GC, "
        "at times before that server listens; it logs the refusal with its traceback (a "
        "warning) and goes on to 'fired up and ready'. The pristine wheel does the same."),
}
# Requests in flight on the reference: a wide decode batch spreads each step's fixed cost (most of
# a tiny-model step on the CPU) over more answers.
REFERENCE_CLIENTS = 16


def log_paths(cluster: Any) -> dict:
    paths = {s.name: s.log_path for s in cluster.servers}
    paths["router"] = cluster.router.log_path
    paths["wan"] = cluster.prefill.log_dir / "wan.log"  # the line's forwarder
    return paths


def open_rooms(cluster: Any, timeout_s: float = 30.0) -> tuple[dict, str]:
    """Per-room PDD state still open once idle (polled until 0 or ``timeout_s``), and where the
    prefill's figure was read: its ``rooms_open`` (in ``pdd``, or in ``pdd.fanout``) where it
    publishes one, else its WAN line entries with bytes still queued or in flight
    (``pdd.wan_line.*.bytes_ahead``); the relay's pending, active and held-out handoffs and
    main's parked requests (``pdd.handoff``). None: not readable."""
    source = "unread"

    def read() -> dict:
        nonlocal source
        counts: dict = {}
        for server in cluster.servers:
            try:
                pdd = server.pdd_state()
            except Exception:  # noqa: BLE001 - unreadable counts as not drained
                counts[server.name] = None
                continue
            if server.name == "prefill":
                fanout = pdd.get("fanout") or {}
                rooms, source = pdd.get("rooms_open"), "pdd.rooms_open"
                if rooms is None:
                    rooms, source = fanout.get("rooms_open"), "pdd.fanout.rooms_open"
                if rooms is None:
                    source = "pdd.wan_line.*.bytes_ahead (entries not 0)"
                    rooms = sum(1 for line in (pdd.get("wan_line") or {}).values()
                                if line.get("bytes_ahead", 0))
                counts["prefill"] = int(rooms)
            else:
                handoff = pdd.get("handoff") or {}
                counts[server.name] = sum(int(handoff.get(k, 0))
                                          for k in ("pending", "active", "out_of_batch", "parked"))
        return counts

    counts: dict = read()
    deadline = time.monotonic() + timeout_s
    while any(v != 0 for v in counts.values()) and time.monotonic() < deadline:
        time.sleep(1.0)
        counts = read()
    return counts, source


def scan_log(path: Path, offset: int = 0) -> list[dict]:
    """Every traceback, uncaught thread exception and "is dead" line in ``path`` past
    ``offset``: the thread it names (``Exception in thread NAME``, else the text before the
    marker, else the log line that printed the traceback) and the exception it ended with (a
    chained traceback counts once). One that :data:`HANDLED` names carries ``handled``: why."""
    try:
        with open(path, "rb") as log:
            log.seek(offset)
            lines = log.read().decode(errors="replace").splitlines()
    except FileNotFoundError:
        return []
    found, i = [], 0
    while i < len(lines):
        line = lines[i]
        marker = next((m for m in LOG_MARKERS if m in line), None)
        i += 1
        if marker is None:
            continue
        named = re.search(r"Exception in thread (.+?):?\s*$", line)
        before = lines[i - 2].strip() if i >= 2 else ""
        thread = named.group(1) if named else (line.split(marker)[0].strip(" :") or before
                                               or "unnamed")
        error = line.strip()
        if marker != "Traceback" and i < len(lines) and lines[i].startswith("Traceback"):
            i += 1
            marker = "Traceback"
        if marker == "Traceback":
            error, i = _traceback_end(lines, i)
        entry = {"thread": thread[:120], "error": error[:300]}
        entry.update({"handled": why for text, why in HANDLED.items() if text in thread})
        found.append(entry)
    return found


def _traceback_end(lines: list[str], i: int) -> tuple[str, int]:
    """From just past a "Traceback" line: (the exception line, the index after the traceback,
    through any exception chained to it)."""
    error = ""
    while i < len(lines):
        while i < len(lines) and lines[i].startswith((" ", "\t")):
            i += 1
        if i < len(lines):
            error, i = lines[i].strip(), i + 1
        j = i
        while j < len(lines) and not lines[j].strip():
            j += 1
        if j < len(lines) and lines[j].startswith(("During handling of the above exception",
                                                    "The above exception was the direct cause")):
            j += 1
            while j < len(lines) and not lines[j].strip():
                j += 1
            if j < len(lines) and lines[j].startswith("Traceback"):
                i = j + 1
                continue
        break
    return error, i


@contextlib.contextmanager
def reference_server(log_dir: Path, url: Optional[str] = None):
    """A plain greedy server: ``url`` if given, else one started here of the pristine sglang
    wheel (the patched one without a role if the pristine copy cannot be made); (server, kind)."""
    model = ensure_tiny_model(WAN_DEMO_MODEL)
    if url:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        yield SGLangServer("reference", model, log_dir, host=host, port=int(port)), url
        return
    with contextlib.ExitStack() as stack:
        try:
            env, kind = pristine_env(stack.enter_context(pristine_sglang())), "pristine wheel"
        except Exception as err:  # noqa: BLE001 - the patched venv's plain path still answers
            env, kind = {}, f"patched wheel, no role (no pristine copy: {err})"[:300]
        server = SGLangServer("reference", model, log_dir, env=env,
                              max_total_tokens=MAX_TOTAL_TOKENS)
        stack.enter_context(Cluster([server]))
        yield server, kind


def _key(record: Sent) -> tuple:
    return tuple(record.body["input_ids"]), record.body["sampling_params"]["max_new_tokens"]


def check_tokens(records: list[Sent], log_dir: Path, url: Optional[str] = None,
                 progress: Callable[[str], None] = print) -> tuple[list[dict], str]:
    """Every completed request again on the reference; the ones whose tokens differ."""
    done = [r for r in records if r.status == "completed"]
    unique = {_key(r): r.body for r in done}
    with reference_server(log_dir, url) as (reference, kind):
        progress(f"soak: {len(done)} answers ({len(unique)} distinct) against the reference "
                 f"({kind})")

        def ask(body: dict) -> list:
            return reference.post_json("/generate", body, timeout_s=600)["output_ids"]

        with ThreadPoolExecutor(REFERENCE_CLIENTS) as pool:
            answers = dict(zip(unique, pool.map(ask, unique.values())))
    mismatches = []
    for r in done:
        expected, got = answers[_key(r)], r.result.output_ids
        if got != expected:
            first = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b),
                         min(len(got), len(expected)))
            mismatches.append({"prompt_tokens": len(r.body["input_ids"]), "first_diff": first,
                               "outcome": r.result.outcome, "pipeline": r.result.pipeline,
                               "rid": r.result.rid})
    return mismatches, kind


def bar(report: dict) -> list[str]:
    """What fails the soak: anything lost, any mismatch, any leak, any dead thread (and a fault
    after which no request completed)."""
    failures = []
    if not report["completed"]:
        failures.append("no request completed")
    for key in ("lost", "token_mismatches", "digest_mismatches"):
        if report[key]:
            failures.append(f"{key}: {report[key]}")
    for key in ("leaked_slots", "leaked_locks", "leaked_rooms"):
        bad = {k: v for k, v in report[key].items() if v != 0}
        if bad:
            failures.append(f"{key}: {bad}")
    if report["dead_threads"]:
        failures.append(f"dead_threads: {len(report['dead_threads'])}")
    unrecovered = sorted(n for n, times in report["recovery_s"].items() if None in times)
    if unrecovered:  # no request sent after the fault completed: service never came back
        failures.append(f"no recovery after: {unrecovered}")
    return failures
