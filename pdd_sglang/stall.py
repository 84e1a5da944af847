"""A PDD scheduler with nothing to run but work in flight waits instead of spinning.

SGLang's ``Scheduler.on_idle`` returns at once when the scheduler is not fully idle (a request
waits on a KV transfer, a bootstrap, or a handoff), so its loop spins, one core per server, for
as long as a WAN copy is on the line (issue 16: prefill ran at 0.9 core while its copies
crossed). Patch 0011 calls :meth:`StallWait.wait` there on PDD servers: it blocks on the
scheduler's input sockets (a new request wakes it at once) for a pause that doubles from
:data:`FIRST_PAUSE_S` to :data:`LONGEST_PAUSE_S` while nothing changes, and starts short again
as soon as the scheduler makes progress (a forward ran, a queue changed). A transfer that lands
is noticed at most :data:`LONGEST_PAUSE_S` late.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

FIRST_PAUSE_S = 0.0005
LONGEST_PAUSE_S = 0.02


class StallWait:
    def __init__(self, scheduler: Any, sleep: Callable[[float], None] = time.sleep):
        self.scheduler = scheduler
        self.pause_s = FIRST_PAUSE_S
        self._progress: Optional[tuple] = None
        self._poller = _input_poller(scheduler)
        self._sleep = sleep

    def progress(self) -> tuple:
        """What changes when the scheduler gets somewhere: forwards run, queue lengths."""
        s = self.scheduler
        queues = (getattr(s, "waiting_queue", None), getattr(s, "disagg_prefill_inflight_queue", None),
                  getattr(getattr(s, "disagg_prefill_bootstrap_queue", None), "queue", None),
                  getattr(getattr(s, "disagg_decode_prealloc_queue", None), "queue", None),
                  getattr(getattr(s, "disagg_decode_transfer_queue", None), "queue", None))
        return (getattr(s, "forward_ct", 0), *(len(q) if q is not None else -1 for q in queues))

    def wait(self) -> float:
        """Wait for input or the current pause; returns the pause used."""
        now = self.progress()
        if now != self._progress:
            self._progress, self.pause_s = now, FIRST_PAUSE_S
        pause = self.pause_s
        if self._poller is not None:
            self._poller.poll(pause * 1e3)
        else:
            self._sleep(pause)
        self.pause_s = min(pause * 2, LONGEST_PAUSE_S)
        return pause


def _input_poller(scheduler: Any) -> Optional[Any]:
    """A zmq poller on the scheduler's input sockets, or None (then a plain sleep)."""
    import zmq

    channels = getattr(scheduler, "ipc_channels", None)
    sockets = [getattr(channels, name, None) for name in ("recv_from_tokenizer", "recv_from_rpc")]
    sockets = [s for s in sockets if isinstance(s, zmq.Socket)]
    if not sockets:
        return None
    poller = zmq.Poller()
    for socket in sockets:
        poller.register(socket, zmq.POLLIN)
    return poller


def stall_wait_for(scheduler: Any) -> StallWait:
    waiter = getattr(scheduler, "_pdd_stall_wait", None)
    if waiter is None:
        waiter = scheduler._pdd_stall_wait = StallWait(scheduler)
    return waiter
