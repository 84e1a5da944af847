"""The prefill's compact WAN-line report (``GET /pdd/line``): written whole by its own thread,
read by the HTTP process, refused when stale, gone when the writer closes.

The fan-out is a stand-in holding what the real one publishes (``published``, a locked
``wan_line.snapshot()``); the thread, the file and the FastAPI route are the real thing.
"""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import pytest

from pdd_sglang.diagnostics import line_report

LINE = {"10.0.0.2:7000": {"bytes_ahead": 3, "queued_bytes": 1, "in_flight_bytes": 2,
                          "recent_bytes_per_s": 5.0}}


def fanout(line: dict, mains_out: list) -> SimpleNamespace:
    return SimpleNamespace(published={"mains_out": mains_out, "rooms_open": 0},
                           wan_line=SimpleNamespace(snapshot=lambda: dict(line)))


@pytest.fixture
def pid(tmp_path, monkeypatch):
    monkeypatch.setattr(line_report.tempfile, "gettempdir", lambda: str(tmp_path))
    return 4242


def test_the_writer_keeps_the_report_current_and_removes_it_on_close(pid):
    line = dict(LINE)
    writer = line_report.LineReportWriter(fanout(line, ["10.0.0.3:1"]),
                                          line_report.report_path(pid), period_s=0.01).start()
    try:
        assert any(t.name == "pdd-line-report" for t in threading.enumerate())
        status, body = line_report.read_report(pid)
        assert status == 200 and body["version"] == line_report.REPORT_VERSION
        assert body["wan_line"] == LINE and body["mains_out"] == ["10.0.0.3:1"]
        assert 0 <= body["age_s"] < 1
        line["10.0.0.9:1"] = {"bytes_ahead": 7}  # a new main: in a later report
        deadline = time.monotonic() + 5
        while "10.0.0.9:1" not in line_report.read_report(pid)[1]["wan_line"]:
            assert time.monotonic() < deadline, "the writer never wrote the new line"
            time.sleep(0.01)
    finally:
        writer.close()
    assert not line_report.report_path(pid).exists()
    assert not any(t.name == "pdd-line-report" for t in threading.enumerate())
    status, body = line_report.read_report(pid)
    assert status == 503 and "has not started" in body["error"]


def test_a_stale_or_damaged_report_is_a_503_not_an_old_line(pid):
    path = line_report.report_path(pid)
    old = time.time() - line_report.STALE_AFTER_S - 1
    path.write_text(json.dumps({"version": "1", "written_at": old, "wan_line": LINE,
                                "mains_out": []}))
    status, body = line_report.read_report(pid)
    assert status == 503 and "stuck or gone" in body["error"] and body["wan_line"] == LINE
    path.write_text('{"version": "1", "wan_l')
    status, body = line_report.read_report(pid)
    assert status == 503 and "unreadable" in body["error"]


def test_only_tp_rank_0_of_a_prefill_writes_a_report(pid, monkeypatch):
    monkeypatch.setattr(line_report.os, "getppid", lambda: pid)
    assert line_report.start_line_report(SimpleNamespace()) is None  # not a PDD prefill
    rank1 = SimpleNamespace(pdd_fanout=fanout(LINE, []), attn_tp_rank=1)
    assert line_report.start_line_report(rank1) is None
    rank0 = SimpleNamespace(pdd_fanout=fanout(LINE, []), attn_tp_rank=0)
    writer = line_report.start_line_report(rank0)
    try:
        assert rank0.pdd_line_report is writer and writer.path == line_report.report_path(pid)
        assert line_report.read_report(pid)[0] == 200
    finally:
        writer.close()


def test_the_route_serves_the_report_of_its_own_process(pid, monkeypatch):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    monkeypatch.setattr(line_report.os, "getpid", lambda: pid)
    app = FastAPI()
    line_report.add_route(app)
    client = TestClient(app)
    assert client.get(line_report.ROUTE).status_code == 503  # no report yet
    writer = line_report.LineReportWriter(fanout(LINE, []), line_report.report_path(pid)).start()
    try:
        answer = client.get(line_report.ROUTE)
        assert answer.status_code == 200 and answer.json()["wan_line"] == LINE
    finally:
        writer.close()
