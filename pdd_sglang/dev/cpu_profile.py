"""The CPU demo's microbenchmarks for scripts/profile_cpu.py (issue 25): one SGLang server under
the demo's cgroup quota (prefill, decode, streamed bytes), two servers side by side (the
slowdown a busy neighbour causes), and the emulated line (goodput, round trips, Mooncake writes).

Life cycle of a run (scripts/profile_cpu.py): 1. ``profile_server`` starts one server in its
own CPU group, sets the quota once it is ready, measures, stops it and removes the group on
every exit path; 2. ``profile_interference`` does the same with two servers; 3. ``profile_line``
starts a WanLine, measures, stops it, then runs handoff_bench's Mooncake peers across a fresh
line; 4. ``fit_server`` turns the points into the profile's coefficients.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import threading
import time
from pathlib import Path

from pdd_sglang.dev import cpu_budget
from pdd_sglang.dev.testing import agentic
from pdd_sglang.dev.testing.cluster import NON_OVERLAP_LOOP_ARGS, SGLangServer
from pdd_sglang.dev.testing.tiny_model import WAN_DEMO_MODEL, ensure_tiny_model

DEMO_RATE_MBIT, DEMO_RTT_MS, DEMO_JITTER_MS = 10.0, 40.0, 4.0   # scripts/demo.py's line
SERVERS_AT_ONCE = 3                                             # scripts/demo.py
VOCAB = 1000
PLANS = {  # (fresh tokens N, cached prefix C, batch B) and (batch B, context L)
    # Up to the contexts the demo reaches (a conversation grows to about 3,700 tokens), so that
    # the fits interpolate the demo's forwards and steps rather than extrapolate them.
    "full": {"prefill": [(16, 0, 1), (256, 0, 1), (1024, 0, 1), (2048, 0, 1), (256, 1024, 1),
                         (64, 2048, 1), (128, 3072, 1), (64, 3584, 1), (256, 0, 4), (512, 0, 2)],
             "decode": [(1, 256), (1, 2048), (2, 1024), (4, 256), (4, 2048), (4, 3072),
                        (2, 3584)],
             "repeats": 3, "decode_tokens": 32, "bulk_s": 4.0, "pings": 20,
             "mooncake_tokens": 100, "mooncake_trials": 3, "stream_tokens": [8, 64, 160],
             "interference_prefill": [(256, 1024, 1), (1024, 0, 1)],
             "interference_decode": [(4, 1024)], "interference_repeats": 4,
             # A short turn's KV copy starting 1.5 s into a document turn's (1,024 and 48
             # tokens of the demo model's KV): how the line shares between them.
             "overlap_trials": 4, "overlap_tokens": (1024, 48), "overlap_delay_s": 1.5},
    "quick": {"prefill": [(16, 0, 1), (512, 0, 1), (128, 512, 1), (256, 0, 2)],
              # Three points for the decode fit's three coefficients: with two, its system is
              # singular and only rounding let it solve (a fresh-clone CI run failed on it).
              "decode": [(1, 256), (2, 1024), (1, 1024)],
              "repeats": 1, "decode_tokens": 12, "bulk_s": 1.5, "pings": 6,
              "mooncake_tokens": 20, "mooncake_trials": 2, "stream_tokens": [4, 12, 24],
             "interference_prefill": [], "interference_decode": [], "overlap_trials": 0},
}


class Tokens:
    """Fresh token ids (never a prefix of an earlier prompt: the first id is unique)."""

    def __init__(self, seed: int = 7):
        import random
        self.rng = random.Random(seed)

    def __call__(self, count: int) -> list[int]:
        return [self.rng.randrange(4, VOCAB) for _ in range(count)]


def generate(server: SGLangServer, ids: list[int], new_tokens: int, stream: bool):
    result = agentic.RequestResult(0, 0, len(ids), 0, new_tokens)
    agentic.stream_generate(server.host, server.port, {
        "input_ids": ids, "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0.0,
                                              "ignore_eos": True}}, 600.0, result,
        server.headers)
    if result.error:
        raise RuntimeError(f"profile request failed: {result.error}")
    return result


def at_once(server, prompts: list, new_tokens: int) -> tuple[float, list]:
    """Send every prompt at once; (wall seconds until the last answer, results)."""
    results: list = [None] * len(prompts)
    errors: list = []

    def one(i):
        try:
            results[i] = generate(server, prompts[i], new_tokens, True)
        except Exception as err:  # noqa: BLE001 - re-raised below
            errors.append(err)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - started, results


def http_bytes(server: SGLangServer, ids: list[int], new_tokens: int) -> tuple[int, int]:
    """(request body bytes, streamed response bytes) of one streamed /generate, as the router
    sends it to main and main answers across the line."""
    import http.client
    body = json.dumps({"input_ids": ids, "stream": True, "sampling_params": {
        "max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}}).encode()
    conn = http.client.HTTPConnection(server.host, server.port, timeout=600)
    try:
        conn.request("POST", "/generate", body=body,
                     headers={"Content-Type": "application/json", **server.headers})
        response = conn.getresponse()
        return len(body), len(response.read())
    finally:
        conn.close()


def least_squares(rows: list, targets: list) -> list:
    """Coefficients of targets ~ rows (normal equations; columns clipped at >= 0 one by one)."""
    k = len(rows[0])
    active = list(range(k))
    while True:
        a = [[sum(r[i] * r[j] for r in rows) for j in active] for i in active]
        b = [sum(r[i] * t for r, t in zip(rows, targets)) for i in active]
        solution = _solve(a, b)
        negative = [active[i] for i, v in enumerate(solution) if v < 0]
        if not negative or len(active) == 1:
            coefficients = [0.0] * k
            for i, v in zip(active, solution):
                coefficients[i] = max(v, 0.0)
            return coefficients
        active.remove(negative[0])


def _solve(a: list, b: list) -> list:
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        if abs(m[col][col]) < 1e-300:
            raise ValueError("singular fit: too few distinct points")
        for r in range(n):
            if r != col:
                factor = m[r][col] / m[col][col]
                m[r] = [x - factor * y for x, y in zip(m[r], m[col])]
    return [m[i][n] / m[i][i] for i in range(n)]


def profile_server(plan: dict, cores: float, log_dir: Path, log) -> dict:
    model = ensure_tiny_model(WAN_DEMO_MODEL)
    group = cpu_budget.CpuGroup(f"pdd-profile-{os.getpid()}", cores)
    server = SGLangServer("profile", model, log_dir, max_total_tokens=32768,
                          exec_prefix=group.exec_prefix(), extra_args=NON_OVERLAP_LOOP_ARGS)
    tokens = Tokens()
    try:
        group.create()
        server.start()
        server.wait_ready(600)
        generate(server, tokens(32), 2, True)      # first forward's one-off costs, unmeasured
        group.limit()
        before = group.snapshot()
        prefill = []
        for fresh, cached, batch in plan["prefill"]:
            for _ in range(plan["repeats"]):
                prefixes = [tokens(cached) for _ in range(batch)]
                if cached:
                    at_once(server, prefixes, 1)   # the prefix, cached
                wall, results = at_once(server, [p + tokens(fresh) for p in prefixes], 1)
                hit = [r.cached_tokens for r in results]
                prefill.append({"fresh": fresh, "cached": cached, "batch": batch,
                                "wall_s": round(wall, 4), "cached_tokens": hit})
                log(f"prefill N={fresh} C={cached} B={batch}: {wall * 1e3:.0f} ms (hit {hit})")
        decode = []
        for batch, context in plan["decode"]:
            for _ in range(plan["repeats"]):
                _, results = at_once(server, [tokens(context) for _ in range(batch)],
                                     plan["decode_tokens"])
                gaps = sorted(g for r in results for g in r.itl_s[2:])
                step = statistics.median(gaps)
                decode.append({"batch": batch, "context": context, "step_s": round(step, 5),
                               "gaps": len(gaps)})
                log(f"decode B={batch} L={context}: step {step * 1e3:.1f} ms")
        stream = []
        for new_tokens in plan["stream_tokens"]:
            sent, got = http_bytes(server, tokens(256), new_tokens)
            stream.append({"prompt_tokens": 256, "new_tokens": new_tokens, "request_bytes": sent,
                           "response_bytes": got})
            log(f"stream of {new_tokens} tokens: {got} B (request {sent} B)")
        cpu = group.usage_between(before, group.snapshot())
    finally:
        server.stop()
        group.remove()
    # Streamed bytes: fixed + per token + per token x tokens before it (cumulative fields).
    m = [d["new_tokens"] for d in stream]
    s_fit = least_squares([[1.0, x, x * (x - 1) / 2] for x in m],
                          [d["response_bytes"] for d in stream])
    http = {"stream_bytes_fixed": s_fit[0], "stream_bytes_per_token": s_fit[1],
            "stream_bytes_per_token_squared": s_fit[2],
            "request_bytes_per_prompt_token": statistics.fmean(
                (d["request_bytes"] - 100) / d["prompt_tokens"] for d in stream),
            "points": stream}
    return fit_server({"quota_cores": cores, "prefill_points": prefill, "decode_points": decode,
                       "http": http, "cpu_during_measurement": cpu})


def profile_interference(plan: dict, cores: float, log_dir: Path, log) -> dict:
    """The same points on one server alone and while a second server under the same quota
    decodes 4 streams (the demo's servers share the machine's cores), alternated point by point
    so that the shared machine's drifting background load falls on both alike: how much longer
    a forward runs per busy neighbour."""
    model = ensure_tiny_model(WAN_DEMO_MODEL)
    groups = [cpu_budget.CpuGroup(f"pdd-profile-{os.getpid()}-{i}", cores) for i in range(2)]
    servers = [SGLangServer(f"interference-{i}", model, log_dir, max_total_tokens=32768,
                            exec_prefix=g.exec_prefix(), extra_args=NON_OVERLAP_LOOP_ARGS)
               for i, g in enumerate(groups)]
    tokens, stop, active = Tokens(11), threading.Event(), threading.Event()
    inflight = [0]
    lock = threading.Lock()

    def neighbour_load():
        while not stop.is_set():
            if not active.wait(0.2):
                continue
            with lock:
                inflight[0] += 1
            try:
                generate(servers[1], tokens(1024), 24, True)
            finally:
                with lock:
                    inflight[0] -= 1

    def neighbour(on: bool):
        if on:
            active.set()
            time.sleep(1.0)                  # its 4 streams decoding
        else:
            active.clear()
            while inflight[0]:
                time.sleep(0.05)

    def point(kind, spec):
        if kind == "prefill":
            fresh, cached, batch = spec
            prefixes = [tokens(cached) for _ in range(batch)]
            if cached:
                at_once(servers[0], prefixes, 1)
            return at_once(servers[0], [p + tokens(fresh) for p in prefixes], 1)[0]
        batch, context = spec
        _, results = at_once(servers[0], [tokens(context) for _ in range(batch)],
                             plan["decode_tokens"])
        return statistics.median(g for r in results for g in r.itl_s[2:])
    load = [threading.Thread(target=neighbour_load, daemon=True) for _ in range(4)]
    rows = []
    try:
        for group, server in zip(groups, servers):
            group.create()
            server.start()
        for server in servers:
            server.wait_ready(600)
            generate(server, tokens(32), 2, True)
        for group in groups:
            group.limit()
        for thread in load:
            thread.start()
        specs = ([("prefill", p) for p in plan["interference_prefill"]]
                 + [("decode", d) for d in plan["interference_decode"]])
        for kind, spec in specs:
            for _ in range(plan["interference_repeats"]):
                neighbour(False)
                alone = point(kind, spec)
                neighbour(True)
                busy = point(kind, spec)
                rows.append({"kind": kind, "point": list(spec), "alone_s": alone,
                             "neighbour_busy_s": busy})
                log(f"interference {kind} {spec}: alone {alone * 1e3:.0f} ms, neighbour "
                    f"decoding {busy * 1e3:.0f} ms")
    finally:
        stop.set()
        active.set()
        for thread in load:
            thread.join(120)
        for server in servers:
            server.stop()
        for group in groups:
            group.remove()
    ratios = [r["neighbour_busy_s"] / r["alone_s"] for r in rows]
    return {"rows": rows, "ratios": ratios,
            "neighbour_slowdown": max(statistics.median(ratios) - 1.0, 0.0)}


PREFILL_TERMS = ("prefill_fixed_s", "prefill_s_per_token", "prefill_s_per_token_pair",
                 "prefill_s_per_cached_token")
DECODE_TERMS = ("decode_fixed_s", "decode_s_per_request", "decode_s_per_context_token")


def fit_server(server: dict) -> dict:
    """The fits, on the median of each point's repeats (a shared machine's outliers) and
    weighted by 1/t (relative error: a short forward counts as much as a long one)."""
    def medians(points, keys, value):
        groups: dict = {}
        for p in points:
            groups.setdefault(tuple(p[k] for k in keys), []).append(p[value])
        return {k: statistics.median(v) for k, v in groups.items()}
    prefill = medians(server["prefill_points"], ("fresh", "cached", "batch"), "wall_s")
    rows = [[x / t for x in (1.0, b * n, b * n * (c + n / 2), b * c)]
            for (n, c, b), t in prefill.items()]
    p_fit = least_squares(rows, [1.0] * len(rows))
    decode = medians(server["decode_points"], ("batch", "context"), "step_s")
    rows = [[x / t for x in (1.0, b, b * l)] for (b, l), t in decode.items()]
    d_fit = least_squares(rows, [1.0] * len(rows))
    return {**server, "prefill_fit": dict(zip(PREFILL_TERMS, p_fit)),
            "decode_fit": dict(zip(DECODE_TERMS, d_fit))}


def loopback_rate(total_bytes: int = 64 << 20) -> float:
    """TCP goodput over 127.0.0.1 (bytes/s), sender and receiver threads in this process."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    got = [0]

    def sink():
        conn, _ = server.accept()
        with conn:
            while got[0] < total_bytes:
                data = conn.recv(1 << 20)
                if not data:
                    break
                got[0] += len(data)
    reader = threading.Thread(target=sink)
    reader.start()
    client = socket.create_connection(server.getsockname())
    chunk = b"\0" * (1 << 20)
    started = time.perf_counter()
    for _ in range(total_bytes >> 20):
        client.sendall(chunk)
    reader.join()
    seconds = time.perf_counter() - started
    client.close()
    server.close()
    return got[0] / seconds


