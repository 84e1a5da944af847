"""Prefill's WAN path: its own Mooncake engine and transfer workers, and the relay/main watchdog.

Started once per prefill KV manager (patch 0006 calls :func:`start_wan_path` through
``pdd_sglang.hooks``). The workers run SGLang's own transfer loop, fed by this path's queues, so
there is one implementation of sending; :class:`~pdd_sglang.prefill.fanout.PrefillFanout` decides
which chunk goes where.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from pdd_sglang.prefill.fanout import PrefillFanout, logger, on_wan_path

WAN_WORKERS = 4


def start_wan_path(kv_mgr: Any) -> PrefillFanout:
    """Attach a fan-out to a prefill KV manager and start its WAN transfer workers."""
    from sglang.srt.disaggregation.common.utils import FastQueue

    from sglang.srt.runtime_context import get_server_args

    from pdd_sglang.prefill.wan_engine import open_wan_engine

    fanout = PrefillFanout(kv_mgr)
    kv_mgr.pdd_fanout = fanout
    args = get_server_args()
    if getattr(args, "pdd_role", None) == "prefill":
        fanout.wan_engine = open_wan_engine(kv_mgr, args.pdd_wan_transfer_protocol, args.pdd_wan_ib_device)
        fanout.relay_bootstrap_timeout_s = float(args.pdd_relay_bootstrap_timeout)
        fanout.main_bootstrap_timeout_s = float(args.pdd_main_bootstrap_timeout)
    watchdog = threading.Thread(
        target=_watch_relays, args=(fanout,), daemon=True, name="pdd-relay-watchdog"
    )
    watchdog.start()
    kv_mgr._worker_threads.append(watchdog)
    delay_s = float(getattr(args, "pdd_debug_wan_delay_ms", 0) or 0) / 1e3
    for index in range(WAN_WORKERS):
        queue = FastQueue() if delay_s <= 0 else _DelayedQueue(FastQueue(), delay_s)
        fanout.wan_queues.append(queue)
        thread = threading.Thread(
            target=_run_wan_worker, args=(kv_mgr, queue, index), daemon=True,
            name=f"pdd-wan-transfer-{index}",
        )
        thread.start()
        kv_mgr._worker_threads.append(thread)
    return fanout


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


def _watch_relays(fanout: PrefillFanout) -> None:
    while not getattr(fanout.kv_mgr, "_stopped", False):
        time.sleep(0.25)
        try:
            fanout.drop_silent_relays()
            fanout.drop_silent_mains()
        except Exception:  # a watchdog must outlive one bad room
            logger.exception("PDD: relay watchdog failed")


def _run_wan_worker(kv_mgr: Any, queue: Any, index: int) -> None:
    import concurrent.futures

    on_wan_path.active = True
    executor = concurrent.futures.ThreadPoolExecutor(1)
    # SGLang's own transfer loop, fed by this path's queue: one implementation of sending.
    kv_mgr.transfer_worker(queue, executor, None, 1000 + index)
