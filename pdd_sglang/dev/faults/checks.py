"""What the soak checks once its load has drained, and the bar it must clear.

On the live cluster: PDD's per-room state still open (:func:`open_rooms`) and every traceback,
uncaught thread exception and dead Mooncake worker its servers, router and line logged
(:func:`scan_log`). With the cluster stopped: every completed request again on a plain greedy
server, token for token (:func:`check_tokens`), where an answer may leave the reference's path
only at a near-tie (:func:`judge`). :func:`bar` says what fails a ``soak.json``.
"""

from __future__ import annotations

import contextlib
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
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
# A greedy near-tie, in log-probability (nats): float32 sums run in an order that depends on the
# batch and on where a prompt's prefill was split (chunk boundaries, prefix-cache hits), and PDD's
# prefill chunks and its relay batches differ from the reference's, so where the reference's best
# two tokens lie closer than this either is a correct server's greedy token. Measured on a soak
# answer's output 71 (a 2,248-token prompt): the pristine wheel alone, over 80
# batch compositions and prefill splits of that prompt, put the gap between -1.9e-6 and +6.2e-6
# (the other token won 11 times); the next smallest gap of that answer was 1.6e-4, the smallest of
# 40 other 512-token answers 4.0e-5. SGLang's --enable-deterministic-inference refuses the CPU
# profile's torch_native attention backend.
NEAR_TIE_NATS = 1e-4
# Near-ties one answer may pass before the next divergence counts as a mismatch.
MAX_NEAR_TIES = 4


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


@dataclass(frozen=True)
class Greedy:
    """A reference answer: its tokens and, per token, the log-probabilities of its best two
    (``(token, logprob)`` pairs, best first)."""

    ids: list
    top2: list

    @classmethod
    def of(cls, answer: dict) -> "Greedy":
        tops = answer["meta_info"]["output_top_logprobs"]
        return cls(list(answer["output_ids"]),
                   [tuple((int(t[1]), float(t[0])) for t in top[:2]) for top in tops])

    def gap(self, index: int) -> Optional[float]:
        """Best minus second log-probability at ``index``; None where unknown."""
        if index >= len(self.top2) or len(self.top2[index]) < 2:
            return None
        (_, best), (_, second) = self.top2[index]
        return best - second

    def other(self, index: int) -> Optional[int]:
        """The one of the best two at ``index`` that the reference did not take (at an exact tie
        it may be listed first); None if its own token is not among them."""
        if self.gap(index) is None:
            return None
        tokens = [token for token, _ in self.top2[index]]
        return tokens[1 - tokens.index(self.ids[index])] if self.ids[index] in tokens else None


def _first_diff(got: list, expected: list) -> Optional[int]:
    if got == expected:
        return None
    return next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b),
                min(len(got), len(expected)))


def judge(got: list, body: dict, expected: Greedy,
          ask: Callable[[list, dict], Greedy]) -> tuple[list[dict], Optional[dict]]:
    """``got`` (an answer to ``body``) against the reference's ``expected``: (the near-ties it
    passed, the mismatch or None). Where ``got`` takes the other of the reference's best two
    tokens, within :data:`NEAR_TIE_NATS` of each other, the reference is asked again (``ask``: input IDs and
    sampling params -> :class:`Greedy`) to go on from ``got``'s own tokens up to there, and the
    rest of ``got`` must be that continuation; any other difference is a mismatch, at its index
    with the reference's top-2 gap there."""
    ties: list[dict] = []
    start = 0  # expected answers got[start:]
    while True:
        first = _first_diff(got[start:], expected.ids)
        if first is None:
            return ties, None
        at, gap = start + first, expected.gap(first)
        near = (at < len(got) and gap is not None and gap <= NEAR_TIE_NATS
                and got[at] == expected.other(first))
        if not near or len(ties) == MAX_NEAR_TIES:
            return ties, {"first_diff": at, "reference_gap": gap}
        ties.append({"index": at, "gap": gap, "token": got[at],
                     "reference_token": expected.ids[first]})
        start = at + 1
        remaining = len(expected.ids) - first - 1  # the reference's own length from there
        params = {**body["sampling_params"], "max_new_tokens": remaining}
        expected = (Greedy([], []) if remaining == 0
                    else ask(body["input_ids"] + got[:start], params))


def check_tokens(records: list[Sent], log_dir: Path, url: Optional[str] = None,
                 progress: Callable[[str], None] = print) -> tuple[list[dict], list[dict], str]:
    """Every completed request again on the reference: (the answers that differ, the answers
    that differ only at near-ties (:func:`judge`), the reference's kind)."""
    done = [r for r in records if r.status == "completed"]
    unique = {_key(r): r.body for r in done}
    with reference_server(log_dir, url) as (reference, kind):
        progress(f"soak: {len(done)} answers ({len(unique)} distinct) against the reference "
                 f"({kind})")

        def ask(input_ids: list, sampling_params: dict) -> Greedy:
            body = {"input_ids": input_ids, "sampling_params": sampling_params,
                    "return_logprob": True, "top_logprobs_num": 2}
            return Greedy.of(reference.post_json("/generate", body, timeout_s=600))

        def verdict(record: Sent) -> tuple[list[dict], Optional[dict]]:
            return judge(record.result.output_ids, record.body, answers[_key(record)], ask)

        with ThreadPoolExecutor(REFERENCE_CLIENTS) as pool:
            answers = dict(zip(unique, pool.map(lambda b: ask(b["input_ids"],
                                                              b["sampling_params"]),
                                                unique.values())))
            verdicts = list(pool.map(verdict, done))
    mismatches, near_ties = [], []
    for r, (ties, mismatch) in zip(done, verdicts):
        about = {"prompt_tokens": len(r.body["input_ids"]), "outcome": r.result.outcome,
                 "pipeline": r.result.pipeline, "rid": r.result.rid}
        if mismatch is not None:
            mismatches.append({**mismatch, **about, "near_ties_before": ties})
        elif ties:
            near_ties.append({**about, "ties": ties})
    return mismatches, near_ties, kind


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
