"""What runs under a server's process tree, read from /proc: its threads, their names and CPU.

For tests (no PDD thread left after shutdown, none without a role) and benchmarks (CPU per
thread while a copy is in flight)."""

from __future__ import annotations

import os

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def tree_threads(root_pid: int) -> dict:
    """``{(pid, tid): (thread name, CPU seconds)}`` of every thread under ``root_pid``."""
    threads, stack, seen = {}, [root_pid], set()
    while stack:
        pid = stack.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                base = f"/proc/{pid}/task/{tid}"
                with open(f"{base}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                with open(f"{base}/comm") as f:
                    name = f.read().strip()
                threads[(pid, int(tid))] = (name + (" (main)" if int(tid) == pid else ""),
                                            (int(fields[11]) + int(fields[12])) / CLOCK_TICKS)
                with open(f"{base}/children") as f:
                    stack.extend(int(c) for c in f.read().split())
        except (FileNotFoundError, ProcessLookupError):
            continue
    return threads


def tree_cpu_s(root_pid: int) -> float:
    """User + system CPU seconds of every live thread under ``root_pid``."""
    return sum(cpu for _, cpu in tree_threads(root_pid).values())


def pdd_thread_names(root_pid: int) -> list[str]:
    """The names of the PDD threads (``pdd-*``) under ``root_pid``, sorted."""
    return sorted(name for name, _ in tree_threads(root_pid).values() if name.startswith("pdd-"))
