"""Issue 14: a patched server without ``--pdd-role`` is plain SGLang.

A plain PD pair of the patched venv (the case where PDD used to start its WAN workers anyway) has
no PDD thread and no ``pdd`` state, and its greedy outputs equal those of the session's reference,
a single server of the pristine wheel (a scratch copy reverted by apply_patches, never the shared
venv; ``conftest.py``). The pair's two servers start beside the page-16 tests, while those
mostly wait on their WAN delay (``conftest.py``).

Every thread PDD starts carries a ``pdd-`` name in the kernel (``/proc/PID/task/TID/comm``), so
the test sees them from outside the server process.
"""

from __future__ import annotations

import random

from pdd_sglang.dev.testing.cluster import SGLangServer
from pdd_sglang.dev.testing.pd_client import generate_pd
from pdd_sglang.dev.testing.processes import pdd_thread_names

GREEDY = {"max_new_tokens": 16, "temperature": 0}


def internal_state(server: SGLangServer) -> dict:
    return server.get_json("/server_info")["internal_states"][0]


def prompts(count: int = 3) -> list[list[int]]:
    rng = random.Random(14)
    return [[rng.randrange(10, 1000) for _ in range(rng.randrange(20, 120))] for _ in range(count)]


def test_a_patched_server_without_a_role_is_plain_sglang(page16_cluster, shared_clusters):
    pristine = page16_cluster["plain"]  # the session's reference, at SGLang's default page size
    assert "pdd" not in internal_state(pristine)
    # Started beside the page-16 tests (conftest.py: _no_role_pair); stopped here.
    cluster = shared_clusters.take_beside("no_role")
    try:
        prefill, decode = cluster["prefill"], cluster["decode"]
        for prompt in prompts():
            body = {"input_ids": prompt, "sampling_params": GREEDY}
            got = generate_pd(prefill, decode, body, cluster.bootstrap_port)["output_ids"]
            assert got == pristine.post_json("/generate", body)["output_ids"]
        for server in (prefill, decode):
            assert "pdd" not in internal_state(server), server.name
            assert pdd_thread_names(server.process.pid) == [], server.name
        assert cluster.dead_servers() == []
    finally:
        cluster.stop()
