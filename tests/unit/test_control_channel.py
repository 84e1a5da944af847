"""The relay <-> main control channel over real ZMQ sockets on loopback, with and without CURVE."""

from __future__ import annotations

import time

import pytest
import zmq

from pdd_sglang.protocol.control_channel import CurveConfig, MainControlClient, RelayControlServer, keygen
from pdd_sglang.protocol.messages import HandoffAck, HandoffReady, HandoffTokens, pack_tokens


def wait_for(endpoint, timeout_s=3.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = endpoint.receive(100)
        if got is not None:
            return got
    return None


@pytest.fixture()
def keys(tmp_path):
    relay_dir, mains_dir, stranger_dir = tmp_path / "relay", tmp_path / "mains", tmp_path / "stranger"
    keygen(relay_dir, "relay")
    keygen(mains_dir, "main-b")
    keygen(stranger_dir, "stranger")
    return {
        "relay": CurveConfig(relay_dir / "relay.key_secret", authorized_mains_dir=mains_dir),
        "main": CurveConfig(mains_dir / "main-b.key_secret",
                            relay_public_key_file=relay_dir / "relay.key"),
        "stranger": CurveConfig(stranger_dir / "stranger.key_secret",
                                relay_public_key_file=relay_dir / "relay.key"),
    }


def handoff_exchange(relay, main):
    main.send(HandoffReady(room=42))
    peer, ready = wait_for(relay)
    assert ready == HandoffReady(room=42)
    chunk = HandoffTokens(room=42, seq=0, start=1, token_ids=pack_tokens([5, 6, 7]), is_last=True)
    relay.send(peer, chunk)
    got = wait_for(main)
    assert got == chunk and got.tokens == [5, 6, 7]
    main.send(HandoffAck(room=42, seq=0))
    assert wait_for(relay)[1] == HandoffAck(room=42, seq=0)


def test_plain_channel_round_trip():
    relay = RelayControlServer("tcp://127.0.0.1:0")
    main = MainControlClient(relay.address)
    try:
        handoff_exchange(relay, main)
    finally:
        main.close()
        relay.close()


def test_curve_admits_an_authorized_main(keys):
    relay = RelayControlServer("tcp://127.0.0.1:0", keys["relay"])
    main = MainControlClient(relay.address, keys["main"])
    try:
        handoff_exchange(relay, main)
        assert relay.refusals["unauthorized_peer"] == 0
    finally:
        main.close()
        relay.close()


@pytest.mark.parametrize("who", ["stranger", "plain"])
def test_curve_refuses_a_peer_without_an_allowed_key(keys, who):
    relay = RelayControlServer("tcp://127.0.0.1:0", keys["relay"])
    intruder = MainControlClient(relay.address, keys["stranger"] if who == "stranger" else None)
    try:
        intruder.send(HandoffReady(room=7))
        assert wait_for(relay, timeout_s=1.5) is None
        if who == "stranger":  # a plain peer fails the CURVE handshake before ZAP is asked
            assert relay.refusals["unauthorized_peer"] >= 1
        main = MainControlClient(relay.address, keys["main"])  # the relay still serves others
        try:
            handoff_exchange(relay, main)
        finally:
            main.close()
    finally:
        intruder.close()
        relay.close()


def test_garbage_frames_are_counted_and_the_channel_survives():
    relay = RelayControlServer("tcp://127.0.0.1:0")
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(relay.address)
    main = MainControlClient(relay.address)
    try:
        raw.send(b"\x93not-a-pdd-message")
        raw.send_multipart([b"two", b"frames"])
        assert wait_for(relay, timeout_s=1.0) is None
        assert relay.refusals["malformed"] >= 1
        handoff_exchange(relay, main)
    finally:
        raw.close()
        main.close()
        relay.close()


def test_curve_configs_must_be_complete(tmp_path):
    keygen(tmp_path, "x")
    with pytest.raises(ValueError, match="authorized_mains_dir"):
        RelayControlServer("tcp://127.0.0.1:0", CurveConfig(tmp_path / "x.key_secret"))
    with pytest.raises(ValueError, match="relay_public_key_file"):
        MainControlClient("tcp://127.0.0.1:1", CurveConfig(tmp_path / "x.key_secret"))


# ---- the control loop servers run: one I/O thread owns the sockets ---------------------------
def test_control_loop_carries_a_handoff_both_ways_and_to_several_relays():
    from pdd_sglang.protocol.control_channel import ControlLoop

    relays = [ControlLoop(relay_bind="tcp://127.0.0.1:0") for _ in range(2)]
    main = ControlLoop()
    try:
        for number, relay in enumerate(relays):
            main.send(relay.address, HandoffReady(room=number))
            peer, message = relay.wait_received(5)
            assert message == HandoffReady(room=number)
            relay.send(peer, HandoffAck(room=number, seq=0))
        answers = sorted(messages_only(main, 2), key=lambda a: a[1].room)
        assert [(a[0], a[1]) for a in answers] == [
            (relays[n].address, HandoffAck(room=n, seq=0)) for n in range(2)]
        assert messages_only(main, 0) == [] and relays[0].received() == []
    finally:
        for loop in (*relays, main):
            loop.close()


def messages_only(loop, count, timeout_s=5.0):
    """The next ``count`` protocol messages a main loop received, skipping connection notes."""
    from pdd_sglang.protocol.control_channel import PeerState

    got, deadline = [], time.monotonic() + timeout_s
    while len(got) < count and time.monotonic() < deadline:
        item = loop.wait_received(0.1)
        if item is not None and not isinstance(item[1], PeerState):
            got.append(item)
    return got + [item for item in loop.received() if not isinstance(item[1], PeerState)]


def test_a_main_learns_at_once_that_its_relay_is_gone():
    from pdd_sglang.protocol.control_channel import ControlLoop, PeerState

    relay = ControlLoop(relay_bind="tcp://127.0.0.1:0")
    main = ControlLoop()
    address = relay.address
    try:
        main.send(address, HandoffReady(room=1))
        assert relay.wait_received(5)[1] == HandoffReady(room=1)
        assert main.wait_received(5) == (address, PeerState(address, True))
        relay.close()  # the relay process goes away: its TCP connection drops
        assert main.wait_received(10) == (address, PeerState(address, False))
    finally:
        main.close()


def test_control_loop_counts_what_it_refuses(keys):
    from pdd_sglang.protocol.control_channel import ControlLoop

    relay = ControlLoop(relay_bind="tcp://127.0.0.1:0", curve=keys["relay"])
    stranger = ControlLoop(curve=keys["stranger"])
    context = zmq.Context()
    raw = context.socket(zmq.DEALER)
    try:
        stranger.send(relay.address, HandoffReady(room=1))
        assert relay.wait_received(1.0) is None
        deadline = time.monotonic() + 5
        while relay.refusals["unauthorized_peer"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert relay.refusals["unauthorized_peer"] >= 1
    finally:
        raw.close(linger=0)
        context.term()
        stranger.close()
        relay.close()
    plain = ControlLoop(relay_bind="tcp://127.0.0.1:0")
    context = zmq.Context()
    raw = context.socket(zmq.DEALER)
    try:
        raw.connect(plain.address)
        raw.send(b"\x93garbage")
        deadline = time.monotonic() + 5
        while plain.refusals["malformed"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert plain.refusals["malformed"] == 1
    finally:
        raw.close(linger=0)
        context.term()
        plain.close()


def pdd_threads() -> list[str]:
    """Threads a control loop owns: its I/O thread and ZMQ's authenticator."""
    import threading

    return [t.name for t in threading.enumerate()
            if t.name == "pdd-control" or type(t).__name__ == "AuthenticationThread"]



def test_close_flushes_the_last_messages_joins_every_thread_and_is_idempotent(keys):
    from pdd_sglang.protocol.control_channel import ControlLoop

    assert pdd_threads() == []
    relay = ControlLoop(relay_bind="tcp://127.0.0.1:0", curve=keys["relay"])
    main = ControlLoop(curve=keys["main"])
    main.send(relay.address, HandoffReady(room=7))
    peer, _ = relay.wait_received(5)
    assert len(pdd_threads()) == 3  # two I/O threads, the relay's authenticator
    # Queued just before close: still delivered (a refusal that lets the peer finish a request).
    relay.send(peer, HandoffAck(room=7, seq=0))
    relay.close()
    assert [m for _, m in messages_only(main, 1)] == [HandoffAck(room=7, seq=0)]
    main.close()
    relay.close()
    main.close()
    assert pdd_threads() == []
    assert not relay.alive and not main.alive
    relay.send(peer, HandoffAck(room=7, seq=1))  # after close: dropped, silently


def test_two_relays_on_one_control_port_get_one_clear_error():
    from pdd_sglang.protocol.control_channel import ControlChannelError, ControlLoop

    first = ControlLoop(relay_bind="tcp://127.0.0.1:0")
    try:
        with pytest.raises(ControlChannelError, match="already in use.*--pdd-control-port"):
            ControlLoop(relay_bind=first.address)
        assert pdd_threads() == ["pdd-control"]  # the refused one left nothing running
    finally:
        first.close()


def test_a_dead_control_thread_never_makes_send_raise_on_the_scheduler_thread(caplog):
    from pdd_sglang.protocol.control_channel import ControlLoop

    loop = ControlLoop()

    def broken():
        raise RuntimeError("injected: the I/O thread fails")

    loop._flush_outbox = broken
    loop.send("tcp://127.0.0.1:1", HandoffReady(room=1))  # wakes the thread, which dies
    loop._thread.join(5)
    assert not loop.alive
    with caplog.at_level("ERROR"):
        for room in range(5000):  # far past ZMQ's buffer of unread wake-ups
            loop.send("tcp://127.0.0.1:1", HandoffReady(room=room))
    dead = [r for r in caplog.records if "control loop is not running" in r.getMessage()]
    assert len(dead) == 1
    loop.close()
    assert pdd_threads() == []
