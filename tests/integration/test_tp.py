"""Issue 23, step 1: SGLang's CPU engine at ``--tp-size 2`` gives the greedy tokens of TP 1.

The server is plain SGLang of the patched venv (no ``--pdd-role``) at TP 2: patch 0017 keeps the
CPU engine's model-parallel groups off PyNccl, so its two ranks all-reduce through
``torch.distributed`` over gloo, and ``SGLANG_CPU_OMP_THREADS_BIND=0|1`` gives each rank a core
(``conftest.py``: ``CPU_TP2_ENV``). The reference is the session's plain TP 1 server of the
pristine wheel. Float32 sums of two partial products in another order than one matmul's move the
logits in their last bits (measured: at most 1.4e-6 in a sampled token's logprob), so the test
compares greedy tokens, on a batch of concurrent prompts (several batch shapes) and on a repeat of
one prompt (the radix-cache hit path).

Issue 23, step 2: PDD's prefill, relay and main, each at ``--tp-size 2``, token for token against
the plain TP 2 server, on the module's one TP 2 cluster (``conftest.py``: ``tp2_cluster``).
Through the PDD router: a P->MD request, a P->RLD->MD request handed off, and one the relay
finishes alone. One-Shot and Catch-Up at a fixed handoff point go spliced as the router splices
them (``generate_pdd``), since only a route carries the relay's test-only hold; then the Catch-Up
conversation's next turn, where every prefill rank sends the main only the tokens past main's
cached prefix and the relay all of them (the DRC, checked per rank in prefill's log). Then every
rank's pool and radix locks are back to baseline (``/server_info``: ``pdd.tp_ranks``), and
SIGTERM closes PDD on every rank of every role.
"""

from __future__ import annotations

import json
import random
import signal
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from pdd_sglang.dev.testing.pd_client import generate_pdd

TP = 2

GREEDY = {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}
PROMPT_SEED = 23
LENGTHS = (5, 17, 60, 130, 300, 700, 9, 250)


def prompts() -> list[list[int]]:
    rng = random.Random(PROMPT_SEED)
    return [[rng.randrange(10, 1000) for _ in range(n)] for n in LENGTHS]


def test_sglang_cpu_engine_at_tp_2_matches_tp_1_greedy(page16_cluster, tp2_cluster):
    reference = page16_cluster["plain"]
    tp2 = tp2_cluster["plain_tp2"]
    info = tp2.get_json("/server_info")
    assert info["tp_size"] == 2 and "pdd" not in info["internal_states"][0]

    def both(prompt):
        body = {"input_ids": prompt, "sampling_params": GREEDY}
        return (tp2.post_json("/generate", body)["output_ids"],
                reference.post_json("/generate", body)["output_ids"])

    batch = prompts()
    with ThreadPoolExecutor(len(batch)) as pool:  # concurrent: batched on both servers
        answers = list(pool.map(both, batch))
    answers.append(both(batch[4]))  # a repeat: its prompt hits the TP 2 radix cache
    differing = [(len(p), i) for p, (got, want), i in
                 zip(batch + [batch[4]], answers, range(len(answers))) if got != want]
    assert differing == [], f"(prompt length, index) where TP 2 differs from TP 1: {differing}"
    assert all(len(got) == GREEDY["max_new_tokens"] for got, _ in answers)
    assert tp2_cluster.dead_servers() == []


# The router places prompts over 100 uncached tokens P->RLD->MD (conftest: ROUTER_WAN_GBPS).
LONG, SHORT = 300, 40
ROLES = ("prefill", "relay", "main")


def rank_pools(server) -> list[dict]:
    pdd = server.pdd_state()
    assert len(pdd["tp_ranks"]) == 2 and pdd["tp_ranks"][0] == pdd["pool"], pdd
    return pdd["tp_ranks"]


def wait_idle_every_rank(server, timeout_s: float = 60.0) -> list[dict]:
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        pools = rank_pools(server)
        if all(p["in_use_tokens"] == 0 and p["locked_tokens"] == 0 for p in pools) or (
                time.monotonic() > deadline):
            return pools
        time.sleep(0.5)


