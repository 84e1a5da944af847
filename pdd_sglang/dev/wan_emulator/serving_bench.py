"""Copies to main at a real model's KV size through real servers across the emulated line (issue
50, item 5): the ``serving`` rows of ``scripts/bench_wan_line.py --serving``.

Per point (rate x RTT) a fresh line, tuned as the engine-level rows' (``LONG_FAT_LINE_SYSCTLS``),
and its bulk TCP goodput (:func:`~pdd_sglang.dev.wan_emulator.line_bench.line_goodput`). Per
model (the KV-realistic ``KV_8B_MODEL``, 32 layers, and ``KV_80_LAYER_MODEL``) a PDD prefill in
cluster A, in a cgroup of its own (:class:`~pdd_sglang.dev.cpu_budget.CpuGroup`, no quota: its
whole process tree's CPU), and a PDD main in cluster B. Then, per room size, one copy, measured
from outside the servers:

- the copy: a P->MD request of that many prompt tokens; its time on the line is the span of the
  bytes out of the line at B (the kernel's counter), sampled every ``SAMPLE_S``, over which it
  carried at least a quarter of the line's rate; ``utilization`` is the copy's bytes on the wire
  (the prefill's ledger: fewer than its KV bytes when coded) over that span against the line's
  goodput (``kv_mbit``: its KV bytes over the span), ``reference_utilization`` the stream
  reference's for a copy of its KV bytes
  (:mod:`~pdd_sglang.dev.wan_emulator.stream_reference`, run after the servers stop);
- main's ITL for its other running requests: a P->MD request of a short prompt decodes on main,
  streamed, while the copy crosses and lands; its gaps at the token positions that fell between
  the copy's first byte and main's first token of the copied request, against the gaps at the
  same positions of the same request alone (decode steps grow with the context: the same
  positions compare like with like);
- ``landed_after_last_record_s``: from the line's last byte of the copy to main's first token of
  the copied request, as main streams it (so it holds main's first decode step and the landed
  notice's trip besides the landing);
- staging: main's ``wan_staging`` (``/server_info``) sampled every ``STAGING_SAMPLE_S``: the most
  reserved at once, and the region's size;
- ``cpu_s_per_gb``: the prefill group's CPU for the request with its copy to main, less its CPU
  for a request of the same length that copies nothing (SGLang's fake bootstrap host: the
  forward alone), over the copy's GB.

A copy's mode comes from :func:`pdd_sglang.dev.testing.wan_copies.copies_by_mode`. A field the
servers do not expose is None, with the reason in the result's ``null_reasons``. Needs root
(network namespaces, cgroups).
"""

from __future__ import annotations

import json
import random
import statistics
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from pdd_sglang.dev import cpu_budget
from pdd_sglang.dev.debug_aids.controls import request_kv_hints
from pdd_sglang.dev.testing.cluster import NON_OVERLAP_LOOP_ARGS, Cluster, free_port
from pdd_sglang.dev.testing.pd_client import new_room
from pdd_sglang.dev.testing.tiny_model import KV_8B_MODEL, KV_80_LAYER_MODEL, ensure_tiny_model
from pdd_sglang.dev.testing.wan_cluster import NetnsServer, in_namespace
from pdd_sglang.dev.testing.wan_copies import MODES, copies_by_mode, copy_mode
from pdd_sglang.dev.wan_emulator import WanLine, stream_reference
from pdd_sglang.dev.wan_emulator.line_bench import line_goodput, tune

SERVING_POINTS = ((100.0, 40.0), (200.0, 100.0))
SERVING_COPIES = ((32, 256), (32, 1024), (80, 256))  # (layers, room tokens)
MODELS = {32: KV_8B_MODEL, 80: KV_80_LAYER_MODEL}
FIELDS = ("layers", "tokens", "copy_bytes", "mode", "rate_mbit", "rtt_ms", "utilization",
          "reference_utilization", "main_itl_ratio", "landed_after_last_record_s",
          "last_record_decode_s", "peak_staging_bytes", "staging_bytes", "cpu_s_per_gb")
