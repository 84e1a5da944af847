"""``--workers N``: N router processes on one port, started and stopped as one router.

Life cycle:

1. The supervisor (the process the operator started) makes a Unix socket pair for each pair of
   workers (the bus of router/shared_state.py) and a pipe, then forks the workers, before it
   has run any event loop or thread.
2. Each worker keeps only its own sockets, runs a RouterService of its own (its servers' health
   and roles, polled once per interval as one router does; its tokenizer; its replica of the
   shared tables) and listens on the port with SO_REUSEPORT, so the kernel spreads connections
   over the workers. It writes a byte on the pipe once it listens.
3. Once every worker listens, the supervisor logs ``PDD router listening on ...``; each worker
   then learns its servers and the model, and its ``/ready`` says when it serves.
4. SIGTERM or SIGINT to the supervisor goes on to every worker, which stops as one router does;
   the supervisor exits 0 once all have. A worker that exits on its own stops the others (its
   copies still open in their replicas would never end) and the supervisor exits 1.

Owner of the worker table (pids): the supervisor, single-threaded.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import socket
from typing import Callable

logger = logging.getLogger("pdd_sglang.router")

# serve_worker(index, sockets to the other workers, the pipe's write end): run one worker
WorkerMain = Callable[[int, list, int], None]


def _pairs(count: int) -> dict[tuple[int, int], tuple[socket.socket, socket.socket]]:
    return {(i, j): socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            for i in range(count) for j in range(i + 1, count)}


def _fork_worker(index: int, pairs: dict, ready_w: int, serve_worker: WorkerMain) -> int:
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)  # the worker's loop installs its own
        mine = [pair[0] if i == index else pair[1] for (i, j), pair in pairs.items()
                if index in (i, j)]
        for (i, j), pair in pairs.items():
            if index not in (i, j):
                for sock in pair:
                    sock.close()
            else:
                pair[1 if i == index else 0].close()
        serve_worker(index, mine, ready_w)
        code = 0
    except BaseException:  # noqa: BLE001 - the worker's own failure: logged, then its status
        logger.exception("PDD router worker %d failed", index)
    finally:
        os._exit(code)


def run_workers(count: int, serve_worker: WorkerMain, listening: str) -> int:
    """Fork ``count`` workers and supervise them; the exit status. ``listening`` is logged once
    every worker listens."""
    pairs = _pairs(count)
    ready_r, ready_w = os.pipe()
    workers = {_fork_worker(index, pairs, ready_w, serve_worker): index
               for index in range(count)}
    for pair in pairs.values():
        for sock in pair:
            sock.close()
    os.close(ready_w)
    stopping = False

    def stop(signum, frame) -> None:
        nonlocal stopping
        stopping = True
        _signal_all(workers, signal.SIGTERM)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    status = _wait_until_listening(workers, ready_r, count, listening)
    stopping = stopping or status != 0
    while workers:
        pid, code = os.waitpid(-1, 0)
        index = workers.pop(pid, None)
        if index is None:
            continue
        failed = os.waitstatus_to_exitcode(code) != 0
        if not stopping:
            logger.error("PDD router worker %d exited (status %d): stopping the others", index,
                         os.waitstatus_to_exitcode(code))
            stopping, status = True, 1
            _signal_all(workers, signal.SIGTERM)
        elif failed:
            status = 1
    os.close(ready_r)
    return status


def _wait_until_listening(workers: dict, ready_r: int, count: int, listening: str) -> int:
    """Log ``listening`` once every worker said it listens; 1 if one exited first, else 0."""
    ready = 0
    while ready < count:
        readable, _, _ = select.select([ready_r], [], [], 0.5)
        if readable:
            got = os.read(ready_r, count)
            if not got:  # every worker closed the pipe: they have all exited
                return 1
            ready += len(got)
        pid, code = os.waitpid(-1, os.WNOHANG)
        if pid:
            index = workers.pop(pid, None)
            logger.error("PDD router worker %s exited before it listened", index)
            _signal_all(workers, signal.SIGTERM)
            return 1
    logger.info("%s", listening)
    return 0


def _signal_all(workers: dict, sig: int) -> None:
    for pid in workers:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