def profile_line(plan: dict, rate_mbit: float, rtt_ms: float, jitter_ms: float, log_dir: Path,
                 log) -> dict:
    from pdd_sglang.dev.wan_emulator import WanLine, copy_overlap, handoff_bench, measure
    line = WanLine(rate_mbit, rtt_ms, jitter_ms, seed=1)
    try:
        line.start(log_path=str(log_dir / "line.log"))
        wire_before = {side: line.counters(side)["tx_bytes"] for side in ("a", "b")}
        bulk = measure.bulk_rate(line, seconds=plan["bulk_s"],
                                 warmup_s=min(1.0, plan["bulk_s"] / 3))
        wire = {side: line.counters(side)["tx_bytes"] - wire_before[side] for side in ("a", "b")}
        # Line bytes (both directions: headers, retransmissions, ACKs) per payload byte.
        bulk["wire_bytes_a_to_b"], bulk["wire_bytes_b_to_a"] = wire["a"], wire["b"]
        bulk["wire_per_payload_byte"] = (wire["a"] + wire["b"]) / bulk["bytes"]
        pings = measure.round_trips(line, count=plan["pings"])
        forwarder = None
    finally:
        line.stop()
        forwarder = line.last_stats
    log(f"line: bulk {bulk}, RTT median {statistics.median(pings):.1f} ms")
    bench = handoff_bench.run(log_dir / "mooncake", trials=plan["mooncake_trials"], warmup=1,
                              rate_mbit=rate_mbit, rtt_ms=rtt_ms, jitter_ms=jitter_ms,
                              tokens=plan["mooncake_tokens"], server=False, log=log)
    sizes = [(bench["handoff"][k]["kv_bytes"], bench["handoff"][k]["mooncake_write_ms"]["p50_ms"]
              / 1e3) for k in ("kv_tiny_model", "kv")]
    (b0, t0), (b1, t1) = sizes
    slope = (t1 - t0) / (b1 - b0)
    fixed = max(t0 - b0 * slope, 0.0)
    # Mooncake's own writes across the line: wire bytes (both directions) per payload byte,
    # headers, the retransmissions its parallel streams cause at the line's queue, ACKs.
    kv = bench["handoff"]["kv"]
    mooncake_wire = kv["wire_bytes_mean"] / kv["payload_bytes"] if kv["payload_bytes"] else None
    overlap = None
    if plan.get("overlap_trials"):
        big, small = (tokens * WAN_DEMO_MODEL.kv_bytes_per_token
                      for tokens in plan["overlap_tokens"])
        overlap = copy_overlap.run(log_dir / "overlap", rate_mbit=rate_mbit, rtt_ms=rtt_ms,
                                   jitter_ms=jitter_ms, big_bytes=big, small_bytes=small,
                                   delay_s=plan["overlap_delay_s"],
                                   trials=plan["overlap_trials"],
                                   block_count=2 * WAN_DEMO_MODEL.num_hidden_layers, log=log)
    return {"bulk": bulk, "rtt_ms": pings, "forwarder_stats": forwarder, "copy_overlap": overlap,
            "mooncake_wire_per_payload_byte": mooncake_wire,
            "mooncake_forwarder_stats": bench.get("forwarder"),
            "mooncake_writes": [{"bytes": b, "p50_s": t} for b, t in sizes],
            "mooncake_rate_bytes_per_s": 1 / slope if slope > 0 else None,
            "mooncake_intercept_s": fixed,
            "control_round_trip_ms": bench["control_message_ms"],
            "loopback_bytes_per_s": loopback_rate()}
