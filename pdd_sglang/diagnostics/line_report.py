"""The prefill's compact WAN-line report, ``GET /pdd/line``: what the router's congestion-aware
placement polls every second, without SGLang's whole ``/server_info``.

Why: ``/server_info`` asks every scheduler for its internal state (a dump of ServerArgs, PDD's
pool and transfer ledger) between two of its steps, then the HTTP process merges and encodes it
all. A PDD demo measured about 18 ms of the prefill's CPU per poll, from a 0.5-core quota. The
router needs two small values: ``wan_line`` (bytes queued and in flight and the recent rate per
main Mooncake session) and ``mains_out`` (main sessions out after a failed WAN copy).

How, without the scheduler thread:

1. In the prefill's scheduler process (TP rank 0's), thread ``pdd-line-report``
   (:class:`LineReportWriter`, the owner of the report file) reads ``fanout.published`` (replaced
   whole by the fan-out's owner) and ``fanout.wan_line.snapshot()`` (locked) every
   :data:`WRITE_PERIOD_S`, and replaces the file at :func:`report_path` atomically (write, then
   ``os.replace``): a reader sees the old report or the new one, never half of one.
2. The launcher's HTTP process serves it (patch 0018): :func:`read_report` reads the file of its
   own scheduler (the scheduler is the launcher's child: the file is named after the launcher's
   PID) and adds ``age_s``. A report older than :data:`STALE_AFTER_S` (the scheduler is stuck or
   gone) is answered 503, as SGLang's ``/health`` answers a stuck scheduler.
3. :meth:`LineReportWriter.close` (``lifecycle.close_scheduler``) stops the thread and removes
   the file.

Served by the HTTP process SGLang starts first; with ``--tokenizer-worker-num`` > 1 the HTTP
workers are other processes and ``/pdd/line`` answers 404, so the router reads ``/server_info``.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

logger = logging.getLogger(__name__)

REPORT_VERSION = "1"
WRITE_PERIOD_S = 0.5
STALE_AFTER_S = 5.0
ROUTE = "/pdd/line"


def report_path(launcher_pid: int) -> Path:
    return Path(tempfile.gettempdir()) / f"pdd-sglang-line-{launcher_pid}.json"


class LineReportWriter:
    """Thread ``pdd-line-report``: the prefill's line report into :func:`report_path`."""

    def __init__(self, fanout: Any, path: Path, period_s: float = WRITE_PERIOD_S):
        self.fanout = fanout
        self.path = path
        self.period_s = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pdd-line-report", daemon=True)

    def start(self) -> "LineReportWriter":
        self.write_once()  # the router's first poll finds a report
        self._thread.start()
        return self

    def _run(self) -> None:
        from pdd_sglang.lifecycle import name_os_thread

        name_os_thread("pdd-line-report")
        while not self._stop.wait(self.period_s):
            try:
                self.write_once()
            except Exception:  # a report must never take the prefill down
                logger.exception("PDD: writing the WAN-line report failed")

    def write_once(self) -> None:
        report = {"version": REPORT_VERSION, "written_at": time.time(),
                  "wan_line": self.fanout.wan_line.snapshot(),
                  "mains_out": list(self.fanout.published.get("mains_out", ()))}
        partial = self.path.with_name(self.path.name + ".partial")
        partial.write_text(json.dumps(report))
        os.replace(partial, self.path)

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        for path in (self.path, self.path.with_name(self.path.name + ".partial")):
            path.unlink(missing_ok=True)


def start_line_report(kv_mgr: Any) -> Optional[LineReportWriter]:
    """Start the report of a PDD prefill's KV manager (TP rank 0's only: one file per server),
    kept as ``kv_mgr.pdd_line_report`` and closed by ``lifecycle.close_scheduler``."""
    fanout = getattr(kv_mgr, "pdd_fanout", None)
    if fanout is None or int(getattr(kv_mgr, "attn_tp_rank", 0) or 0) != 0:
        return None
    writer = LineReportWriter(fanout, report_path(os.getppid())).start()
    kv_mgr.pdd_line_report = writer
    return writer


def read_report(launcher_pid: Optional[int] = None) -> tuple[int, dict]:
    """``(HTTP status, body)`` of ``GET /pdd/line`` in the launcher's HTTP process."""
    path = report_path(os.getpid() if launcher_pid is None else launcher_pid)
    try:
        report = json.loads(path.read_text())
    except FileNotFoundError:
        return 503, {"error": "no WAN-line report yet: the prefill's scheduler has not started "
                              "its PDD fan-out"}
    except (OSError, ValueError) as err:
        return 503, {"error": f"the WAN-line report at {path} is unreadable: {err}"}
    report["age_s"] = round(max(0.0, time.time() - float(report.get("written_at", 0))), 3)
    if report["age_s"] > STALE_AFTER_S:
        return 503, {"error": f"the WAN-line report is {report['age_s']:.1f} s old: the "
                              f"prefill's scheduler process is stuck or gone", **report}
    return 200, report


def add_route(app: Any) -> None:
    """Serve ``GET /pdd/line`` on SGLang's FastAPI app (the launcher's HTTP process)."""
    from fastapi.responses import JSONResponse

    async def pdd_line() -> JSONResponse:
        status, body = read_report()
        return JSONResponse(body, status_code=status)

    app.add_api_route(ROUTE, pdd_line, methods=["GET"], include_in_schema=False)
