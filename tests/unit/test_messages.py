import msgspec
import pytest

from pdd_sglang.protocol import messages
import typing

from pdd_sglang.protocol.messages import (
    DestinationHello, HandoffAck, HandoffReady, HandoffRefused, HandoffTokens, MessageError,
    check_token_ids, decode, encode, pack_tokens,
)

ALL_MESSAGES = [
    DestinationHello(room=12345678901234, role="main", destinations=2, prefix_tokens=4096),
    DestinationHello(room=9, role="main", destinations=1, prefix_tokens=0,
                     staging_addr=0x7F0000001000, staging_bytes=1 << 20,
                     staging_slot_bytes=1 << 16),
    HandoffReady(room=7),
    HandoffReady(room=7, kv_digest=bytes(range(16)), kv_digest_start=4096),
    HandoffTokens(room=7, seq=3, start=65, token_ids=pack_tokens(range(100)), is_last=False),
    HandoffAck(room=7, seq=3),
    HandoffRefused(room=7, reason="unknown_room"),
]


@pytest.mark.parametrize("message", ALL_MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(message):
    assert decode(encode(message)) == message


def test_every_message_type_has_a_round_trip_case():
    body_types = set(typing.get_args(typing.get_type_hints(messages.Envelope)["body"]))
    assert body_types == {type(m) for m in ALL_MESSAGES}


def test_a_ready_without_a_digest_encodes_as_before_the_digest_existed():
    # Relays and mains that predate the digest read it; only a digest is new on the wire.
    legacy = msgspec.msgpack.encode({"version": messages.PROTOCOL_VERSION,
                                     "body": {"type": "HandoffReady", "room": 7}})
    assert encode(HandoffReady(room=7)) == legacy


def test_handoff_payload_is_at_most_16_bytes_per_token_plus_a_constant():
    sizes = {n: len(encode(HandoffTokens(room=2**62, seq=0, start=0, token_ids=pack_tokens(
        range(n)), is_last=True))) for n in (1, 100, 1000)}
    per_token = (sizes[1000] - sizes[100]) / 900
    assert per_token <= 16, sizes
    print(f"handoff payload: {sizes} bytes; {per_token:.1f} B/token")


def test_token_ids_outside_the_vocabulary_are_refused():
    check_token_ids([0, 5, 1003], vocab_size=1004)
    with pytest.raises(MessageError) as err:
        check_token_ids([3, 1004], vocab_size=1004)
    assert err.value.reason == "token_out_of_vocab"


@pytest.mark.parametrize("bad", [
    HandoffTokens(room=1, seq=-1, start=0, token_ids=b"", is_last=True),
    HandoffTokens(room=1, seq=0, start=0, token_ids=b"\x00\x01\x02", is_last=True),
    HandoffRefused(room=1, reason=""),
    HandoffReady(room=1, kv_digest=b"short"),
    HandoffReady(room=1, kv_digest=bytes(16), kv_digest_start=-1),
])
def test_handoff_fields_out_of_range_are_refused(bad):
    with pytest.raises(MessageError) as err:
        decode(encode(bad))
    assert err.value.reason == "out_of_range"


def test_unknown_version_is_refused_by_name():
    data = msgspec.msgpack.encode({"version": 99, "body": {"type": "DestinationHello"}})
    with pytest.raises(MessageError) as err:
        decode(data)
    assert err.value.reason == "unknown_version"


def test_oversized_is_refused_before_parsing():
    with pytest.raises(MessageError) as err:
        decode(b"\x00" * (messages.MAX_MESSAGE_BYTES + 1))
    assert err.value.reason == "oversized"


@pytest.mark.parametrize("data", [b"", b"\xc1", encode(ALL_MESSAGES[0])[:-3]])
def test_truncated_or_garbage_is_malformed(data):
    with pytest.raises(MessageError) as err:
        decode(data)
    assert err.value.reason == "malformed"


def test_out_of_range_fields_are_refused():
    bad = DestinationHello(room=1, role="relay", destinations=3, prefix_tokens=0)
    with pytest.raises(MessageError) as err:
        decode(encode(bad))
    assert err.value.reason == "out_of_range"


def test_unknown_role_is_malformed():
    data = msgspec.msgpack.encode({"version": messages.PROTOCOL_VERSION, "body": {
        "type": "DestinationHello", "room": 1, "role": "router", "destinations": 1,
        "prefix_tokens": 0}})
    with pytest.raises(MessageError) as err:
        decode(data)
    assert err.value.reason == "malformed"


def test_a_tp_1_hello_encodes_as_before_tp_size_existed():
    """``tp_size`` (issue 23) is left out at 1: a TP 1 hello is byte for byte the old one."""
    hello = DestinationHello(room=5, role="relay", destinations=2, prefix_tokens=16)
    assert b"tp_size" not in encode(hello)
    assert decode(encode(DestinationHello(room=5, role="relay", destinations=2, prefix_tokens=16,
                                          tp_size=2))).tp_size == 2


@pytest.mark.parametrize("version", [1, 2])
def test_a_peer_of_an_older_version_is_refused_by_name(version):
    """Version 2 (issue 36): a main may offer a staging range for coded KV, which a peer of
    version 1 cannot read; version 3 (issue 50): that staging is a ring of slots shared by a
    prefill rank's rooms, into which a peer of version 2 would write one range per room. Their
    messages are refused naming both versions."""
    old = msgspec.msgpack.encode({"version": version, "body": {
        "type": "DestinationHello", "room": 1, "role": "main", "destinations": 1,
        "prefix_tokens": 0}})
    with pytest.raises(MessageError) as err:
        decode(old)
    assert err.value.reason == "unknown_version" and f"version {version}" in str(err.value)
    assert f"speaks {messages.PROTOCOL_VERSION}" in str(err.value)


@pytest.mark.parametrize("fields", [
    dict(role="relay", staging_addr=4096, staging_bytes=64, staging_slot_bytes=8),  # main only
    dict(role="main", staging_addr=0, staging_bytes=64, staging_slot_bytes=8),
    dict(role="main", staging_addr=4096, staging_bytes=-1),
    dict(role="main", staging_addr=4096, staging_bytes=64),  # no slot size
    dict(role="main", staging_addr=4096, staging_bytes=64, staging_slot_bytes=128),
])
def test_a_bad_staging_range_is_refused(fields):
    with pytest.raises(MessageError) as err:
        decode(encode(DestinationHello(room=1, destinations=1, prefix_tokens=0, **fields)))
    assert err.value.reason == "out_of_range"


# ---- the router workers' bus (--workers N) -------------------------------------------------
ROUTER_EVENTS = [
    messages.MirrorInsert("http://main:1", "a text prompt"), messages.MirrorInsert("m", [1, 2, 3]),
    messages.MirrorHit("m", "hello", 2), messages.MirrorsCleared(),
    messages.LandingStarted("0:1", "m", [1, 2], 1), messages.LandingEnded("0:1", "m"),
    messages.CopyBegun("0:2", "m", 5000, 12.5), messages.CopyOnWire("0:2", 13.0),
    messages.CopyBegun("0:3", "m", 5000, 12.5, True), messages.CopyUncovered("0:3"),
    messages.CopyCacheOnly("0:2"), messages.CopyEnded("0:2", True, 14.0),
    messages.WorkerHello(messages.ROUTER_EVENTS_VERSION, 3),
]


@pytest.mark.parametrize("event", ROUTER_EVENTS, ids=lambda e: type(e).__name__)
def test_router_event_round_trip(event):
    assert messages.decode_router_event(messages.encode_router_event(event)) == event


def test_every_router_event_type_has_a_round_trip_case():
    types = set(typing.get_args(messages.RouterEvent)) | {messages.WorkerHello}
    assert types == {type(e) for e in ROUTER_EVENTS}


@pytest.mark.parametrize("data", [b"", b"\xc1", msgspec.msgpack.encode(["NoSuchEvent", 1])])
def test_a_malformed_router_event_is_refused(data):
    with pytest.raises(MessageError) as err:
        messages.decode_router_event(data)
    assert err.value.reason == "malformed"
