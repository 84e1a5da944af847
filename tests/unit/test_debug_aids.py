"""The seam's aids (``pdd_sglang.seam``, ``pdd_sglang.dev.debug_aids``): a server without them
serves as is, the flags ask for exactly their aid, and a request's test controls travel beside its
route, never in it. The aids at work on real servers: tests/integration/test_handoff.py."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest

from pdd_sglang import seam
from pdd_sglang.dev.debug_aids import install_for, installed
from pdd_sglang.dev.debug_aids.aids import DebugAids
from pdd_sglang.dev.debug_aids.controls import (CONTROLS_ACTION_TYPE, NO_CONTROLS, DebugControls,
                                                controls_for, controls_of, request_kv_hints)
from pdd_sglang.dev.debug_aids.flags import PddDebugArgs
from pdd_sglang.protocol.route import route_of

RELAY = "tcp://10.0.0.1:5557"


def envelope(hints: dict):
    from sglang.srt.managers.kv_hints import decode_kv_hints_envelope

    return decode_kv_hints_envelope(hints)


def test_no_aid_leaves_every_point_as_it_was():
    aids, batch, req, after = seam.Aids(), object(), object(), object()
    called = []
    assert aids.relay_hand_off(None, batch, 2.5, lambda b, now: called.append((b, now)) or after) \
        is after
    assert called == [(batch, 2.5)]  # the relay's own step, once, as it was given
    assert aids.main_wan_kv_landed(None, req, 0) is None
    assert aids.main_staged_kv(req, bytearray(64)) is None
    assert aids.before_send(req) is None and aids.wan_engine_opened(req) is None
    assert type(seam.aids) is seam.Aids  # what serving code finds unless something installed aids


def test_installed_aids_are_put_back_after_the_block():
    before = seam.aids
    with installed(DebugAids(handoff_hold=True)) as aids:
        assert seam.aids is aids
    assert seam.aids is before


def test_controls_travel_beside_the_route_through_sglangs_envelope():
    hints = request_kv_hints("prefill_relay_main", relay_control=RELAY,
                             debug_handoff_after_tokens=7, handoff_mode="catch-up",
                             debug_corrupt_wan_kv=None)
    types = [a["action_type"] for a in hints["actions"]]
    assert types == ["pdd.route", CONTROLS_ACTION_TYPE]
    assert hints["actions"][0]["payload"] == {"pipeline": "prefill_relay_main",
                                              "relay_control": RELAY, "handoff_mode": "catch-up"}
    parsed = envelope(hints)
    route = route_of(parsed)  # what serving code reads: the route alone
    assert (route.relay_control, route.handoff_mode) == (RELAY, "catch-up")
    assert controls_of(parsed) == DebugControls(handoff_after_tokens=7)
    req = SimpleNamespace(kv_hints=parsed)
    assert controls_for(req) is controls_for(req)  # parsed once


def test_a_request_without_controls_carries_the_route_alone():
    hints = request_kv_hints("prefill_main")
    assert [a["action_type"] for a in hints["actions"]] == ["pdd.route"]
    assert controls_of(envelope(hints)) is NO_CONTROLS
    assert controls_of(None) is NO_CONTROLS


@pytest.mark.parametrize("fields", [{"debug_handoff_after_tokens": 0},
                                    {"handoff_mode": "sideways"},
                                    {"debug_handoff_mode": "one-shot"},  # the route's now
                                    {"debug_unknown_control": 1}])
def test_bad_controls_are_refused_at_the_source(fields):
    with pytest.raises((msgspec.ValidationError, ValueError)):
        request_kv_hints("prefill_relay_main", relay_control=RELAY, **fields)


def test_a_malformed_controls_action_on_a_server_is_read_as_none():
    action = SimpleNamespace(action_type=CONTROLS_ACTION_TYPE, action_version="1",
                             payload={"handoff_after_tokens": "many"})
    assert controls_of(SimpleNamespace(actions=[action])) is NO_CONTROLS


def flags(**on) -> SimpleNamespace:
    values = {f.name: f.default for f in msgspec.structs.fields(PddDebugArgs)}
    return SimpleNamespace(**{"pdd_role": "relay", **values, **on})


def test_each_flag_asks_for_its_aid_and_none_installs_nothing():
    assert {f.name for f in msgspec.structs.fields(PddDebugArgs)} == {
        "pdd_debug_corrupt_wan_kv", "pdd_debug_handoff_hold", "pdd_debug_wan_delay_ms",
        "pdd_debug_wan_blocking_wait", "pdd_debug_kv_digest"}
    assert DebugAids.from_args(flags()) is None
    assert DebugAids.from_args(flags(pdd_debug_kv_digest=True)) is None  # not a seam aid
    aids = DebugAids.from_args(flags(pdd_debug_handoff_hold=True, pdd_debug_wan_delay_ms=300))
    assert aids.hold is not None and aids.wan_delay_s == 0.3
    assert not aids.corrupt_wan_kv and not aids.wan_blocking_wait
    assert DebugAids.from_args(SimpleNamespace(pdd_role="main")) is None  # a production server


def test_install_for_installs_only_on_a_pdd_server_that_asks():
    before = seam.aids
    try:
        assert install_for(flags()) is None and seam.aids is before
        assert install_for(flags(pdd_role=None, pdd_debug_handoff_hold=True)) is None
        aids = install_for(flags(pdd_debug_handoff_hold=True))
        assert seam.aids is aids and aids.hold is not None
    finally:
        seam.install(before)


def test_a_negative_wan_delay_is_refused_by_name():
    with pytest.raises(ValueError, match="--pdd-debug-wan-delay-ms"):
        DebugAids.from_args(flags(pdd_debug_wan_delay_ms=-5))


def test_the_wan_delay_holds_chunks_to_a_main_only_counted_from_when_they_were_queued(monkeypatch):
    """A main's line has one sender, which takes its chunks one after another: each chunk is late
    by the delay from when it was queued, not by the delays of every chunk ahead of it (eight
    concurrent requests' chunks were 2-5 s late, and no relay was caught by its main)."""
    slept = []
    monkeypatch.setattr("pdd_sglang.dev.debug_aids.aids.time.sleep", slept.append)
    monkeypatch.setattr("pdd_sglang.dev.debug_aids.aids.time.monotonic", lambda: 100.0)
    aids = DebugAids(wan_delay_s=0.3)
    aids.before_send(SimpleNamespace(role="relay"))
    aids.before_send(SimpleNamespace(role="main", queued_at=100.0))
    aids.before_send(SimpleNamespace(role="main", queued_at=99.8))  # waited 0.2 s for the line
    aids.before_send(SimpleNamespace(role="main", queued_at=99.0))  # waited past the delay
    assert slept == [pytest.approx(0.3), pytest.approx(0.1), 0.0]


def test_the_blocking_wait_writes_through_mooncakes_synchronous_call():
    from pdd_sglang.prefill.wan_engine import WanTransferEngine
    from pdd_sglang.prefill.wan_line import WanLine

    calls = []

    class Mooncake:
        def batch_transfer_sync_write(self, *args):
            calls.append(args)
            return 0 if len(calls) == 1 else -1

        def transfer_submit_write(self, *args):
            pytest.fail("the asynchronous path")

    engine = WanTransferEngine.over(Mooncake(), timeout_s=5.0, line=WanLine())
    DebugAids().wan_engine_opened(engine)  # off: the engine's own path
    assert "batch_transfer_sync" not in vars(engine)
    DebugAids(wan_blocking_wait=True).wan_engine_opened(engine)
    assert engine.batch_transfer_sync("main", [1], [2], [3]) == 0
    assert engine.batch_transfer_sync("main", [4], [5], [6]) == -1
    assert calls == [("main", [1], [2], [3]), ("main", [4], [5], [6])]


def test_main_damages_only_a_copy_whose_request_asks(monkeypatch):
    damaged = []
    monkeypatch.setattr("pdd_sglang.dev.debug_aids.aids.corrupt_one_value",
                        lambda scheduler, req, start: damaged.append((req.name, start)))
    main = SimpleNamespace(scheduler=object())

    def req(name: str, corrupt: bool):
        hints = request_kv_hints("prefill_main", debug_corrupt_wan_kv=corrupt or None)
        return SimpleNamespace(name=name, kv_hints=envelope(hints), origin_input_ids=[1] * 10)

    DebugAids().main_wan_kv_landed(main, req("flag off", True), 4)
    aids = DebugAids(corrupt_wan_kv=True)
    aids.main_wan_kv_landed(main, req("not asked", False), 4)
    aids.main_wan_kv_landed(main, req("all cached", True), 10)  # nothing crossed the WAN
    aids.main_wan_kv_landed(main, req("asked", True), 4)
    assert damaged == [("asked", 4)]


def test_main_damages_a_coded_copy_only_where_its_request_asks():
    def req(corrupt: bool):
        hints = request_kv_hints("prefill_main", debug_corrupt_wan_frame=corrupt or None)
        return SimpleNamespace(kv_hints=envelope(hints))

    frame = memoryview(bytearray(10))  # a record's frame in its staging slot
    DebugAids().main_staged_kv(req(True), frame)  # the flag off
    DebugAids(corrupt_wan_kv=True).main_staged_kv(req(False), frame)  # not asked
    DebugAids(corrupt_wan_kv=True).main_staged_kv(None, frame)  # no request known
    assert bytes(frame) == bytes(10)
    DebugAids(corrupt_wan_kv=True).main_staged_kv(req(True), frame)
    assert bytes(frame) == bytes(9) + b"\xff"  # the frame's last byte