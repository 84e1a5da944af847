"""The two shared clusters of real SGLang servers on the tiny model (CPU profile), started once.

Every integration test that can share servers uses one of two session-wide PDD clusters (prefill,
relay, main, a second main and a plain single server as the greedy reference); they differ only
in the KV page size, so each check runs where its layout matters:

- ``page1``: page size 1. Behind it runs the PDD router (``router_cluster``); the plain PD pair
  (``pd_pair``) and the two-main affinity test use its prefill and mains.
- ``page16``: page size 16 with chunked prefill of 64 tokens, so a prompt's KV reaches each
  destination in several chunks that do not fall on its prefix.

Per-request test controls travel in the route (forced handoff points, a damaged WAN copy); what
is a server flag here is test-only and inert unless a route asks for it, except the WAN delay on
prefill's path to main (every chunk waits ``WAN_DELAY_MS``, so a relay runs ahead as behind a real
WAN). Servers stop on every exit path; their logs stay in pytest's temporary directory, and a
failing start prints the log tail. The demo and the fault suite start their own servers, in
network namespaces behind the emulated line.
"""

from __future__ import annotations

import pytest

from pdd_sglang.dev.testing.cluster import RELAY_CPU_ARGS, Cluster, SGLangServer, free_port
from pdd_sglang.dev.testing.tiny_model import TinyModelSpec, ensure_tiny_model
from pdd_sglang.dev.testing.wan_cluster import RouterProcess

# Every KV chunk to main waits this long (a test-only WAN delay), so the relay runs ahead.
WAN_DELAY_MS = 300
CATCH_UP_CHUNK = 64

# ---- PDD router ------------------------------------------------------------------------------
# Link parameters that put the P->MD / P->RLD->MD boundary at 100 uncached tokens of the tiny
# model (512 KV bytes/token in float32): 100 tokens x 512 B at 102,400 B/s = 0.5 s, the policy's
# default hide_wan_below_s; RTT 0 so the prompt length alone decides.
ROUTER_RELAY_ABOVE_TOKENS = 100
ROUTER_WAN_GBPS = ROUTER_RELAY_ABOVE_TOKENS * 512 / 0.5 * 8 / 1e9


@pytest.fixture(scope="session")
def tiny_model():
    spec = TinyModelSpec()
    return spec, ensure_tiny_model(spec)


def _pdd_cluster(page_size: int, model_path, log_dir) -> Cluster:
    """Prefill, relay, main, a second main and a plain server; main checks its WAN copy against
    the relay's (``--pdd-enable-kv-digest``) and damages one when its route asks."""
    bootstrap_port = free_port()
    common = ("--disaggregation-transfer-backend", "mooncake_tcp", "--page-size", str(page_size),
              "--pdd-debug-kv-digest")
    chunking = ("--chunked-prefill-size", "64") if page_size > 1 else ()
    main_args = ("--pdd-role", "main", "--enable-metrics", "--pdd-enable-kv-digest",
                 "--pdd-debug-corrupt-wan-kv", *common)
    servers = [
        SGLangServer("prefill", model_path, log_dir, extra_args=(
            "--pdd-role", "prefill", "--disaggregation-bootstrap-port", str(bootstrap_port),
            "--pdd-relay-bootstrap-timeout", "2", "--enable-metrics",
            "--pdd-debug-wan-delay-ms", str(WAN_DELAY_MS), *common, *chunking)),
        SGLangServer("relay", model_path, log_dir, extra_args=(
            "--pdd-role", "relay", "--pdd-debug-handoff-hold", "--pdd-catch-up-chunk",
            str(CATCH_UP_CHUNK), "--enable-metrics", "--pdd-enable-kv-digest", *common,
            *RELAY_CPU_ARGS)),
        SGLangServer("main", model_path, log_dir, extra_args=main_args),
        SGLangServer("main2", model_path, log_dir, extra_args=main_args),
        # The greedy reference: one ordinary SGLang server, no disaggregation.
        SGLangServer("plain", model_path, log_dir, extra_args=("--page-size", str(page_size))),
    ]
    cluster = Cluster(servers)
    cluster.bootstrap_port = bootstrap_port
    cluster.log_dir = log_dir
    cluster.page_size = page_size
    cluster.model_path = model_path
    return cluster


@pytest.fixture(scope="session")
def page1_cluster(tiny_model, tmp_path_factory):
    _, model_path = tiny_model
    with _pdd_cluster(1, model_path, tmp_path_factory.mktemp("page1-logs")) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def page16_cluster(tiny_model, tmp_path_factory):
    _, model_path = tiny_model
    with _pdd_cluster(16, model_path, tmp_path_factory.mktemp("page16-logs")) as cluster:
        yield cluster


@pytest.fixture(scope="session", params=[1, 16], ids=lambda p: f"page{p}")
def three_roles(request):
    """PDD prefill, relay and main (and a plain server) at page size 1 or 16."""
    return request.getfixturevalue(f"page{request.param}_cluster")


@pytest.fixture(scope="session")
def pd_pair(page1_cluster):
    """A PDD prefill and a PDD main, over Mooncake TCP, with main's decode radix cache."""
    return page1_cluster


@pytest.fixture(scope="session")
def router_cluster(page1_cluster):
    """P, RLD and MD of the page-1 cluster behind the PDD router (the plain server beside)."""
    cluster = page1_cluster
    router = RouterProcess(cluster.log_dir / "router.log", [
        "--prefill", cluster["prefill"].url, str(cluster.bootstrap_port),
        "--relay", cluster["relay"].url, "--main", cluster["main"].url,
        "--wan-gbps", repr(ROUTER_WAN_GBPS), "--wan-rtt-ms", "0",
        "--health-interval-s", "1"])
    try:
        router.start()
        cluster.router = router
        yield cluster
    finally:
        router.stop()
        cluster.router = None


# Tests that start servers of their own (the demo and the fault suite in network namespaces, the
# life-cycle and WAN tests) run before the shared clusters start, and the shared clusters' tests
# run last: the machine never holds both sets at once. With both, the kernel's OOM killer took a
# shared cluster's prefill (24 GiB, about 1 GB per CPU server).
OWN_SERVERS = ("test_demo.py", "test_fault_suite.py")


def _order(item) -> int:
    if item.path.name in OWN_SERVERS:
        return 0
    return 2 if item.path.parent.name == "integration" else 1


def pytest_collection_modifyitems(config, items):
    items.sort(key=_order)  # stable: within each group the order pytest chose stays
