"""Prefill, relay and main each at its own TP size on the CPU engine (issue 37): the cluster and
the check every combination must pass.

A combination (``TpSizes``, written ``P1/R1/M2``) runs PDD's three servers, each at its own
``--tp-size`` (SGLang's CPU engine: patch 0017, one core list per rank), behind the PDD router,
with the test-only WAN delay on prefill's path to main, the relay's test-only handoff hold, and the
KV digest on relay and main. :func:`check_combination` then runs, against a plain server's greedy
tokens:

1. through the router: a P->MD request, a P->RLD->MD request handed off, one the relay finishes;
2. a forced One-Shot and a forced Catch-Up handoff (several chunks), spliced as the router does;
3. the Catch-Up conversation's next turn: main's radix cache holds the last turn, so prefill sends
   main only the suffix. Every prefill rank's fan-out logs what it sent to each session, and the
   bytes summed over ranks and sessions must be the ideal: the suffix's tokens x the model's KV
   bytes per token to main, the whole prompt's to the relay (no head is sent twice, none missed);
4. every handed-off request's WAN copy verified by the KV digest (each rank hashes its own heads,
   the ranks' parts combined), and every rank of every role back to its baseline pool, zero
   radix locks and no handoff state.

``tests/integration/test_tp.py`` runs one combination in ``make test``; ``scripts/tp_matrix.py``
runs the others.
"""

from __future__ import annotations

import json
import random
import re
import signal
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from pdd_sglang.dev.testing.cluster import RELAY_CPU_ARGS, Cluster, SGLangServer, free_port
from pdd_sglang.dev.testing.pd_client import generate_pdd
from pdd_sglang.dev.testing.wan_cluster import RouterProcess

ROLES = ("prefill", "relay", "main")
# SGLang's CPU engine at --tp-size 2 needs one core list per rank, or it asserts one rank per
# NUMA node (this machine has one).
CPU_TP2_ENV = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}
# Every KV chunk to main waits this long (by the relay's TP size), so a relay finishes a 2-token
# request before main's copy lands: a TP 2 decode step, its ranks all-reducing over gloo beside
# other ranks on two cores, took more than 300 ms in a CI run; at TP 1 the page clusters' 300 ms.
WAN_DELAY_MS = {1: 300, 2: 1000}
CATCH_UP_CHUNK = 8  # several Catch-Up chunks (each acknowledged) in a short request
# The router's line over a test cluster, set so prompts over 100 uncached tokens go P->RLD->MD
# (tiny model: 512 KV bytes per token in float32): 100 x 512 B at this rate takes the policy's
# default 0.5 s hide threshold; RTT 0, so the prompt length alone decides.
ROUTER_WAN_GBPS = 100 * 512 / 0.5 * 8 / 1e9
GREEDY = {"temperature": 0, "ignore_eos": True}
LONG, SHORT = 300, 40
# The router's handed-off request must outlast main's copy (WAN_DELAY_MS, then the digest) at the
# relay's pace, measured on this machine: 170-190 tokens/s at TP 1 (128 tokens finished before
# main's copy landed), 12-36 at TP 2 beside other ranks. The relay hands off One-Shot
# (--pdd-handoff-mode; the forced Catch-Up below is the test control's): a TP 1 relay outpaces
# Catch-Up chunks of 8 that a TP 2 main absorbs one round trip each, and answers alone.
ROUTER_HANDOFF_TOKENS = {1: 512, 2: 128}


@dataclass(frozen=True)
class TpSizes:
    prefill: int
    relay: int
    main: int

    @property
    def label(self) -> str:
        return f"P{self.prefill}/R{self.relay}/M{self.main}"

    @classmethod
    def parse(cls, label: str) -> "TpSizes":
        match = re.fullmatch(r"P(\d+)/R(\d+)/M(\d+)", label.strip())
        if match is None:
            raise ValueError(f"a combination is written P<tp>/R<tp>/M<tp>, got {label!r}")
        return cls(*(int(g) for g in match.groups()))

    def of(self, role: str) -> int:
        return getattr(self, role)


def tp_args(tp: int) -> tuple:
    return ("--tp-size", str(tp), "--disable-custom-all-reduce") if tp > 1 else ()