NULL_REASONS = {
    "last_record_decode_s": "main decodes every record of a room at once, on its scheduler "
                            "thread, when it sees the room landed (decode/wan_staging.py "
                            "MainStaging.land); no record's own decode is timed or exposed",
}
FAKE_BOOTSTRAP_HOST = "2.2.2.2"  # SGLang's: the prefill runs the forward and sends nothing
TRANSPORT = ("--disaggregation-transfer-backend", "mooncake_tcp")
SAMPLE_S = 0.05
STAGING_SAMPLE_S = 0.5
LEAD_S = 1.5  # the background request decodes alone this long before the copy is asked
BACKGROUND_PROMPT = 16
# The background request's most tokens (it stops once the copy landed): enough to decode through
# the slowest copy of the default rows (80 layers x 256 tokens one-sided at 100 x 40: about 40 s
# of main's 0.1 s steps; 32 layers x 1,024 tokens: 35 s of 0.04-0.06 s steps). Main's pool holds
# twice that beside the room: SGLang's decode admits a room only with the running requests'
# remaining tokens reserved (measured: an 80-layer room of 256 tokens waited in pre-allocation
# for 300 s beside a 1,536-token background in a pool of 1,888).
BACKGROUND_TOKENS = 1024
TAIL_S = 0.5  # after main's first token of the copied request, before the background stops


def check_row(row: dict) -> dict:
    """``row`` as the bench writes it: every field, a known mode, numbers or None, and None only
    where ``NULL_REASONS`` or the row's own ``null_reasons`` says why."""
    missing = [name for name in FIELDS if name not in row]
    if missing:
        raise ValueError(f"a serving row lacks {missing}")
    if row["mode"] not in MODES:
        raise ValueError(f"mode {row['mode']!r} is not one of {MODES}")
    reasons = {**NULL_REASONS, **row.get("null_reasons", {})}
    for name in FIELDS:
        value = row[name]
        if name == "mode":
            continue
        if value is None:
            if name not in reasons:
                raise ValueError(f"{name} is None with no reason given")
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{name} must be a number, got {value!r}")
    return row


@dataclass
class Streamed:
    """A streamed request's answer at main: when each event came, with its token count."""

    events: list = field(default_factory=list)  # (monotonic s, completion tokens)
    error: Optional[str] = None

    def first_at(self) -> Optional[float]:
        return self.events[0][0] if self.events else None

    def gaps(self) -> dict:
        """{token position: (seconds since the token before, when it came)} (an event of n
        tokens: each 1/n of its gap)."""
        out = {}
        for (t0, n0), (t1, n1) in zip(self.events, self.events[1:]):
            for k in range(n0 + 1, n1 + 1):
                out[k] = ((t1 - t0) / (n1 - n0), t1)
        return out


def _stream(server: NetnsServer, body: dict, into: Streamed, timeout_s: float) -> None:
    request = urllib.request.Request(server.url + "/generate",
                                     data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with in_namespace(server.netns), urllib.request.urlopen(request,
                                                                timeout=timeout_s) as resp:
            for raw in resp:
                line = raw.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                meta = json.loads(line[5:]).get("meta_info", {})
                into.events.append((time.monotonic(), int(meta.get("completion_tokens", 0))))
    except Exception as err:  # an aborted background request ends here too
        into.error = repr(err)


class PdRequest:
    """One P->MD request: posted to the prefill, streamed from main, each on a thread."""

    def __init__(self, prefill: NetnsServer, main: NetnsServer, bootstrap_port: int,
                 prompt: list, max_new_tokens: int, timeout_s: float = 600.0):
        self.prefill, self.main = prefill, main
        self.rid = f"bench-{uuid.uuid4().hex}"
        self.body = {"input_ids": prompt, "rid": self.rid,
                     "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0,
                                         "ignore_eos": True},
                     "bootstrap_host": prefill.host, "bootstrap_port": bootstrap_port,
                     "bootstrap_room": new_room(),
                     "kv_hints": request_kv_hints("prefill_main")}
        self.streamed = Streamed()
        self.prefill_done_at: Optional[float] = None
        self.prefill_error: Optional[str] = None
        self._threads = [threading.Thread(target=self._post_prefill, args=(timeout_s,)),
                         threading.Thread(target=_stream,
                                          args=(main, self.body, self.streamed, timeout_s))]

    def _post_prefill(self, timeout_s: float) -> None:
        try:
            self.prefill.post_json("/generate", self.body, timeout_s)
        except Exception as err:
            self.prefill_error = repr(err)
        self.prefill_done_at = time.monotonic()

    def start(self) -> "PdRequest":
        for thread in self._threads:
            thread.start()
        return self

    def abort(self) -> None:
        for server in (self.main, self.prefill):
            try:
                server.post_json("/abort_request", {"rid": self.rid}, 30)
            except Exception:
                pass  # finished there already

    def join(self, timeout_s: float = 600.0) -> "PdRequest":
        for thread in self._threads:
            thread.join(timeout_s)
        return self


