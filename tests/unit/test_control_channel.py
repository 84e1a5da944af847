"""The relay <-> main control channel over real ZMQ sockets on loopback, with and without CURVE."""

from __future__ import annotations

import time

import pytest
import zmq

from pdd_sglang.control_channel import CurveConfig, MainControlClient, RelayControlServer, keygen
from pdd_sglang.messages import HandoffAck, HandoffReady, HandoffTokens, pack_tokens


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
