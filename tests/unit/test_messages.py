import msgspec
import pytest

from pdd_sglang import messages
from pdd_sglang.messages import DestinationHello, MessageError, decode, encode

ALL_MESSAGES = [
    DestinationHello(room=12345678901234, role="main", destinations=2, prefix_tokens=4096),
]


@pytest.mark.parametrize("message", ALL_MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(message):
    assert decode(encode(message)) == message


def test_every_message_type_has_a_round_trip_case():
    body_types = set(messages.Envelope.__annotations__["body"].__args__) if hasattr(
        messages.Envelope.__annotations__["body"], "__args__") else {DestinationHello}
    covered = {type(m) for m in ALL_MESSAGES}
    assert {t for t in body_types if isinstance(t, type)} <= covered


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