def via_router(cluster, prompt: list[int], max_new_tokens: int) -> dict:
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": max_new_tokens,
                                                     "temperature": 0, "ignore_eos": True}}
    request = urllib.request.Request(cluster.router.url + "/generate",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as err:
        raise AssertionError(f"router answered {err.code}: {err.read()[:500]!r}") from None


def plain(cluster, prompt: list[int], max_new_tokens: int) -> list[int]:
    return cluster["plain_tp2"].post_json("/generate", {"input_ids": prompt, "sampling_params": {
        "max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}})["output_ids"]


def sent_by_rank(prefill, room: int, timeout_s: float = 30.0) -> dict:
    """What each prefill rank's fan-out logged it sent for ``room``: {rank: {role: (pages,
    bytes)}} (``PDD room R sent: relay P pages / B B; main ...``, one line per rank)."""
    import re
    import time

    line = re.compile(rf"\bTP(\d+)\] PDD room {room} sent: (.*)$")
    part = re.compile(r"(\w+) (\d+) pages / (\d+) B")
    deadline = time.monotonic() + timeout_s
    while True:
        found = {}
        for text in prefill.log_path.read_text(errors="replace").splitlines():
            match = line.search(text)
            if match:
                found[int(match[1])] = {role: (int(pages), int(nbytes))
                                        for role, pages, nbytes in part.findall(match[2])}
        if len(found) == TP or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def test_pdd_at_tp_2_on_every_role_matches_plain_tp_2(tp2_cluster, tiny_model):
    cluster = tp2_cluster
    rng = random.Random(PROMPT_SEED + 1)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(10, 1000) for _ in range(n)]

    for name in ROLES:
        assert cluster[name].get_json("/server_info")["tp_size"] == 2
    baseline = {name: wait_idle_every_rank(cluster[name]) for name in ROLES}
    for name, pools in baseline.items():
        assert all(p["in_use_tokens"] == 0 and p["locked_tokens"] == 0 for p in pools), (
            name, pools)
    relay_before = cluster["relay"].pdd_state()["handoff"]["events"]
    seen = {}

    # Through the router: P->MD; P->RLD->MD handed off; P->RLD->MD finished at the relay.
    prompt = fresh(SHORT)
    answer = via_router(cluster, prompt, 16)
    assert answer["meta_info"]["pdd"]["pipeline"] == "prefill_main"
    assert answer["output_ids"] == plain(cluster, prompt, 16), "P->MD"
    prompt = fresh(LONG)
    # Long past main's WAN delay (conftest: TP2_WAN_DELAY_MS) at the relay's TP 2 pace (measured:
    # 12-36 tokens/s on this machine).
    answer = via_router(cluster, prompt, 128)
    pdd = answer["meta_info"]["pdd"]
    assert pdd["pipeline"] == "prefill_relay_main" and (pdd["handed_tokens"] or 0) > 0, pdd
    assert answer["output_ids"] == plain(cluster, prompt, 128), f"P->RLD->MD handed off: {pdd}"
    seen["router_handoff"] = (pdd["handoff_mode"], pdd["handed_tokens"])
    prompt = fresh(LONG)
    answer = via_router(cluster, prompt, 2)  # done long before main's KV crosses the WAN delay
    pdd = answer["meta_info"]["pdd"]
    assert pdd["pipeline"] == "prefill_relay_main" and pdd["handed_tokens"] is None, pdd
    assert answer["output_ids"] == plain(cluster, prompt, 2), f"relay-finished: {pdd}"

    # One-Shot and Catch-Up at a fixed point (the relay's test-only hold; several Catch-Up chunks).
    rooms = []  # (room, prompt, main's cached prefix) of each request routed P->RLD->MD here
    for mode, point in (("one-shot", 5), ("catch-up", 20)):
        prompt = fresh(LONG)
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 40, "temperature": 0,
                                                         "ignore_eos": True}}
        got = generate_pdd(cluster["prefill"], cluster["relay"], cluster["main"], body,
                           cluster.bootstrap_port, debug_handoff_after_tokens=point,
                           debug_handoff_mode=mode)
        assert got["mode"] == mode and got["handed_tokens"] >= point, (mode, got["handed_tokens"])
        assert got["output_ids"] == plain(cluster, prompt, 40), mode
        seen[mode] = got["handed_tokens"]
        rooms.append((got["room"], prompt, got["main"]["meta_info"]["cached_tokens"]))

    # The DRC byte ratio at every rank: the Catch-Up conversation's next turn, handed off at
    # token 2. Prefill sends the relay every token of the prompt and the main only those past the
    # prefix main's radix cache holds (the previous turn, which main finished), each prefill rank
    # its own half of the KV heads. Each rank's fan-out logs what it sent; rank 0's ledger is in
    # /server_info too.
    turn = prompt + got["output_ids"] + fresh(SHORT)
    body = {"input_ids": turn, "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                                   "ignore_eos": True}}
    got = generate_pdd(cluster["prefill"], cluster["relay"], cluster["main"], body,
                       cluster.bootstrap_port, debug_handoff_after_tokens=2)
    assert got["handed_tokens"] == 2 and got["output_ids"] == plain(cluster, turn, 8), got
    main_hit = got["main"]["meta_info"]["cached_tokens"]
    assert main_hit >= len(prompt), (main_hit, len(prompt))  # the previous turn, at least
    rooms.append((got["room"], turn, main_hit))
    per_rank_bytes = tiny_model[0].kv_bytes_per_token // TP  # per token: its share of KV heads
    ledger = cluster["prefill"].pdd_state()["transfers"]["by_request"]
    drc = {}
    for room, room_prompt, hit in rooms:
        tokens = {"relay": len(room_prompt), "main": len(room_prompt) - hit}  # page size 1
        want = {role: (n, n * per_rank_bytes) for role, n in tokens.items()}
        rank0 = {r["role"]: (r["pages"], r["bytes"]) for r in ledger if r["room"] == room}
        assert rank0 == want, (room, hit, rank0, want)
        assert sent_by_rank(cluster["prefill"], room) == {rank: want for rank in range(TP)}, (
            room, hit, want)
        drc[room] = want["main"][1] / want["relay"][1]
    seen["drc_main_over_relay_bytes"] = [round(ratio, 3) for ratio in drc.values()]
    events = cluster["relay"].pdd_state()["handoff"]["events"]
    for mode in ("one-shot", "catch-up"):
        key = f"mode_{mode}"
        assert events.get(key, 0) > relay_before.get(key, 0), (key, events)
    assert events.get("handed_off", 0) - relay_before.get("handed_off", 0) >= 3, events

    # Every rank of every role back to its baseline: no KV held, no radix lock.
    for name in ROLES:
        pools = wait_idle_every_rank(cluster[name])
        for rank, (pool, before) in enumerate(zip(pools, baseline[name])):
            assert pool["in_use_tokens"] == 0 and pool["locked_tokens"] == 0, (name, rank, pool)
            assert pool["free_request_slots"] == before["free_request_slots"], (name, rank, pool)
        state = cluster[name].pdd_state().get("handoff") or {}
        assert not any(state.get(k) for k in ("parked", "pending", "active", "out_of_batch")), state
    assert cluster.dead_servers() == []
    print("TP 2 handoffs (mode, handed tokens), and main's KV bytes over the relay's per room "
          "(the last: the next turn):", seen)

    # SIGTERM, as an operator stops SGLang: each rank's scheduler closes its PDD owners. The router
    # goes first: its open connections to prefill would hold prefill's HTTP server in its
    # graceful shutdown (measured: over 60 s).
    cluster.router.stop()
    for name in ("relay", "main", "prefill"):
        server = cluster[name]
        server.process.send_signal(signal.SIGTERM)
        server.process.wait(60)
        log = server.log_path.read_text(errors="replace")
        closed = log.count("PDD: closed on scheduler exit; PDD threads left: none")
        assert closed == 2, (name, closed, server.log_tail())
