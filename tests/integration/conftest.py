"""Shared clusters of real SGLang servers on the tiny model (CPU profile).

Servers start once per module that asks for them and stop on every exit path; their logs stay in
pytest's temporary directory (the last runs are kept), and a failing start prints the log tail.
"""

from __future__ import annotations

import pytest

from pdd_sglang.dev.testing.cluster import RELAY_CPU_ARGS, Cluster, SGLangServer, free_port
from pdd_sglang.dev.testing.wan_cluster import RouterProcess
from pdd_sglang.dev.testing.tiny_model import TinyModelSpec, ensure_tiny_model


@pytest.fixture(scope="session")
def tiny_model():
    spec = TinyModelSpec()
    return spec, ensure_tiny_model(spec)


@pytest.fixture(scope="module")
def pd_pair(tiny_model, tmp_path_factory):
    """A PDD prefill and a PDD main, over Mooncake TCP, with main's decode radix cache."""
    _, model_path = tiny_model
    log_dir = tmp_path_factory.mktemp("pd-pair-logs")
    bootstrap_port = free_port()
    transport = ("--disaggregation-transfer-backend", "mooncake_tcp")
    prefill = SGLangServer(
        "prefill", model_path, log_dir,
        extra_args=("--pdd-role", "prefill", "--disaggregation-bootstrap-port",
                    str(bootstrap_port), *transport),
    )
    main = SGLangServer("main", model_path, log_dir, extra_args=("--pdd-role", "main", *transport))
    with Cluster([prefill, main]) as cluster:
        cluster.bootstrap_port = bootstrap_port
        cluster.log_dir = log_dir
        yield cluster


# Every KV chunk to main waits this long (a test-only WAN delay), so the relay runs ahead.
WAN_DELAY_MS = 300
CATCH_UP_CHUNK = 64


@pytest.fixture(scope="session", params=[1, 16], ids=lambda p: f"page{p}")
def three_roles(request, tiny_model, tmp_path_factory):
    """PDD prefill, relay and main on one machine, over Mooncake TCP, plus a plain server.

    Two variants: page size 1, and page size 16 with chunked prefill of 64 tokens, so that a
    prompt's KV reaches each destination in several chunks that do not fall on its prefix. The
    WAN path to main gets a test-only delay, and the relay honours forced handoff points. Relay
    and main check main's WAN copy against the relay's (``--pdd-enable-kv-digest``), and main
    damages a request's copy when its route asks (``--pdd-debug-corrupt-wan-kv``).
    """
    page_size = request.param
    _, model_path = tiny_model
    log_dir = tmp_path_factory.mktemp(f"three-roles-page{page_size}-logs")
    bootstrap_port = free_port()
    common = ("--disaggregation-transfer-backend", "mooncake_tcp", "--page-size", str(page_size),
              "--pdd-debug-kv-digest")
    chunking = ("--chunked-prefill-size", "64") if page_size > 1 else ()
    servers = [
        SGLangServer("prefill", model_path, log_dir, extra_args=(
            "--pdd-role", "prefill", "--disaggregation-bootstrap-port", str(bootstrap_port),
            "--pdd-relay-bootstrap-timeout", "2", "--enable-metrics",
            "--pdd-debug-wan-delay-ms", str(WAN_DELAY_MS), *common, *chunking)),
        SGLangServer("relay", model_path, log_dir, extra_args=(
            "--pdd-role", "relay", "--pdd-debug-handoff-hold", "--pdd-catch-up-chunk",
            str(CATCH_UP_CHUNK), "--enable-metrics", "--pdd-enable-kv-digest", *common,
            *RELAY_CPU_ARGS)),
        SGLangServer("main", model_path, log_dir, extra_args=(
            "--pdd-role", "main", "--enable-metrics", "--pdd-enable-kv-digest",
            "--pdd-debug-corrupt-wan-kv", *common)),
        # The greedy reference: one ordinary SGLang server, no disaggregation.
        SGLangServer("plain", model_path, log_dir, extra_args=("--page-size", str(page_size))),
    ]
    with Cluster(servers) as cluster:
        cluster.bootstrap_port = bootstrap_port
        cluster.log_dir = log_dir
        cluster.page_size = page_size
        yield cluster


# ---- PDD router ------------------------------------------------------------------------------
# Link parameters that put the P->MD / P->RLD->MD boundary at 100 uncached tokens of the tiny
# model (512 KV bytes/token in float32): 100 tokens x 512 B at 102,400 B/s = 0.5 s, the policy's
# default hide_wan_below_s; RTT 0 so the prompt length alone decides.
ROUTER_RELAY_ABOVE_TOKENS = 100
ROUTER_WAN_GBPS = ROUTER_RELAY_ABOVE_TOKENS * 512 / 0.5 * 8 / 1e9


@pytest.fixture(scope="module")
def router_cluster(tiny_model, tmp_path_factory):
    """P, RLD and MD behind the PDD router, plus a plain single server as the greedy reference."""
    _, model_path = tiny_model
    log_dir = tmp_path_factory.mktemp("router-logs")
    bootstrap_port = free_port()
    transport = ("--disaggregation-transfer-backend", "mooncake_tcp")
    servers = [
        SGLangServer("prefill", model_path, log_dir, extra_args=(
            "--pdd-role", "prefill", "--disaggregation-bootstrap-port", str(bootstrap_port),
            *transport)),
        SGLangServer("relay", model_path, log_dir, extra_args=(
            "--pdd-role", "relay", *transport, *RELAY_CPU_ARGS)),
        SGLangServer("main", model_path, log_dir, extra_args=("--pdd-role", "main", *transport)),
        SGLangServer("plain", model_path, log_dir),
    ]
    with Cluster(servers) as cluster:
        router = RouterProcess(log_dir / "router.log", [
            "--prefill", cluster["prefill"].url, str(bootstrap_port),
            "--relay", cluster["relay"].url, "--main", cluster["main"].url,
            "--wan-gbps", repr(ROUTER_WAN_GBPS), "--wan-rtt-ms", "0",
            "--health-interval-s", "1"])
        try:
            router.start()
            cluster.router = router
            cluster.bootstrap_port = bootstrap_port
            cluster.log_dir = log_dir
            cluster.model_path = model_path
            yield cluster
        finally:
            router.stop()