def _prompt(rng: random.Random, tokens: int) -> list:
    return [rng.randrange(10, 1000) for _ in range(tokens)]


class Sampler:
    """Samples, on its own threads, the line's bytes out at B (every ``SAMPLE_S``) and main's
    staging region (every ``STAGING_SAMPLE_S``) until stopped."""

    def __init__(self, line: WanLine, main: NetnsServer):
        self.line, self.main = line, main
        self.bytes: list = []  # (monotonic s, bytes out of the line at B)
        self.staging: list = []  # main's wan_staging states
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._line), threading.Thread(target=self._main)]

    def _line(self) -> None:
        while not self._stop.is_set():
            self.bytes.append((time.monotonic(), self.line.counters("b")["rx_bytes"]))
            self._stop.wait(SAMPLE_S)

    def _main(self) -> None:
        while not self._stop.is_set():
            try:
                self.staging.append(self.main.pdd_state().get("wan_staging") or {})
            except OSError:
                pass
            self._stop.wait(STAGING_SAMPLE_S)

    def __enter__(self) -> "Sampler":
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)

    def on_line(self, rate_mbit: float) -> tuple[float, float]:
        """(first, last) time of the span over which the line carried at least a quarter of its
        rate: the copy's time on it (the background request's tokens do not cross the line)."""
        floor = 0.25 * rate_mbit * 1e6 / 8
        busy = [(a[0], b[0]) for a, b in zip(self.bytes, self.bytes[1:])
                if (b[1] - a[1]) / max(b[0] - a[0], 1e-9) >= floor]
        if not busy:
            raise RuntimeError("the copy never crossed the line at a quarter of its rate")
        return busy[0][0], busy[-1][1]


def itl_ratio(alone: Streamed, beside: Streamed, start: float, end: float) -> tuple:
    """(mean ratio, max ratio, positions): the background's gaps at the positions that ended in
    [start, end] while a copy crossed and landed, against the same positions of it alone."""
    ref = {k: gap for k, (gap, _) in alone.gaps().items()}
    gaps = {k: gap for k, (gap, at) in beside.gaps().items() if k in ref and start <= at <= end}
    if not gaps:
        return None, None, 0
    mean = sum(gaps.values()) / sum(ref[k] for k in gaps)
    return mean, max(gaps.values()) / max(ref[k] for k in gaps), len(gaps)


@dataclass
class Pair:
    """A prefill in A (in its own cgroup) and a main in B on one model, across ``line``."""

    line: WanLine
    layers: int
    prefill: NetnsServer
    main: NetnsServer
    group: cpu_budget.CpuGroup
    bootstrap_port: int
    rng: random.Random
    step_s: float = 0.05  # main's decode step, alone, measured in warm-up

    def cpu_s(self) -> float:
        return self.group.snapshot().cpu_s


def start_pair(line: WanLine, layers: int, max_tokens: int, log_dir: Path, codec: str,
               background: int, staging_mb: Optional[float] = None) -> Pair:
    """``staging_mb``: main's ``--pdd-wan-staging-mb`` (None: its default)."""
    model = ensure_tiny_model(MODELS[layers])
    group = cpu_budget.CpuGroup(f"pdd-serving-bench-{layers}l", 2.0).create()
    port = free_port()
    common = dict(model_path=model, log_dir=log_dir / f"{layers}l", fork_children=True)
    prefill = NetnsServer("prefill", host=line.address("a"), netns=line.namespace("a"),
                          exec_prefix=(*group.exec_prefix(), *line.exec_prefix("a")),
                          max_total_tokens=max_tokens + BACKGROUND_PROMPT + 64, extra_args=(
                              "--pdd-role", "prefill", "--disaggregation-bootstrap-port",
                              str(port), "--pdd-wan-kv-codec", codec, *line.prefill_flags(),
                              *TRANSPORT, *NON_OVERLAP_LOOP_ARGS), **common)
    staging = () if staging_mb is None else ("--pdd-wan-staging-mb", f"{staging_mb:g}")
    main = NetnsServer("main", host=line.address("b"), netns=line.namespace("b"),
                       exec_prefix=tuple(line.exec_prefix("b")),
                       max_total_tokens=max_tokens + 2 * background + 2 * BACKGROUND_PROMPT + 128,
                       extra_args=("--pdd-role", "main", *TRANSPORT, *staging), **common)
    try:
        Cluster([prefill, main]).__enter__()
    except BaseException:
        group.remove()
        raise
    return Pair(line, layers, prefill, main, group, port, random.Random(layers))