def tp_env(tp: int) -> dict:
    return dict(CPU_TP2_ENV) if tp > 1 else {}


def pdd_servers(sizes: TpSizes, model_path, log_dir: Path, bootstrap_port: int) -> list:
    """PDD's prefill, relay and main at ``sizes``, page size 1, their schedulers forked."""
    def server(role: str, *args: str) -> SGLangServer:
        tp = sizes.of(role)
        return SGLangServer(role, model_path, log_dir, env=tp_env(tp), fork_children=True,
                            extra_args=("--pdd-role", role, *tp_args(tp),
                                        "--disaggregation-transfer-backend", "mooncake_tcp",
                                        *args))

    return [
        server("prefill", "--disaggregation-bootstrap-port", str(bootstrap_port),
               "--pdd-debug-wan-delay-ms", str(WAN_DELAY_MS[min(sizes.relay, 2)])),
        server("relay", "--pdd-control-port", "0", "--pdd-debug-handoff-hold",
               "--pdd-handoff-mode", "one-shot", "--pdd-catch-up-chunk", str(CATCH_UP_CHUNK),
               "--pdd-enable-kv-digest", *RELAY_CPU_ARGS),
        server("main", "--pdd-enable-kv-digest"),
    ]


def mixed_tp_cluster(sizes: TpSizes, model_path, log_dir: Path, extra: tuple = ()) -> Cluster:
    """The combination's servers (and ``extra`` ones, such as a plain reference), not started."""
    bootstrap_port = free_port()
    cluster = Cluster([*pdd_servers(sizes, model_path, log_dir, bootstrap_port), *extra])
    cluster.bootstrap_port, cluster.log_dir, cluster.sizes = bootstrap_port, log_dir, sizes
    cluster.router = None
    return cluster


def start_router(cluster: Cluster, extra_args: tuple = ()) -> RouterProcess:
    """The PDD router over ``cluster``'s prefill, relay and main (any test cluster with a
    ``bootstrap_port`` and ``log_dir``), as ``cluster.router``; ``extra_args``: more router
    flags."""
    router = RouterProcess(cluster.log_dir / "router.log", [
        "--prefill", cluster["prefill"].url, str(cluster.bootstrap_port),
        "--relay", cluster["relay"].url, "--main", cluster["main"].url,
        "--wan-gbps", repr(ROUTER_WAN_GBPS), "--wan-rtt-ms", "0", "--health-interval-s", "1",
        *extra_args])
    try:
        router.start()
    except BaseException:
        router.stop()
        raise
    cluster.router = router
    return router


def rank_pools(server: SGLangServer) -> list[dict]:
    """Every TP rank's KV pool figures (rank 0's alone at TP 1)."""
    pdd = server.pdd_state()
    return pdd.get("tp_ranks") or [pdd["pool"]]


def wait_idle_every_rank(server: SGLangServer, timeout_s: float = 60.0) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        pools = rank_pools(server)
        if all(p["in_use_tokens"] == 0 and p["locked_tokens"] == 0 for p in pools) or (
                time.monotonic() > deadline):
            return pools
        time.sleep(0.5)


