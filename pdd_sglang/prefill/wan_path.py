"""Prefill's WAN path: its own Mooncake engine and transfer workers, and the relay/main watchdog.

Started once per PDD prefill KV manager (patch 0007 calls :func:`start_wan_path` through
``pdd_sglang.hooks``, only with ``--pdd-role prefill``). The workers run SGLang's own transfer
loop, fed by this path's queues, so there is one implementation of sending;
:class:`~pdd_sglang.prefill.fanout.PrefillFanout` decides which chunk goes where.

:class:`WanPath` owns every thread and the engine it starts, and :meth:`WanPath.close` (called on
SGLang's scheduler shutdown, :mod:`pdd_sglang.lifecycle`) stops them: a sentinel to each WAN
queue, a stop job to the housekeeping thread, joins with a timeout, then the engine.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Optional

from pdd_sglang.lifecycle import name_os_thread
from pdd_sglang.prefill.fanout import PrefillFanout, logger
from pdd_sglang.prefill.wan_line import ChargedQueue

WAN_WORKERS = 4
WATCHDOG_PERIOD_S = 0.25
JOIN_TIMEOUT_S = 2.0
_STOP = object()


class WanPath:
    """The WAN workers, the watchdog and the WAN engine of one prefill KV manager."""

    def __init__(self, fanout: PrefillFanout):
        self.fanout = fanout
        self.threads: list[threading.Thread] = []
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        fanout.defer = self._jobs.put

    def start(self, kv_mgr: Any, workers: int, delay_s: float) -> None:
        from sglang.srt.disaggregation.common.utils import FastQueue

        self._spawn("pdd-keeper", self._housekeeping)
        for index in range(workers):
            inner = FastQueue() if delay_s <= 0 else _DelayedQueue(FastQueue(), delay_s)
            wan_queue = ChargedQueue(inner, self.fanout.wan_line)
            self.fanout.wan_queues.append(wan_queue)
            self._spawn(f"pdd-wan-xfer-{index}", _run_wan_worker, kv_mgr, wan_queue, index)

    def _spawn(self, name: str, target, *args) -> None:
        def run() -> None:
            name_os_thread(name)
            target(*args)

        thread = threading.Thread(target=run, daemon=True, name=name)
        thread.start()
        self.threads.append(thread)

    def _housekeeping(self) -> None:
        """Deferred jobs (sends that must not run under SGLang's locks) as they come, and the
        relay/main watchdog every WATCHDOG_PERIOD_S."""
        next_watch = time.monotonic() + WATCHDOG_PERIOD_S
        while True:
            try:
                job = self._jobs.get(timeout=max(next_watch - time.monotonic(), 0))
            except queue.Empty:
                job = None
            if job is _STOP:
                return
            try:
                if job is not None:
                    job()
                if time.monotonic() >= next_watch:
                    next_watch = time.monotonic() + WATCHDOG_PERIOD_S
                    self.fanout.drop_silent_relays()
                    self.fanout.drop_silent_mains()
            except Exception:  # housekeeping must outlive one bad room
                logger.exception("PDD: prefill housekeeping failed")

    def close(self, timeout_s: float = JOIN_TIMEOUT_S) -> list[str]:
        """Stop every thread and close the engine; the names of threads still alive after it."""
        self._jobs.put(_STOP)
        if self.fanout.wan_engine is not None:
            self.fanout.wan_engine.stop_waiting()
        for wan_queue in self.fanout.wan_queues:
            wan_queue.stop()
        deadline = time.monotonic() + timeout_s
        for thread in self.threads:
            thread.join(max(deadline - time.monotonic(), 0))
        left = [t.name for t in self.threads if t.is_alive()]
        if self.fanout.wan_engine is not None:
            self.fanout.wan_engine.close()
        if left:
            logger.warning("PDD: prefill WAN path closed; still running after %.1f s: %s",
                           timeout_s, ", ".join(left))
        else:
            logger.info("PDD: prefill WAN path closed (workers, watchdog and engine)")
        return left


def start_wan_path(kv_mgr: Any, args: Optional[Any] = None) -> WanPath:
    """Attach a fan-out to a PDD prefill KV manager and start its WAN path."""
    from sglang.srt.runtime_context import get_server_args

    from pdd_sglang.prefill.wan_engine import open_wan_engine

    args = get_server_args() if args is None else args
    fanout = PrefillFanout(kv_mgr)
    fanout.relay_bootstrap_timeout_s = float(args.pdd_relay_bootstrap_timeout)
    fanout.main_bootstrap_timeout_s = float(args.pdd_main_bootstrap_timeout)
    fanout.wan_engine = open_wan_engine(
        kv_mgr, args.pdd_wan_transfer_protocol, args.pdd_wan_ib_device,
        timeout_s=float(args.pdd_wan_transfer_timeout), line=fanout.wan_line,
        blocking_wait=bool(args.pdd_debug_wan_blocking_wait))
    path = WanPath(fanout)
    kv_mgr.pdd_fanout = fanout
    kv_mgr.pdd_wan_path = path
    path.start(kv_mgr, WAN_WORKERS, float(args.pdd_debug_wan_delay_ms or 0) / 1e3)
    return path


class _DelayedQueue:
    """Test-only (--pdd-debug-wan-delay-ms): every WAN chunk waits before it is sent, so the
    relay reliably runs ahead of main (forced handoff points, the singular filter)."""

    def __init__(self, inner: Any, delay_s: float):
        self.inner = inner
        self.delay_s = delay_s

    def put(self, item: Any) -> None:
        self.inner.put(item)

    def get(self) -> Any:
        item = self.inner.get()
        if item is not None:
            time.sleep(self.delay_s)
        return item


def _run_wan_worker(kv_mgr: Any, wan_queue: ChargedQueue, index: int) -> None:
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"pdd-wan-layers-{index}") as executor:
        # SGLang's own transfer loop, fed by this path's queue: one implementation of sending.
        # It returns on the None sentinel that WanPath.close puts on the queue.
        kv_mgr.transfer_worker(wan_queue, executor, None, 1000 + index)
