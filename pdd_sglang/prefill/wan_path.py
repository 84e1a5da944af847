"""Prefill's PDD threads: the fan-out's owner, its senders, the peer thread, and the WAN engine.

Started once per PDD prefill KV manager (patch 0007 calls :func:`start_wan_path` through
``pdd_sglang.hooks``, only with ``--pdd-role prefill``). Threads, all named ``pdd-...``:

- ``pdd-fanout``: the owner (:class:`~pdd_sglang.prefill.fanout.PrefillFanout`): applies the
  events other threads post, and every ``OWNER_TICK_S`` its deadlines;
- ``pdd-local-xfer-N``: local senders (relays, SGLang's engine), one per SGLang transfer queue,
  each on SGLang's own executor of that index;
- ``pdd-wan-xfer-N``: WAN senders (mains, the WAN engine), each with a one-thread executor,
  each taking the best work of a main's line no other holds (:mod:`~pdd_sglang.prefill.wan_lines`);
- ``pdd-peer-io``: status messages to destinations and WAN probes, which may wait on a dead peer
  and so never run on the owner;
- ``pdd-cache-only``: the router's cache-only notices in (:mod:`pdd_sglang.prefill.cache_only`),
  posted to the owner.

:class:`WanPath` owns every thread and the engine, and :meth:`WanPath.close` (called on
SGLang's scheduler shutdown, :mod:`pdd_sglang.lifecycle`) stops them: a sentinel to each queue,
joins with a timeout, then the engine.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from typing import Any, Optional

from pdd_sglang import seam
from pdd_sglang.lifecycle import name_os_thread
from pdd_sglang.prefill.cache_only import start_intake
from pdd_sglang.prefill.fanout import PrefillFanout, logger
from pdd_sglang.prefill.senders import run_sender, run_wan_sender
from pdd_sglang.prefill.wan_engine import WAN_SENDERS

WAN_WORKERS = WAN_SENDERS  # the send pool holds two records for each (prefill/send_pool.py)
OWNER_TICK_S = 0.25
JOIN_TIMEOUT_S = 2.0
STUCK_MARGIN_S = 10.0
_STOP = object()


class WanPath:
    """Every PDD thread of one prefill KV manager, and its WAN engine."""

    def __init__(self, fanout: PrefillFanout):
        self.fanout = fanout
        self.threads: list[threading.Thread] = []
        self._peer_jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._executors: list = []
        self.cache_only_intake = None  # CacheOnlyIntake, started with the threads
        fanout.peer_jobs = self._peer_jobs.put

    def start(self, kv_mgr: Any, workers: int, local_workers: int = 2) -> None:
        from sglang.srt.disaggregation.common.utils import FastQueue

        report = self.fanout.events.put
        self.cache_only_intake = start_intake(kv_mgr, report)
        self._spawn("pdd-fanout", self._own)
        self._spawn("pdd-peer-io", self._peer_io)
        sglang_executors = list(getattr(kv_mgr, "executors", None) or [])
        for index in range(local_workers):
            local_queue = FastQueue()
            self.fanout.local_queues.append(local_queue)
            executor = (sglang_executors[index % len(sglang_executors)] if sglang_executors
                        else self._executor(2, f"pdd-local-layers-{index}"))
            self._spawn(f"pdd-local-xfer-{index}", run_sender, kv_mgr, local_queue, executor,
                        report)
        for index in range(workers):  # at most one per main's line at a time (WanLines)
            self._spawn(f"pdd-wan-xfer-{index}", run_wan_sender, kv_mgr, self.fanout.wan_lines,
                        self._executor(1, f"pdd-wan-layers-{index}"), report)

    def _executor(self, threads: int, prefix: str):
        executor = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix=prefix)
        self._executors.append(executor)
        return executor

    def _spawn(self, name: str, target, *args) -> None:
        def run() -> None:
            name_os_thread(name)
            target(*args)

        thread = threading.Thread(target=run, daemon=True, name=name)
        thread.start()
        self.threads.append(thread)

    def _own(self) -> None:
        """The owner's loop: events as they come, deadlines every OWNER_TICK_S."""
        fanout = self.fanout
        next_tick = time.monotonic() + OWNER_TICK_S
        while True:
            try:
                event = fanout.events.get(timeout=max(next_tick - time.monotonic(), 0))
            except queue.Empty:
                event = None
            if event is _STOP:
                return
            try:
                if event is not None:
                    fanout.handle(event)
                if time.monotonic() >= next_tick:
                    next_tick = time.monotonic() + OWNER_TICK_S
                    fanout.tick()
            except Exception:  # the owner must outlive one bad room
                logger.exception("PDD: the prefill fan-out failed on %r", event)

    def _peer_io(self) -> None:
        while True:
            job = self._peer_jobs.get()
            if job is _STOP:
                return
            try:
                job()
            except Exception:
                logger.exception("PDD: a message to a destination failed")

    def close(self, timeout_s: float = JOIN_TIMEOUT_S) -> list[str]:
        """Stop every thread and close the engine; the names of threads still alive after it."""
        if self.cache_only_intake is not None:
            self.cache_only_intake.close()
        self.fanout.events.put(_STOP)
        self._peer_jobs.put(_STOP)
        for engine in (self.fanout.wan_engine, self.fanout.local_engine):
            if engine is not None:
                engine.stop_waiting()
        for sender_queue in self.fanout.local_queues:
            sender_queue.put(None)
        self.fanout.wan_lines.stop()
        deadline = time.monotonic() + timeout_s
        for thread in self.threads:
            thread.join(max(deadline - time.monotonic(), 0))
        left = [t.name for t in self.threads if t.is_alive()]
        for executor in self._executors:
            executor.shutdown(wait=False)
        for engine in (self.fanout.wan_engine, self.fanout.local_engine):
            if engine is not None:
                engine.close()  # the local one registered nothing: SGLang's engine stays as is
        if left:
            logger.warning("PDD: prefill threads closed; still running after %.1f s: %s",
                           timeout_s, ", ".join(left))
        else:
            logger.info("PDD: prefill closed (owner, senders, peer thread and WAN engine)")
        return left


