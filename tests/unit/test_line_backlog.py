"""The line sampler the demo and the fault suite share (dev/testing/line_backlog.py)."""

from __future__ import annotations

import threading
import time

from pdd_sglang.dev.testing.line_backlog import LineBacklog, summed


def _state(*lines, rooms=3):
    return {"wan_line": {f"main-{i}": line for i, line in enumerate(lines)},
            "fanout": {"rooms_open": rooms}}


def test_a_sample_sums_the_mains_and_keeps_the_slowest_measured_rate():
    sample = summed(_state(
        {"bytes_ahead": 100, "cache_only_bytes_ahead": 40, "in_flight_bytes": 10,
         "dropped_cache_only_bytes": 7, "recent_bytes_per_s": 2000.4},
        {"bytes_ahead": 50, "needed_now_bytes_ahead": 50, "recent_bytes_per_s": 900.6},
        {"bytes_ahead": 0, "recent_bytes_per_s": None}))
    assert sample == {"bytes_ahead": 150, "needed_now_bytes_ahead": 50,
                      "first_token_bytes_ahead": 0, "cache_only_bytes_ahead": 40,
                      "in_flight_bytes": 10, "dropped_cache_only_bytes": 7,
                      "recent_bytes_per_s": 901, "rooms_open": 3}
    assert summed({})["recent_bytes_per_s"] is None and summed({})["bytes_ahead"] == 0


def test_the_sampler_records_a_prefill_that_does_not_answer_and_stops_when_told():
    answered = threading.Event()
    calls = []

    def pdd_state():
        calls.append(1)
        if len(calls) == 2:
            answered.set()
            raise OSError("connection refused")
        return _state({"bytes_ahead": 5})

    sampler = LineBacklog(pdd_state, time.monotonic(), interval_s=0.01)
    sampler.start()
    assert answered.wait(10)
    samples = sampler.stop()
    assert not sampler.is_alive()
    assert samples[0]["bytes_ahead"] == 5 and samples[1]["bytes_ahead"] is None