def via_router(cluster: Cluster, prompt: list[int], max_new_tokens: int) -> dict:
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": max_new_tokens, **GREEDY}}
    request = urllib.request.Request(cluster.router.url + "/generate",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as err:
        raise AssertionError(f"router answered {err.code}: {err.read()[:500]!r}") from None


def greedy(server: SGLangServer, prompt: list[int], max_new_tokens: int) -> list[int]:
    return server.post_json("/generate", {"input_ids": prompt, "sampling_params": {
        "max_new_tokens": max_new_tokens, **GREEDY}})["output_ids"]


def sent_by_rank(prefill: SGLangServer, room: int, ranks: int, timeout_s: float = 30.0) -> dict:
    """What each prefill rank's fan-out logged it sent for ``room``: {rank: [(role, pages,
    bytes), one per session]} (``PDD room R sent: relay P pages / B B; main ...``; no ``TP``
    mark in the log at TP 1)."""
    line = re.compile(rf"(?:\bTP(\d+))?\] PDD room {room} sent: (.*)$")
    part = re.compile(r"(\w+) (\d+) pages / (\d+) B")
    deadline = time.monotonic() + timeout_s
    while True:
        found = {}
        for text in prefill.log_path.read_text(errors="replace").splitlines():
            match = line.search(text)
            if match:
                found[int(match[1] or 0)] = sorted(
                    (role, int(pages), int(nbytes)) for role, pages, nbytes in
                    part.findall(match[2]))
        if len(found) == ranks or time.monotonic() > deadline:
            return found


def check_combination(cluster: Cluster, kv_bytes_per_token: int, reference: SGLangServer,
                      seed: int = 37) -> dict:
    """Run the module's checks on ``cluster`` (its router started) against ``reference``'s greedy
    tokens; AssertionError on the first that fails, else what was seen."""
    rng = random.Random(seed)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(10, 1000) for _ in range(n)]

    sizes = cluster.sizes
    for role in ROLES:
        assert cluster[role].get_json("/server_info")["tp_size"] == sizes.of(role), role
    baseline = {role: wait_idle_every_rank(cluster[role]) for role in ROLES}
    for role, pools in baseline.items():
        assert len(pools) == sizes.of(role), (role, pools)
        assert all(p["in_use_tokens"] == 0 and p["locked_tokens"] == 0 for p in pools), (
            role, pools)
    relay_before = cluster["relay"].pdd_state()["handoff"]
    seen = {"combination": sizes.label}
    seen.update(_through_the_router(cluster, reference, fresh))
    rooms, turn_seen = _forced_handoffs(cluster, reference, fresh)
    seen.update(turn_seen)
    seen["wan_bytes"] = _wan_bytes_against_the_ideal(cluster, rooms, kv_bytes_per_token)
    seen["kv_digest"] = _kv_digests(cluster, relay_before, handed_off=len(rooms) + 1)
    _back_to_baseline(cluster, baseline)
    return seen


def _through_the_router(cluster: Cluster, reference: SGLangServer, fresh) -> dict:
    prompt = fresh(SHORT)
    answer = via_router(cluster, prompt, 16)
    assert answer["meta_info"]["pdd"]["pipeline"] == "prefill_main"
    assert answer["output_ids"] == greedy(reference, prompt, 16), "P->MD"
    prompt = fresh(LONG)  # long past main's WAN delay at the relay's pace
    tokens = ROUTER_HANDOFF_TOKENS[min(cluster.sizes.relay, 2)]
    answer = via_router(cluster, prompt, tokens)
    pdd = answer["meta_info"]["pdd"]
    assert pdd["pipeline"] == "prefill_relay_main" and (pdd["handed_tokens"] or 0) > 0, pdd
    assert answer["output_ids"] == greedy(reference, prompt, tokens), f"handed off: {pdd}"
    handed = (pdd["handoff_mode"], pdd["handed_tokens"])
    prompt = fresh(LONG)
    answer = via_router(cluster, prompt, 2)  # done long before main's copy crosses the delay
    pdd = answer["meta_info"]["pdd"]
    assert pdd["pipeline"] == "prefill_relay_main" and pdd["handed_tokens"] is None, pdd
    assert answer["output_ids"] == greedy(reference, prompt, 2), f"relay-finished: {pdd}"
    return {"router_p_md": "token-exact", "router_handoff": handed,
            "router_relay_finished": "token-exact"}


def _forced_handoffs(cluster: Cluster, reference: SGLangServer, fresh) -> tuple[list, dict]:
    """One-Shot at token 5, Catch-Up at token 20, then the Catch-Up conversation's next turn
    handed off at token 2; each room with its prompt and main's cached prefix."""
    rooms, seen = [], {}
    for mode, point in (("one-shot", 5), ("catch-up", 20)):
        prompt = fresh(LONG)
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 40, **GREEDY}}
        got = generate_pdd(cluster["prefill"], cluster["relay"], cluster["main"], body,
                           cluster.bootstrap_port, debug_handoff_after_tokens=point,
                           handoff_mode=mode)
        assert got["mode"] == mode and got["handed_tokens"] >= point, (mode, got["handed_tokens"])
        assert got["output_ids"] == greedy(reference, prompt, 40), mode
        seen[mode] = got["handed_tokens"]
        rooms.append((got["room"], prompt, got["main"]["meta_info"]["cached_tokens"]))
    turn = prompt + got["output_ids"] + fresh(SHORT)
    body = {"input_ids": turn, "sampling_params": {"max_new_tokens": 8, **GREEDY}}
    got = generate_pdd(cluster["prefill"], cluster["relay"], cluster["main"], body,
                       cluster.bootstrap_port, debug_handoff_after_tokens=2)
    assert got["handed_tokens"] == 2 and got["output_ids"] == greedy(reference, turn, 8), got
    hit = got["main"]["meta_info"]["cached_tokens"]
    assert hit >= len(prompt), (hit, len(prompt))  # the previous turn, at least
    rooms.append((got["room"], turn, hit))
    seen["next_turn_main_hit"] = f"{hit} of {len(turn)} tokens"
    return rooms, seen