def stop_pair(pair: Pair) -> None:
    try:
        Cluster([pair.prefill, pair.main]).stop()
    finally:
        pair.group.remove()


def warm(pair: Pair, tokens: int) -> None:
    """A copy of ``tokens`` (sessions, connections, the lanes' congestion windows, as a serving
    prefill's are), then main's decode step alone."""
    PdRequest(pair.prefill, pair.main, pair.bootstrap_port, _prompt(pair.rng, tokens),
              2).start().join()
    probe = PdRequest(pair.prefill, pair.main, pair.bootstrap_port,
                      _prompt(pair.rng, BACKGROUND_PROMPT), 40).start().join()
    gaps = sorted(gap for gap, _ in probe.streamed.gaps().values())
    pair.step_s = gaps[len(gaps) // 2] if gaps else pair.step_s
    for server in (pair.prefill, pair.main):
        server.wait_idle(120)


def _forward_alone(pair: Pair, tokens: int) -> None:
    """The prefill's forward of a fresh prompt of ``tokens``, sending nothing (fake bootstrap)."""
    pair.prefill.post_json("/generate", {
        "input_ids": _prompt(pair.rng, tokens), "bootstrap_host": FAKE_BOOTSTRAP_HOST,
        "bootstrap_room": new_room(), "bootstrap_port": pair.bootstrap_port,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}, 600)


def _background_pair(pair: Pair, tokens: int) -> PdRequest:
    return PdRequest(pair.prefill, pair.main, pair.bootstrap_port,
                     _prompt(pair.rng, BACKGROUND_PROMPT), tokens).start()


def _wait_first_token(request: PdRequest, timeout_s: float) -> float:
    deadline = time.monotonic() + timeout_s
    while request.streamed.first_at() is None:
        if time.monotonic() > deadline or request.streamed.error or request.prefill_error:
            raise RuntimeError(f"no first token from main: {request.streamed.error} "
                               f"{request.prefill_error}")
        time.sleep(0.01)
    return request.streamed.first_at()


def _wire_bytes(prefill: NetnsServer, room: int) -> int:
    """What the room's copy to main took on the wire (the prefill's transfer ledger: its KV
    bytes raw, its records' bytes packed or coded)."""
    rows = prefill.pdd_state()["transfers"]["by_request"]
    return sum(r["wire_bytes"] for r in rows if r["room"] == room and r["role"] == "main")


def measure_copy(pair: Pair, tokens: int, background: int) -> dict:
    """One copy of ``tokens`` with a background request (of at most ``background`` tokens)
    decoding on main (see the module docstring); the row's measured fields, less the
    reference's."""
    kv_bytes = tokens * MODELS[pair.layers].kv_bytes_per_token
    cpu_before = pair.cpu_s()
    _forward_alone(pair, tokens)
    cpu_forward = pair.cpu_s() - cpu_before
    for server in (pair.prefill, pair.main):
        server.wait_idle(120)
    beside = _background_pair(pair, background)
    _wait_first_token(beside, 120)
    time.sleep(LEAD_S)
    before = copies_by_mode(pair.prefill)  # the background's own copy has landed
    with Sampler(pair.line, pair.main) as sampled:
        cpu_before = pair.cpu_s()
        copy = PdRequest(pair.prefill, pair.main, pair.bootstrap_port,
                         _prompt(pair.rng, tokens), 2).start()
        landed_at = _wait_first_token(copy, 600)
        copy.join()
        cpu_copy = pair.cpu_s() - cpu_before
        mode = copy_mode(before, copies_by_mode(pair.prefill))
        wire_bytes = _wire_bytes(pair.prefill, copy.body["bootstrap_room"])
        time.sleep(TAIL_S)
    beside.abort()
    beside.join()
    reached = beside.streamed.events[-1][1] if beside.streamed.events else 0
    pair.main.wait_idle(120)
    # the same positions with no copy: the background alone, as far as it went beside the copy
    alone = _background_pair(pair, max(reached, 2)).join()
    first, last = sampled.on_line(pair.line.rate_mbit)
    mean, peak, positions = itl_ratio(alone.streamed, beside.streamed, first, landed_at)
    covered = beside.streamed.events and beside.streamed.events[-1][0] >= landed_at
    staging = [s for s in sampled.staging if s]
    row = {"layers": pair.layers, "tokens": tokens, "copy_bytes": kv_bytes,
           "mode": mode,
           "on_line_s": round(last - first, 3), "wire_bytes": wire_bytes,
           "achieved_mbit": wire_bytes * 8 / (last - first) / 1e6,
           "kv_mbit": kv_bytes * 8 / (last - first) / 1e6,
           "main_itl_ratio": mean if covered else None, "main_itl_max_ratio": peak,
           "main_itl_positions": positions, "main_step_alone_s": pair.step_s,
           "landed_after_last_record_s": round(landed_at - last, 3),
           "last_record_decode_s": None,
           "peak_staging_bytes": max((s.get("in_use_bytes", 0) for s in staging), default=None),
           "staging_bytes": staging[0].get("bytes") if staging else None,
           "staging_samples": len(staging),
           "cpu_s_per_gb": (cpu_copy - cpu_forward) / (kv_bytes / 1e9),
           "prefill_cpu_s": {"with_copy": round(cpu_copy, 3), "forward_alone": round(cpu_forward, 3)},
           "null_reasons": {}}
    if not covered:
        row["null_reasons"]["main_itl_ratio"] = (
            f"the background request ({background} tokens) ended before the copy landed")
    if not staging:
        row["null_reasons"].update({k: "main's wan_staging state was not read (no staging "
                                       "region: --pdd-wan-staging-mb 0?)"
                                    for k in ("peak_staging_bytes", "staging_bytes")})
    if copy.prefill_error or copy.streamed.error:
        raise RuntimeError(f"the copy failed: {copy.prefill_error} {copy.streamed.error}")
    for server in (pair.prefill, pair.main):
        server.wait_idle(120)
    return row


def run_point(rate_mbit: float, rtt_ms: float, copies: tuple, out: Path, sysctls: dict,
              codec: str = "auto", reference_copies: int = 1,
              staging_mb: Optional[float] = None, log: Callable[[str], None] = print) -> list:
    """Every copy of ``copies`` ((layers, tokens), ...) across one fresh line; their rows."""
    line = WanLine(rate_mbit, rtt_ms, 0.0, seed=5)
    tag = f"{rate_mbit:g}mbit_{rtt_ms:g}ms"
    rows: list = []
    out.mkdir(parents=True, exist_ok=True)
    try:
        line.start(log_path=str(out / f"serving_{tag}_line.log"))
        tune(line, sysctls)
        goodput = line_goodput(line, rtt_ms)
        log(f"== {rate_mbit:g} Mbit/s x {rtt_ms:g} ms: the line's goodput {goodput:.1f} Mbit/s")
        for layers in sorted({layers for layers, _ in copies}):
            rooms = [tokens for each_layers, tokens in copies if each_layers == layers]
            cap = BACKGROUND_TOKENS
            pair = start_pair(line, layers, max(rooms), out / tag, codec, cap, staging_mb)
            try:
                warm(pair, min(rooms))
                for tokens in rooms:
                    row = measure_copy(pair, tokens, cap)
                    row.update(rate_mbit=rate_mbit, rtt_ms=rtt_ms, line_goodput_mbit=goodput,
                               utilization=row["achieved_mbit"] / goodput)
                    log(f"  {layers} layers, {tokens} tokens: {row['mode']}, "
                        f"{row['achieved_mbit']:.1f} Mbit/s ({row['utilization']:.2f}), "
                        f"ITL x{row['main_itl_ratio'] or float('nan'):.2f}")
                    rows.append(row)
            finally:
                stop_pair(pair)
        for row in rows:  # the servers are stopped: the reference has the line to itself
            seconds = stream_reference.measure(line, row["copy_bytes"], reference_copies, 1, out,
                                               f"serving_{tag}_{row['layers']}l_{row['tokens']}")
            stream_s = statistics.median(seconds)
            row["stream_reference_mbit"] = row["copy_bytes"] * 8 / stream_s / 1e6
            row["reference_utilization"] = row["stream_reference_mbit"] / goodput
            check_row(row)
    finally:
        line.stop()
    return rows
