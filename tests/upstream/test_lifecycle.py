"""Issue 14: PDD costs nothing without ``--pdd-role``, and every role shuts down cleanly.

* (A patched server without a role: ``tests/integration/test_no_role.py``, beside the shared
  cluster's pristine reference. Each role's shutdown is tested on the last shared cluster:
  ``tests/integration/test_shutdown.py``.)
* The router exits on SIGINT and SIGTERM with status 0 and no traceback.

"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdd_sglang.dev.testing.cluster import free_port

REPO = Path(__file__).resolve().parents[2]

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