def _wan_bytes_against_the_ideal(cluster: Cluster, rooms: list, kv_bytes_per_token: int) -> list:
    """Per room, the bytes every prefill rank sent each session, summed per role, against the
    ideal: the tokens each destination lacked x the whole KV's bytes per token (page size 1)."""
    sizes, out = cluster.sizes, []
    sessions = {role: max(1, sizes.of(role) // sizes.prefill) for role in ("relay", "main")}
    for room, prompt, hit in rooms:
        tokens = {"relay": len(prompt), "main": len(prompt) - hit}
        sent = sent_by_rank(cluster["prefill"], room, sizes.prefill)
        assert sorted(sent) == list(range(sizes.prefill)), (room, sent)
        for rank, parts in sent.items():
            for role in tokens:
                mine = [p for p in parts if p[0] == role]
                assert len(mine) == sessions[role], (room, rank, role, parts)
                assert all(pages == tokens[role] for _, pages, _ in mine), (room, rank, parts)
        total = {role: sum(b for parts in sent.values() for r, _, b in parts if r == role)
                 for role in tokens}
        ideal = {role: n * kv_bytes_per_token for role, n in tokens.items()}
        assert total == ideal, (room, hit, total, ideal)
        out.append({"room": room, "main_bytes": total["main"], "ideal_main_bytes": ideal["main"],
                    "relay_bytes": total["relay"], "main_over_relay":
                    round(total["main"] / total["relay"], 3)})
    return out


def _kv_digests(cluster: Cluster, relay_before: dict, handed_off: int) -> dict:
    relay = cluster["relay"].pdd_state()["handoff"]
    verified = (relay["events"].get("kv_digest_verified", 0)
                - relay_before["events"].get("kv_digest_verified", 0))
    mismatched = (relay["refused"].get("kv_digest_mismatch", 0)
                  - relay_before["refused"].get("kv_digest_mismatch", 0))
    assert verified >= handed_off and mismatched == 0, (verified, mismatched, relay)
    for mode in ("one-shot", "catch-up"):
        key = f"mode_{mode}"
        assert relay["events"].get(key, 0) > relay_before["events"].get(key, 0), (key, relay)
    return {"verified": verified, "mismatched": mismatched}


def _back_to_baseline(cluster: Cluster, baseline: dict) -> None:
    for role in ROLES:
        pools = wait_idle_every_rank(cluster[role])
        for rank, (pool, before) in enumerate(zip(pools, baseline[role])):
            assert pool["in_use_tokens"] == 0 and pool["locked_tokens"] == 0, (role, rank, pool)
            assert pool["free_request_slots"] == before["free_request_slots"], (role, rank, pool)
        state = cluster[role].pdd_state().get("handoff") or {}
        assert not any(state.get(k) for k in ("parked", "pending", "active", "out_of_batch")), (
            role, state)
    assert cluster.dead_servers() == []


def stop_and_check_shutdown(cluster: Cluster) -> None:
    """SIGTERM, as an operator stops SGLang: every rank's scheduler closes its PDD owners. The
    router goes first: its open connections to prefill would hold prefill's HTTP server in its
    graceful shutdown (measured: over 60 s)."""
    if cluster.router is not None:
        cluster.router.stop()
    for role in ("relay", "main", "prefill"):
        server = cluster[role]
        server.process.send_signal(signal.SIGTERM)
        server.process.wait(60)
        log = server.log_path.read_text(errors="replace")
        closed = log.count("PDD: closed on scheduler exit; PDD threads left: none")
        assert closed == cluster.sizes.of(role), (role, closed, server.log_tail())
