"""Each role, stopped the way an operator stops SGLang (SIGTERM to the server process), closes its
PDD owners on the scheduler's shutdown path and reports no PDD thread left (issue 14).

It stops the servers of the shared page-16 cluster, so it runs last (``conftest.py`` orders it
there); the cluster's teardown then stops what is left.
"""

from __future__ import annotations

import json
import random
import signal
import time

import pytest

from pdd_sglang.dev.testing.cluster import SGLangServer
from pdd_sglang.dev.testing.pd_client import generate_pdd

from pdd_sglang.dev.testing.processes import pdd_thread_names

GREEDY = {"max_new_tokens": 16, "temperature": 0}


def stop_like_an_operator(server: SGLangServer, timeout_s: float = 60.0) -> float:
    """SIGTERM to the server's own process (SGLang drains, then sends its schedulers a
    ShutdownReq): the seconds until it exited."""
    started = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    server.process.wait(timeout_s)
    return time.monotonic() - started


@pytest.mark.integration
def test_every_role_closes_its_pdd_threads_on_shutdown(page16_cluster, tmp_path):
    cluster = page16_cluster
    prefill, relay, main = (cluster[n] for n in ("prefill", "relay", "main"))
    rng = random.Random(14)
    body = {"input_ids": [rng.randrange(10, 1000) for _ in range(60)], "sampling_params": GREEDY}
    generate_pdd(prefill, relay, main, body, cluster.bootstrap_port, keep_main_copy=True)
    # While it serves, the prefill's fan-out runs under PDD's names (the test can see them; the
    # kernel keeps 15 characters of a name: "pdd-local-xfer-0" shows as "pdd-local-xfer-").
    assert {"pdd-fanout", "pdd-peer-io", "pdd-local-xfer-", "pdd-wan-xfer-0", "pdd-line-report"} <= set(
        pdd_thread_names(prefill.process.pid))
    seconds = {}
    for server in (relay, main, prefill):
        server.wait_idle(60)
        seconds[server.name] = stop_like_an_operator(server)
        log = server.log_path.read_text(errors="replace")
        assert "PDD: closed on scheduler exit; PDD threads left: none" in log, server.name
    assert "PDD: prefill closed (owner, senders, peer thread and WAN engine)" in (
        prefill.log_path.read_text(errors="replace"))
    figures = {k: round(v, 2) for k, v in seconds.items()}
    print("shutdown seconds per role:", figures)
    (tmp_path / "shutdown_seconds.json").write_text(json.dumps(figures))
