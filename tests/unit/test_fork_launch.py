"""fork_launch forks a server's children only while the launcher has one thread; a child started
beside another thread is spawned, as SGLang would, and says so in the log."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from pdd_sglang.dev.testing.fork_launch import SPAWNED_INSTEAD

REPO = Path(__file__).resolve().parents[2]

# The launcher's side, as fork_launch.main() sets it up; each child exits 0 if it inherited the
# launcher's memory (forked), 3 if it started from scratch (spawned).
LAUNCHER = textwrap.dedent("""
    import multiprocessing, sys, threading, time
    from multiprocessing import process
    from pdd_sglang.dev.testing import fork_launch

    INHERITED = []

    def child():
        sys.exit(0 if INHERITED else 3)

    def start_one():
        proc = multiprocessing.Process(target=child, name="child")
        proc.start()
        proc.join(60)
        return {0: "forked", 3: "spawned"}.get(proc.exitcode, proc.exitcode)

    if __name__ == "__main__":
        multiprocessing.set_start_method = fork_launch._fork_instead_of_spawn
        process.BaseProcess.start = fork_launch._start_forked_while_single_threaded
        multiprocessing.set_start_method("spawn", force=True)  # what SGLang asks for
        INHERITED.append(1)
        alone = start_one()
        stop = threading.Event()
        other = threading.Thread(target=stop.wait)
        other.start()
        beside_a_thread = start_one()
        stop.set()
        other.join()
        # join() returns once the thread's Python state is released; the kernel drops its task
        # from /proc/self/task a moment later, so wait for that rather than race it.
        deadline = time.monotonic() + 10
        while fork_launch._threads() > 1 and time.monotonic() < deadline:
            time.sleep(0.001)
        after = start_one()
        print(alone, beside_a_thread, after)
""")


def test_children_fork_while_the_launcher_is_single_threaded_and_spawn_beside_a_thread(tmp_path):
    script = tmp_path / "launcher.py"
    script.write_text(LAUNCHER)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["forked", "spawned", "forked"], (done.stdout, done.stderr)
    marks = [line for line in done.stderr.splitlines() if line.startswith(SPAWNED_INSTEAD)]
    assert marks == [f"{SPAWNED_INSTEAD} child (2 threads in the launcher)"], done.stderr
