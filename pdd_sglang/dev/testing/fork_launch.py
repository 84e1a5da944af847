"""``python -m pdd_sglang.dev.testing.fork_launch ARGS``: ``sglang.launch_server ARGS`` whose
scheduler and detokenizer are forked from the launcher instead of spawned. Test servers only.

Why: SGLang sets the ``spawn`` start method (CUDA cannot be forked), so each of a server's three
processes imports torch, transformers and sglang again: on this 2-core CPU machine about 35
CPU-seconds and 2.2 GB (PSS) per server, against 15 CPU-seconds and 1.3 GB forked (measured on a
plain tiny-model server: same greedy tokens). A test suite that starts some twenty servers spends
most of its time there.

What stays as SGLang runs it: every line of SGLang and PDD code in every process, the servers'
arguments and ports, their ZMQ sockets, Mooncake, signals and cgroups. What differs: a forked
child inherits the launcher's memory instead of rebuilding its state from pickled arguments, so a
bug that only ``spawn`` shows (an argument that does not pickle, state the child must re-derive)
cannot show here. That is why servers that are not started through this module still run with
``spawn`` in the suite: the fault suite's three roles and their restarts, the no-role pair, the
pristine reference, and ``make demo`` itself.

Forking is safe only while the launcher has a single thread (another thread's lock would stay
held in the child forever); SGLang starts both children before it starts any thread, and a child
started later than that is spawned as SGLang would, with a line in the log saying so.
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import sys
from multiprocessing import process

# Starts the log line of a child spawned instead (SGLangServer.wait_ready warns of it).
SPAWNED_INSTEAD = "fork_launch: spawned instead of forked:"

_set_start_method = multiprocessing.set_start_method
_start = process.BaseProcess.start


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _fork_instead_of_spawn(method, force=False):
    _set_start_method("fork" if method == "spawn" else method, force=force)


def _start_forked_while_single_threaded(self):
    if multiprocessing.get_start_method(allow_none=True) != "fork" or _threads() == 1:
        return _start(self)
    print(f"{SPAWNED_INSTEAD} {self.name} ({_threads()} threads in the launcher)",
          file=sys.stderr, flush=True)
    _set_start_method("spawn", force=True)
    try:
        return _start(self)
    finally:
        _set_start_method("fork", force=True)


def main() -> None:
    multiprocessing.set_start_method = _fork_instead_of_spawn
    process.BaseProcess.start = _start_forked_while_single_threaded
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
