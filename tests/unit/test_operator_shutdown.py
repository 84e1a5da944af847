"""A SIGTERM to a PDD server's whole process group reaches its launcher only (issue 26, item 4):
patch 0012 starts the children with SIGTERM ignored, which both start methods keep, and gives
the launcher its own handler back."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PROBE = r'''
import multiprocessing as mp, os, signal, sys
from pdd_sglang import lifecycle

def child(q):
    q.put(signal.getsignal(signal.SIGTERM) == signal.SIG_IGN)

if __name__ == "__main__":
    got = []
    signal.signal(signal.SIGTERM, lambda *a: got.append("launcher"))
    lifecycle.ignore_sigterm_in_children()
    ignored = {}
    for method in ("spawn", "fork"):
        ctx = mp.get_context(method)
        q = ctx.Queue()
        p = ctx.Process(target=child, args=(q,))
        p.start()
        ignored[method] = q.get(timeout=60)
        p.join()
    lifecycle.restore_sigterm()
    os.kill(os.getpid(), signal.SIGTERM)  # systemd stops the unit
    assert got == ["launcher"], got  # the launcher's own handler, as before
    assert ignored == {"spawn": True, "fork": True}, ignored
    print("ok")
'''


def test_children_ignore_sigterm_and_the_launcher_gets_its_handler_back(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          cwd=REPO, timeout=120,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
