"""Property tests of the PDD message decoder: arbitrary bytes are refused, never crash it."""

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from pdd_sglang.protocol.messages import (
    HandoffTokens, MessageError, PROTOCOL_VERSION, decode, encode, pack_tokens,
)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=4096))
def test_arbitrary_bytes_are_decoded_or_refused_with_a_reason(data):
    try:
        decode(data)
    except MessageError as err:
        assert err.reason in {"malformed", "unknown_version", "oversized", "out_of_range",
                              "unexpected_type"}


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=8)
    | st.binary(max_size=16),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["version", "body", "type", "room", "seq"]), json_values))
def test_structured_garbage_is_refused_with_a_reason(obj):
    try:
        decode(msgspec.msgpack.encode(obj))
    except MessageError:
        pass


@settings(max_examples=200, deadline=None)
@given(room=st.integers(0, 2**63 - 1), seq=st.integers(0, 10**6), start=st.integers(0, 10**6),
       tokens=st.lists(st.integers(0, 2**31 - 1), max_size=300), is_last=st.booleans())
def test_valid_handoff_chunks_round_trip(room, seq, start, tokens, is_last):
    message = HandoffTokens(room=room, seq=seq, start=start, token_ids=pack_tokens(tokens),
                            is_last=is_last)
    decoded = decode(encode(message))
    assert decoded == message and decoded.tokens == tokens
    # The envelope carries the version this side speaks (3 since issue 50's staging ring).
    assert msgspec.msgpack.decode(encode(message))["version"] == PROTOCOL_VERSION == 3
