"""POST /pdd/cache_only: the router's notice that a room's relay answered alone reaches every
prefill scheduler's fan-out as a CacheOnly event (issue 34). The route on a real FastAPI app, the
intake on a real ZMQ socket, in this process (the launcher's PID is this test's)."""

import os
import queue
import threading

import pytest

from pdd_sglang.prefill import cache_only
from pdd_sglang.prefill.events import CacheOnly, RelayLost


@pytest.fixture
def app():
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    app = FastAPI()
    cache_only.add_route(app)
    return TestClient(app)


@pytest.fixture
def intake():
    events: queue.SimpleQueue = queue.SimpleQueue()
    taker = cache_only.CacheOnlyIntake(events.put, os.getpid(), tp_rank=0).start()
    yield events
    taker.close()


def test_a_notice_reaches_the_fan_outs_owner_as_one_event_per_room(app, intake):
    answer = app.post(cache_only.ROUTE, json={"rooms": [5, 2 ** 62 - 1]})
    assert answer.status_code == 202, answer.text
    assert answer.json() == {"rooms": 2, "ranks": 1}
    assert [intake.get(timeout=10), intake.get(timeout=10)] == [CacheOnly(5), CacheOnly(2 ** 62 - 1)]


def test_a_relay_lost_notice_reaches_the_owner_as_relay_lost_events(app, intake):
    answer = app.post(cache_only.RELAY_LOST_ROUTE, json={"rooms": [7]})
    assert answer.status_code == 202 and answer.json() == {"rooms": 1, "ranks": 1}
    assert intake.get(timeout=10) == RelayLost(7)


@pytest.mark.parametrize("route", [cache_only.ROUTE, cache_only.RELAY_LOST_ROUTE])
@pytest.mark.parametrize("body", [{}, {"rooms": []}, {"rooms": ["5"]}, {"rooms": [-1]},
                                  {"rooms": [True]}, [5]])
def test_a_bad_notice_is_refused_with_what_is_wrong(app, intake, body, route):
    answer = app.post(route, json=body)
    assert answer.status_code == 400 and "room" in answer.json()["error"]
    assert intake.empty()


def test_a_notice_without_a_scheduler_to_take_it_is_answered_503(app):
    answer = app.post(cache_only.ROUTE, json={"rooms": [5]})
    assert answer.status_code == 503 and "cache-only" in answer.json()["error"]


def test_the_intake_survives_a_malformed_frame(intake):
    import zmq

    socket = zmq.Context.instance().socket(zmq.PUSH)
    socket.connect(cache_only.intake_address(os.getpid(), 0))
    socket.send(b"not json")
    socket.send(b'{"rooms": [9]}')
    assert intake.get(timeout=10) == CacheOnly(9)
    socket.close(0)