def start_wan_path(kv_mgr: Any, args: Optional[Any] = None) -> WanPath:
    """Attach a fan-out to a PDD prefill KV manager and start its WAN path."""
    from sglang.srt.environ import envs
    from sglang.srt.runtime_context import get_server_args

    from pdd_sglang.diagnostics.line_report import start_line_report
    from pdd_sglang.diagnostics.metrics import start_prefill_exporter
    from pdd_sglang.prefill.wan_coded import CodecChoice
    from pdd_sglang.prefill.wan_engine import (background_window, open_wan_engine,
                                               polled_local_engine, wan_hostname, window_for_line)

    args = get_server_args() if args is None else args
    fanout = PrefillFanout(kv_mgr,
                           wan_line_bytes_per_s=float(args.pdd_wan_bandwidth_gbps) * 1e9 / 8)
    fanout.relay_bootstrap_timeout_s = float(args.pdd_relay_bootstrap_timeout)
    fanout.main_bootstrap_timeout_s = float(args.pdd_main_bootstrap_timeout)
    # Every batch of a WAN chunk fails at --pdd-wan-transfer-timeout; a chunk still in a sender
    # well past it is stuck in the transport, and its room must not hold prefill's KV for ever.
    fanout.stuck_after_s = 2 * float(args.pdd_wan_transfer_timeout) + STUCK_MARGIN_S
    backlog_s = float(args.pdd_wan_cache_only_backlog_s)
    fanout.cache_only_backlog_s = backlog_s if backlog_s > 0 else None
    # A room prefill never computed: its decode servers stop waiting after SGLang's timeout.
    fanout.abandon_after_s = float(getattr(kv_mgr, "waiting_timeout", None)
                                   or envs.SGLANG_DISAGGREGATION_WAITING_TIMEOUT.get()) + STUCK_MARGIN_S
    window = window_for_line(float(args.pdd_wan_bandwidth_gbps), float(args.pdd_wan_rtt_ms),
                             float(args.pdd_wan_window_mb))
    fanout.wan_engine = open_wan_engine(
        kv_mgr, args.pdd_wan_transfer_protocol, args.pdd_wan_ib_device,
        timeout_s=float(args.pdd_wan_transfer_timeout), line=fanout.wan_line, window=window,
        hostname=wan_hostname(kv_mgr, getattr(args, "pdd_wan_hostname", None),
                              getattr(args, "pdd_advertise_host", None)),
        background=background_window(window, fanout.wan_lines.line_bytes_per_s))
    seam.aids.wan_engine_opened(fanout.wan_engine)
    fanout.local_engine = polled_local_engine(kv_mgr)
    fanout.codec_choice = CodecChoice(str(getattr(args, "pdd_wan_kv_codec", "auto")),
                                      float(args.pdd_wan_bandwidth_gbps) * 1e9 / 8)
    path = WanPath(fanout)
    kv_mgr.pdd_fanout = fanout
    kv_mgr.pdd_wan_path = path
    start_prefill_exporter(kv_mgr)  # --enable-metrics only; closed by lifecycle.close_scheduler
    start_line_report(kv_mgr)  # the router's GET /pdd/line; closed there too
    path.start(kv_mgr, WAN_WORKERS,
               local_workers=max(len(getattr(kv_mgr, "transfer_queues", ()) or ()), 1))
    return path


