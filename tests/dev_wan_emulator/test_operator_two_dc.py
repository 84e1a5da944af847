"""Two datacenters as an operator deploys them (issue 26): every server bound to 0.0.0.0 in the
emulated datacenters' namespaces, each told its address with --pdd-advertise-host, the relay on
the default control port, the router in datacenter A. One cluster serves:

1. a request through the router that hands off from the relay to main across the line, after
   which every role's /metrics (SGLang's own, --enable-metrics) and the router's show PDD's
   counters moved;
2. a SIGTERM to each server's whole process group (systemd's KillMode=control-group), after which
   each logs that no PDD thread is left and nothing of its group remains.

Needs root and /dev/net/tun (the WAN emulator); skips with the reason otherwise.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import time
import urllib.request

import pytest

from pdd_sglang.dev.testing.cluster import RELAY_CPU_ARGS, Cluster, free_port
from pdd_sglang.dev.testing.conversation import FIRST_WORD_ID, WORDS
from pdd_sglang.dev.testing.tiny_model import TinyModelSpec, ensure_tiny_model
from pdd_sglang.dev.testing.wan_cluster import NetnsServer, RouterProcess, in_namespace
from pdd_sglang.dev.wan_emulator import WanLine, check_prerequisites
from pdd_sglang.server_args import DEFAULT_CONTROL_PORT


def _unavailable_reason() -> str | None:
    try:
        check_prerequisites()
    except OSError as exc:
        return str(exc)
    if importlib.util.find_spec("mooncake") is None:
        return "the Mooncake transfer engine is not installed"
    return None


pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(_unavailable_reason() is not None,
                                 reason=_unavailable_reason() or "")]

RATE_MBIT, RTT_MS = 200.0, 10.0
# The router's link model puts the P->MD / P->RLD->MD boundary at 100 uncached tokens (512 KV
# bytes per token of the tiny model, 0.5 s: the policy's default hide_wan_below_s); the prompt
# is three times that. The answer is long enough for main to be ready before the relay is done.
PROMPT_TOKENS, ANSWER_TOKENS = 300, 800
ROUTER_WAN_GBPS = 100 * 512 / 0.5 * 8 / 1e9
TRANSPORT = ("--disaggregation-transfer-backend", "mooncake_tcp", "--enable-metrics")


@pytest.fixture(scope="module")
def two_dc(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("two_dc")
    line = WanLine(RATE_MBIT, RTT_MS, 0.0, seed=26)
    line.start(log_path=str(log_dir / "wan.log"))
    a, b = line.address("a"), line.address("b")
    model = ensure_tiny_model(TinyModelSpec())
    bootstrap_port = free_port()
    # Bound to the wildcard, as in a datacenter; SGLang's own address comes from the PDD flag
    # (the harness's SGLANG_HOST_IP is cleared).
    common = dict(model_path=model, log_dir=log_dir, host="0.0.0.0", fork_children=True,
                  env={"SGLANG_HOST_IP": ""})

    def server(name, side, *args):
        return NetnsServer(name, exec_prefix=tuple(line.exec_prefix(side)),
                           netns=line.namespace(side), extra_args=(*args, *TRANSPORT), **common)

    servers = [
        server("prefill", "a", "--pdd-role", "prefill", "--pdd-advertise-host", a,
               "--disaggregation-bootstrap-port", str(bootstrap_port), *line.prefill_flags()),
        server("relay", "a", "--pdd-role", "relay", "--pdd-advertise-host", a, *RELAY_CPU_ARGS),
        server("main", "b", "--pdd-role", "main", "--pdd-advertise-host", b),
    ]
    cluster = router = None
    try:
        cluster = Cluster(servers).__enter__()
        prefill, relay, main = servers
        router = RouterProcess(log_dir / "router.log", [
            "--prefill", f"http://{a}:{prefill.port}", str(bootstrap_port),
            "--relay", f"http://{a}:{relay.port}", "--main", f"http://{b}:{main.port}",
            "--wan-gbps", repr(ROUTER_WAN_GBPS), "--wan-rtt-ms", "0",
            "--health-interval-s", "1"],
            exec_prefix=line.exec_prefix("a"), netns_name=line.namespace("a"))
        router.start()
        yield {"line": line, "a": a, "b": b, "router": router, "prefill": prefill,
               "relay": relay, "main": main}
    finally:
        for step in (lambda: router and router.stop(), lambda: cluster and cluster.stop(),
                     lambda: [s.stop(grace_s=5.0) for s in servers], line.stop):
            try:
                step()
            except Exception:  # noqa: BLE001 - every piece gets its chance to stop
                pass


def total(text: str, name: str, **labels) -> float:
    """Sum of the samples of ``name`` (exactly that series name) with ``labels``."""
    out = 0.0
    for line in text.splitlines():
        series = line.split("{", 1)[0].split(" ", 1)[0]
        if series == name and all(f'{k}="{v}"' in line for k, v in labels.items()):
            out += float(line.rsplit(" ", 1)[1])
    return out


def server_text(server: NetnsServer) -> str:
    with in_namespace(server.netns):
        with urllib.request.urlopen(server.url + "/metrics", timeout=30) as resp:
            return resp.read().decode()


def post_router(router: RouterProcess, body: dict) -> dict:
    request = urllib.request.Request(router.url + "/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", **router.headers})
    with in_namespace(router.netns):
        with urllib.request.urlopen(request, timeout=300) as resp:
            assert resp.status == 200
            return json.loads(resp.read())


def test_a_handoff_across_the_line_at_advertised_addresses_moves_the_metrics(two_dc):
    a, b, router = two_dc["a"], two_dc["b"], two_dc["router"]
    prefill, relay, main = two_dc["prefill"], two_dc["relay"], two_dc["main"]
    # What each server advertises: its datacenter's address, never the wildcard or 127.0.x.
    assert relay.pdd_state()["handoff"]["control_address"] == f"tcp://{a}:{DEFAULT_CONTROL_PORT}"
    assert prefill.get_json("/server_info")["pdd_advertise_host"] == a
    assert main.pdd_state()["mooncake_session"].startswith(f"{b}:")
    assert f"Mooncake tcp engine {a}:" in prefill.log_path.read_text(errors="replace")

    names = ("prefill", "relay", "main")
    before = {n: server_text(two_dc[n]) for n in names}
    router_before = router.get_text("/metrics")
    outcomes = []
    for attempt in range(3):  # main must be ready before the relay is done: a race (see below)
        prompt = [FIRST_WORD_ID + (26 * 131 + attempt * 977 + i * 7) % WORDS
                  for i in range(PROMPT_TOKENS)]
        answer = post_router(router, {"input_ids": prompt, "sampling_params": {
            "temperature": 0, "max_new_tokens": ANSWER_TOKENS, "ignore_eos": True}})
        pdd = answer["meta_info"]["pdd"]
        assert pdd["pipeline"] == "prefill_relay_main", pdd
        assert len(answer["output_ids"]) == ANSWER_TOKENS
        outcomes.append(pdd["outcome"])
        if pdd["outcome"] == "handoff":
            break
    # Whether main's copy lands before the relay has decoded 800 tokens is a race the system may
    # lose (the relay then answers alone); one of three prompts must hand off.
    assert outcomes[-1] == "handoff", outcomes

    def moved(text_now: dict, name: str, server: str, **labels) -> float:
        return total(text_now[server], name, **labels) - total(before[server], name, **labels)

    deadline = time.monotonic() + 15  # the prefill's figures are exported once a second
    while True:
        after = {n: server_text(two_dc[n]) for n in names}
        if moved(after, "sglang:pdd_wan_sent_bytes_total", "prefill") > 0 or \
                time.monotonic() > deadline:
            break
        time.sleep(1)
    uncached_bytes = (PROMPT_TOKENS - 1) * 512  # the tiny model's KV per token, float32
    # The line counts wire bytes: a coded copy (--pdd-wan-kv-codec auto) carries its KV in fewer.
    ratio = total(after["prefill"], "sglang:pdd_wan_kv_codec_ratio") or 1.0
    assert moved(after, "sglang:pdd_wan_sent_bytes_total", "prefill") * ratio >= uncached_bytes, (
        after["prefill"])
    assert moved(after, "sglang:pdd_kv_transfer_bytes_total", "prefill", role="main") > 0
    assert total(after["prefill"], "sglang:pdd_wan_rate_bytes_per_second") > 0
    assert "sglang:pdd_wan_queued_bytes" in after["prefill"]
    assert moved(after, "sglang:pdd_handoffs_total", "relay") >= 1
    assert moved(after, "sglang:pdd_handoff_chunks_total", "relay") >= 1
    assert moved(after, "sglang:pdd_handoff_tokens_total", "relay") > 0
    assert moved(after, "sglang:pdd_handoff_events_total", "relay", event="handed_off") >= 1
    assert moved(after, "sglang:pdd_handoff_latency_seconds_count", "main") >= 1
    assert moved(after, "sglang:pdd_handoff_duration_seconds_count", "main") >= 1
    assert "sglang:num_running_reqs" in after["main"]  # SGLang's own series beside PDD's

    router_after = router.get_text("/metrics")
    placed = (total(router_after, "pdd_router_placements_total",
                    reason="wan_above_hide_threshold")
              - total(router_before, "pdd_router_placements_total",
                      reason="wan_above_hide_threshold"))
    assert placed == len(outcomes)
    ratios = (total(router_after, "pdd_router_wan_time_predicted_over_actual_count")
              - total(router_before, "pdd_router_wan_time_predicted_over_actual_count"))
    assert ratios >= 1
    for name in names:
        pool = two_dc[name].wait_idle(60)
        assert pool["in_use_tokens"] == 0 and pool["locked_tokens"] == 0, (name, pool)


def test_a_sigterm_to_each_process_group_closes_pdd(two_dc):
    """systemd's default KillMode=control-group: SIGTERM to every process of the server."""
    two_dc["router"].stop()  # its health polls would only log the servers going
    seconds = {}
    for name in ("relay", "main", "prefill"):
        server = two_dc[name]
        server.wait_idle(60)
        pgid = server.process.pid
        started = time.monotonic()
        os.killpg(pgid, signal.SIGTERM)
        server.process.wait(120)
        seconds[name] = round(time.monotonic() - started, 2)
        deadline = time.monotonic() + 30
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _group_alive(pgid), f"{name}: processes of its group outlived it"
        log = server.log_path.read_text(errors="replace")
        assert "PDD: closed on scheduler exit; PDD threads left: none" in log, (
            name, log[-3000:])
    print("group SIGTERM, seconds to exit per role:", seconds)


def _group_alive(pgid: int) -> bool:
    """A live (not zombie) process in group ``pgid``."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False
