"""Who owns PDD's threads and engines in a scheduler process, and how they are closed.

Prefill: the KV manager's :class:`~pdd_sglang.prefill.wan_path.WanPath` (the fan-out's owner,
its local and WAN senders, the peer thread, the WAN engine), its ``pdd_line_report`` (thread
``pdd-line-report``, the router's ``/pdd/line``) and, with --enable-metrics, its
``pdd_metrics_exporter`` (thread ``pdd-metrics``).
Relay and main: the scheduler's handoff (its control loop). SGLang's scheduler process calls
:func:`close_scheduler` when it leaves its event loop (patch 0010, through
``hooks.on_scheduler_exit``); every thread PDD starts is named ``pdd-...``, so what is left is
easy to find (:func:`pdd_threads`).

A SIGTERM to the whole process group (systemd's default ``KillMode=control-group``, a container
runtime, Ctrl-C's sibling ``kill -TERM -PGID``) would reach the scheduler and the detokenizer too,
and kill them before SGLang's graceful path could ask the scheduler to leave its loop (and PDD to
close). So the launcher of a PDD server starts its children with SIGTERM ignored
(:func:`ignore_sigterm_in_children`, patch 0012) and takes it back once they run
(:func:`restore_sigterm`): a group SIGTERM then stops the server exactly as a SIGTERM to the
launcher alone does. A SIGTERM sent to a child alone is ignored; stop a server through its
launcher or its group.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any, Optional

logger = logging.getLogger(__name__)

THREAD_PREFIX = "pdd-"


def kv_manager_of(scheduler: Any) -> Optional[Any]:
    """The scheduler's PD KV manager (prefill or decode side), or None."""
    for queue in (getattr(scheduler, "disagg_prefill_bootstrap_queue", None),
                  getattr(scheduler, "disagg_decode_prealloc_queue", None)):
        if queue is not None and getattr(queue, "kv_manager", None) is not None:
            return queue.kv_manager
    return None


def name_os_thread(name: str) -> None:
    """Give the calling thread ``name`` in the kernel too (``/proc/PID/task/TID/comm``, 15
    characters), so a test or an operator sees PDD's threads from outside the process."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):  # not Linux: the Python name has to do
        pass


def pdd_threads() -> list[str]:
    """Names of the live threads PDD started in this process."""
    return sorted(t.name for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX))


def close_scheduler(scheduler: Any) -> list[str]:
    """Close the owners PDD attached to ``scheduler``; the PDD threads still alive after it."""
    kv_mgr = kv_manager_of(scheduler)
    owners = [getattr(kv_mgr, "pdd_wan_path", None),
              getattr(kv_mgr, "pdd_metrics_exporter", None),  # after the path: its last figures
              getattr(kv_mgr, "pdd_line_report", None),
              getattr(scheduler, "_pdd_handoff", None),  # built by decode.handoff_for, if ever
              getattr(kv_mgr, "pdd_staging", None)]  # a main's staging region, if ever made
    for owner in owners:
        if owner is None:
            continue
        try:
            owner.close()
        except Exception:  # one owner failing to close must not keep the others open
            logger.exception("PDD: closing %s failed", type(owner).__name__)
    left = pdd_threads()
    logger.info("PDD: closed on scheduler exit; PDD threads left: %s", ", ".join(left) or "none")
    return left


_saved_sigterm: Any = None


def ignore_sigterm_in_children() -> None:
    """Launcher, before it starts the scheduler and detokenizer: they start with SIGTERM ignored
    (an ignored signal stays ignored across fork and exec; a blocked one does not survive
    multiprocessing's spawn). A SIGTERM to the launcher in the second this lasts is lost too."""
    global _saved_sigterm
    if threading.current_thread() is not threading.main_thread():
        logger.warning("PDD: launching off the main thread; a SIGTERM to the process group "
                       "will reach the scheduler too")
        return
    _saved_sigterm = signal.signal(signal.SIGTERM, signal.SIG_IGN)


def restore_sigterm() -> None:
    """Launcher, once its children run: SIGTERM is its own again."""
    global _saved_sigterm
    if _saved_sigterm is None:
        return
    signal.signal(signal.SIGTERM, _saved_sigterm)
    _saved_sigterm = None
