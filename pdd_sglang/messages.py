"""Every message PDD adds between servers: versioned structs with named fields, one module.

Encoded with msgspec's MessagePack (SGLang already ships msgspec). Each struct is tagged with its
type name, and every encoded message is an :class:`Envelope` carrying the protocol version, so a
peer of another version is refused by name instead of misread by position. Decoding enforces a
size limit before parsing and validates field types and ranges after.
"""

from __future__ import annotations

from typing import Literal, Optional, Union

import msgspec

PROTOCOL_VERSION = 1
# Far above any real message (a handoff of 4096 token ids is ~20 KB): a bound, not a budget.
MAX_MESSAGE_BYTES = 1 << 20

Role = Literal["prefill", "relay", "main"]
Pipeline = Literal["prefill_main", "prefill_relay_main", "relay_singular"]


class MessageError(ValueError):
    """A message was refused; ``reason`` is a short stable label for metrics."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class DestinationHello(msgspec.Struct, tag=True, frozen=True, forbid_unknown_fields=True):
    """A decode server's PDD facts about one room, sent with its transfer metadata to prefill.

    ``destinations`` is how many decode servers receive this room's KV (2 on P->RLD->MD), and
    ``prefix_tokens`` the prefix this destination already holds, so prefill sends it only the rest.
    """

    room: int
    role: Role
    destinations: int
    prefix_tokens: int


class Envelope(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    version: int
    body: Union[DestinationHello]


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Envelope)


def encode(body) -> bytes:
    return _ENCODER.encode(Envelope(version=PROTOCOL_VERSION, body=body))


def decode(data: bytes, expect: Optional[type] = None):
    """Decode one message; raise :class:`MessageError` with a reason label on any defect."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise MessageError("oversized", f"{len(data)} bytes > {MAX_MESSAGE_BYTES}")
    try:
        version = msgspec.msgpack.decode(data, type=_VersionOnly).version
    except (msgspec.DecodeError, msgspec.ValidationError) as err:
        raise MessageError("malformed", str(err)) from None
    if version != PROTOCOL_VERSION:
        raise MessageError("unknown_version", f"version {version}, this server speaks {PROTOCOL_VERSION}")
    try:
        body = _DECODER.decode(data).body
    except (msgspec.DecodeError, msgspec.ValidationError) as err:
        raise MessageError("malformed", str(err)) from None
    if expect is not None and not isinstance(body, expect):
        raise MessageError("unexpected_type", f"got {type(body).__name__}, expected {expect.__name__}")
    _validate(body)
    return body


class _VersionOnly(msgspec.Struct):
    version: int


def _validate(body) -> None:
    if isinstance(body, DestinationHello):
        if body.destinations not in (1, 2):
            raise MessageError("out_of_range", f"destinations={body.destinations}")
        if body.prefix_tokens < 0:
            raise MessageError("out_of_range", f"prefix_tokens={body.prefix_tokens}")
