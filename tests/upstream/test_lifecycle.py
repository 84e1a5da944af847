"""Issue 14: PDD costs nothing without ``--pdd-role``, and every role shuts down cleanly.

* A patched server without a role (a plain PD pair, the case where PDD used to start its WAN
  workers anyway) has no PDD thread and no ``pdd`` state, and its greedy outputs equal those of
  the pristine wheel (a scratch copy reverted by apply_patches, never the shared venv).
* (Each role's shutdown is tested on the last shared cluster: ``tests/integration/test_shutdown.py``.)
* The router exits on SIGINT and SIGTERM with status 0 and no traceback.

Every thread PDD starts carries a ``pdd-`` name in the kernel (``/proc/PID/task/TID/comm``), so
these tests see them from outside the server process.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdd_sglang.dev.testing.cluster import RELAY_CPU_ARGS, Cluster, SGLangServer, free_port
from pdd_sglang.dev.testing.pd_client import generate_pd
from pdd_sglang.dev.testing.pristine import pristine_env, pristine_sglang
from pdd_sglang.dev.testing.processes import pdd_thread_names
from pdd_sglang.dev.testing.tiny_model import ensure_tiny_model

REPO = Path(__file__).resolve().parents[2]

TRANSPORT = ("--disaggregation-transfer-backend", "mooncake_tcp")
GREEDY = {"max_new_tokens": 16, "temperature": 0}


def internal_state(server: SGLangServer) -> dict:
    return server.get_json("/server_info")["internal_states"][0]


def prompts(count: int = 3) -> list[list[int]]:
    rng = random.Random(14)
    return [[rng.randrange(10, 1000) for _ in range(rng.randrange(20, 120))] for _ in range(count)]


@pytest.mark.integration
def test_a_patched_server_without_a_role_is_plain_sglang(tmp_path):
    model_path = ensure_tiny_model()
    bootstrap_port = free_port()
    with pristine_sglang() as scratch:
        prefill = SGLangServer("prefill", model_path, tmp_path, extra_args=(
            "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
            str(bootstrap_port), *TRANSPORT))
        decode = SGLangServer("decode", model_path, tmp_path, extra_args=(
            "--disaggregation-mode", "decode", *TRANSPORT, *RELAY_CPU_ARGS))
        pristine = SGLangServer("pristine", model_path, tmp_path, env=pristine_env(scratch))
        with Cluster([prefill, decode, pristine]) as cluster:
            for prompt in prompts():
                body = {"input_ids": prompt, "sampling_params": GREEDY}
                got = generate_pd(prefill, decode, body, bootstrap_port)["output_ids"]
                assert got == pristine.post_json("/generate", body)["output_ids"]
            for server in (prefill, decode):
                assert "pdd" not in internal_state(server), server.name
                assert pdd_thread_names(server.process.pid) == [], server.name
            assert cluster.dead_servers() == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_the_router_exits_on_a_signal_without_a_traceback(sig, tmp_path):
    port = free_port()
    # Upstreams that do not answer: the router waits for them at start-up, where the signal
    # comes (a serving router stops the same way, through the same handler).
    command = [sys.executable, "-m", "pdd_sglang.router", "--prefill",
               f"http://127.0.0.1:{free_port()}", "--main", f"http://127.0.0.1:{free_port()}",
               "--host", "127.0.0.1", "--port", str(port)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    log_path = tmp_path / "router.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while "PDD router starting" not in log_path.read_text(errors="replace"):
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-2000:]
            time.sleep(0.2)
        proc.send_signal(sig)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = log_path.read_bytes()
    text = err.decode(errors="replace")
    assert proc.returncode == 0, text[-3000:]
    assert "Traceback" not in text and "CancelledError" not in text, text[-3000:]
    assert "PDD router stopped" in text
