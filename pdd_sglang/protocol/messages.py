"""Every message PDD adds between servers: versioned structs with named fields, one module.

Encoded with msgspec's MessagePack (SGLang already ships msgspec). Each struct is tagged with its
type name, and every encoded message is an :class:`Envelope` carrying the protocol version, so a
peer of another version is refused by name instead of misread by position. Decoding enforces a
size limit before parsing and validates field types and ranges after.
"""

from __future__ import annotations

from typing import Literal, Optional, Union

import msgspec

# 2: a main's hello may offer a staging range for coded KV (issue 36); a peer of version 1
# cannot read coded copies, so it is refused by name (``unknown_version``).
# 3: the staging main offers is a ring of slots shared by the rooms of one prefill rank
# (issue 50: ``staging_slot_bytes``); a peer of version 2 would write one range per room into it.
PROTOCOL_VERSION = 3
# A relay's last stream chunk for a request it handed to main has this finish-reason type.
HANDOFF_FINISH_TYPE = "pdd_handoff"
# The reason a relay gives when it refuses main's handoff because it answered the request alone
# (HandoffRefused.reason); main then aborts its copy with it in the message, which tells the
# router the copy only warms main's cache (router/landing.py).
FINISHED_AT_RELAY = "finished_at_relay"
# Far above any real message (a handoff of 4096 token ids is ~20 KB): a bound, not a budget.
MAX_MESSAGE_BYTES = 1 << 20

Role = Literal["prefill", "relay", "main"]


class MessageError(ValueError):
    """A message was refused; ``reason`` is a short stable label for metrics."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class DestinationHello(msgspec.Struct, tag=True, frozen=True, forbid_unknown_fields=True,
                       omit_defaults=True):
    """A decode server's PDD facts about one room, sent with its transfer metadata to prefill.

    ``destinations`` is how many decode servers receive this room's KV (2 on P->RLD->MD), and
    ``prefix_tokens`` the prefix this destination already holds, so prefill sends it only the rest.
    ``tp_size`` is the sender's attention TP size: it tells prefill how many ranks of this
    destination register with each prefill rank (:func:`sessions_per_prefill_rank`), and prefill
    refuses a size its own cannot pair with (:func:`tp_refusal`). At 1 it is left out of the
    encoding, which is then the same as before the field existed.

    ``staging_addr`` / ``staging_bytes`` / ``staging_slot_bytes``: the ring of main's staging
    region, registered with its Mooncake engine, that this prefill rank writes packed KV records
    into, slots of ``staging_slot_bytes`` each, shared by all its rooms to this main rank
    (:class:`pdd_sglang.kv_codec.wire.RingLayout`); 0 bytes: every copy to it goes one-sided
    into its pages.
    """

    room: int
    role: Role
    destinations: int
    prefix_tokens: int
    tp_size: int = 1
    staging_addr: int = 0
    staging_bytes: int = 0
    staging_slot_bytes: int = 0


def sessions_per_prefill_rank(decode_tp: int, prefill_tp: int) -> int:
    """How many ranks of one decode server register with each prefill rank for a room, by
    SGLang's rank mapping (``CommonKVManager._resolve_rank_mapping``): a decode at a larger TP
    sends ``decode_tp // prefill_tp`` ranks to each prefill rank (each gets its own heads); a
    decode at a smaller TP sends each rank to ``prefill_tp // decode_tp`` prefill ranks, one
    session at each (each prefill rank writes its own heads)."""
    return max(1, decode_tp // prefill_tp)


def tp_refusal(role: str, decode_tp: int, prefill_tp: int) -> Optional[str]:
    """Why prefill refuses a :class:`DestinationHello` of another TP size, or None (issue 37):
    the prefill's refusal, and the decode's own log line when it sees it coming. SGLang's PD
    pairs ranks of different TP sizes by whole ratios (any MHA/GQA or MLA model, heads sliced
    or replicated as SGLang does); sizes of which neither divides the other have no such
    pairing, and SGLang's integer arithmetic would pair the wrong ranks."""
    small, large = sorted((int(decode_tp), int(prefill_tp)))
    if small >= 1 and large % small == 0:
        return None
    return (f"the {role} runs --tp-size {decode_tp}, this prefill --tp-size {prefill_tp}: "
            "SGLang's PD pairs prefill and decode ranks by whole ratios, so one TP size must "
            "divide the other (e.g. 1, 2, 4, 8)")


# Bytes of a KV digest (blake2b): what main received across the WAN, checked by the relay.
KV_DIGEST_BYTES = 16


class HandoffReady(msgspec.Struct, tag=True, frozen=True, forbid_unknown_fields=True,
                   omit_defaults=True):
    """Main to relay: main holds the room's whole prompt KV and can take the request over.

    With ``--pdd-enable-kv-digest``, ``kv_digest`` fingerprints the prompt KV main received
    across the WAN (positions ``kv_digest_start`` onward; the rest was in main's cache), and the
    relay compares it with its own copy, which came over the local path. Without it both fields
    are left out of the encoding, which is then the same as before they existed.
    """

    room: int
    kv_digest: bytes = b""
    kv_digest_start: int = 0


class HandoffTokens(msgspec.Struct, tag=True, frozen=True, forbid_unknown_fields=True):
    """Relay to main: the token IDs the relay generated, positions ``start`` onward.

    ``seq`` numbers the chunks of one room from 0 (Catch-Up sends several; One-Shot one, with
    ``is_last``). Token IDs travel as a packed little-endian int32 array: 4 bytes per token.
    """

    room: int
    seq: int
    start: int
    token_ids: bytes
    is_last: bool

    @property
    def tokens(self) -> list[int]:
        import array

        values = array.array("i")
        values.frombytes(self.token_ids)
        return values.tolist()


class HandoffAck(msgspec.Struct, tag=True, frozen=True, forbid_unknown_fields=True):
    """Main to relay: chunk ``seq`` absorbed; with Catch-Up, the relay sends the next."""

    room: int
    seq: int


class HandoffRefused(msgspec.Struct, tag=True, frozen=True, forbid_unknown_fields=True):
    """Either side: the handoff of ``room`` will not happen; ``reason`` is a metric label."""

    room: int
    reason: str


class Envelope(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    version: int
    body: Union[DestinationHello, HandoffReady, HandoffTokens, HandoffAck, HandoffRefused]


def pack_tokens(token_ids) -> bytes:
    import array

    return array.array("i", token_ids).tobytes()


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


MAX_HANDOFF_TOKENS = 1 << 16


def _validate(body) -> None:
    if isinstance(body, DestinationHello):
        if body.destinations not in (1, 2):
            raise MessageError("out_of_range", f"destinations={body.destinations}")
        if body.prefix_tokens < 0:
            raise MessageError("out_of_range", f"prefix_tokens={body.prefix_tokens}")
        if body.staging_addr < 0 or body.staging_bytes < 0 or body.staging_slot_bytes < 0 or (
                body.staging_bytes and (body.role != "main" or not body.staging_addr
                                        or not 0 < body.staging_slot_bytes
                                        <= body.staging_bytes)):
            raise MessageError("out_of_range", f"a staging ring of {body.staging_bytes} bytes "
                                               f"(slots of {body.staging_slot_bytes}) at "
                                               f"{body.staging_addr} from a {body.role}")
    elif isinstance(body, HandoffTokens):
        if body.seq < 0 or body.start < 0:
            raise MessageError("out_of_range", f"seq={body.seq} start={body.start}")
        if len(body.token_ids) % 4 or len(body.token_ids) // 4 > MAX_HANDOFF_TOKENS:
            raise MessageError("out_of_range", f"{len(body.token_ids)} bytes of token ids")
    elif isinstance(body, HandoffReady):
        if len(body.kv_digest) not in (0, KV_DIGEST_BYTES) or body.kv_digest_start < 0:
            raise MessageError("out_of_range", f"a {len(body.kv_digest)}-byte KV digest from "
                                               f"position {body.kv_digest_start}")
    elif isinstance(body, HandoffAck) and body.seq < 0:
        raise MessageError("out_of_range", f"seq={body.seq}")
    elif isinstance(body, HandoffRefused) and not (0 < len(body.reason) <= 64):
        raise MessageError("out_of_range", "reason must be 1-64 characters")


def check_token_ids(tokens: list[int], vocab_size: int) -> None:
    """Token IDs a receiver is about to feed its model: each in ``[0, vocab_size)``."""
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        raise MessageError("token_out_of_vocab", f"{bad[:5]} not in [0, {vocab_size})")


# ---- between router workers (``--workers N``, pdd_sglang/router/shared_state.py) ------------
# One Unix stream socket per pair of a router's workers, each frame a 4-byte length then one
# event. The bus's first frame is a :class:`WorkerHello` naming the sender's events version; a
# worker of another version is refused by name. Array-like, so an event costs a few bytes: one
# is sent per copy started or ended, at hundreds of requests a second.
ROUTER_EVENTS_VERSION = 2  # 2: CopyBegun.relay_covered, CopyUncovered
# A prefix mirror's key: a text prompt's text, or its token ids (router/prompt.py).
MirrorKey = Union[str, list[int]]


class WorkerHello(msgspec.Struct, tag=True, frozen=True, array_like=True):
    """A bus's first message: who sends, in which version of the events."""

    version: int
    worker: int


class MirrorInsert(msgspec.Struct, tag=True, frozen=True, array_like=True):
    """Main ``main`` now caches ``key`` (a finished answer's prompt and text)."""

    main: str
    key: MirrorKey


class MirrorHit(msgspec.Struct, tag=True, frozen=True, array_like=True):
    """Main reported how much of ``key`` it really held: ``held`` key units."""

    main: str
    key: MirrorKey
    held: int


class MirrorsCleared(msgspec.Struct, tag=True, frozen=True, array_like=True):
    """Every main's cache was flushed (the router's /flush_cache)."""


class LandingStarted(msgspec.Struct, tag=True, frozen=True, array_like=True):
    """Main's WAN copy of a prompt the relay answered alone goes on; ``name``: worker:number."""

    name: str
    main: str
    key: MirrorKey
    cached_before: int


class LandingEnded(msgspec.Struct, tag=True, frozen=True, array_like=True):
    name: str
    main: str


class CopyBegun(msgspec.Struct, tag=True, frozen=True, array_like=True):
    """A copy of ``kv_bytes`` to ``main`` joins the line (router/line_state.py); a relay answers
    its request meanwhile when ``relay_covered`` (main's leg of P->RLD->MD)."""

    name: str
    main: str
    kv_bytes: int
    started: float  # time.monotonic(): one clock for every process of the host
    relay_covered: bool = False


class CopyOnWire(msgspec.Struct, tag=True, frozen=True, array_like=True):
    name: str
    at: float


class CopyCacheOnly(msgspec.Struct, tag=True, frozen=True, array_like=True):
    name: str


class CopyUncovered(msgspec.Struct, tag=True, frozen=True, array_like=True):
    """The copy's relay was lost: its request waits for it now."""

    name: str


class CopyEnded(msgspec.Struct, tag=True, frozen=True, array_like=True):
    name: str
    landed: bool
    at: float


RouterEvent = Union[MirrorInsert, MirrorHit, MirrorsCleared, LandingStarted, LandingEnded,
                    CopyBegun, CopyOnWire, CopyCacheOnly, CopyUncovered, CopyEnded]
_ROUTER_ENCODER = msgspec.msgpack.Encoder()
_ROUTER_DECODER = msgspec.msgpack.Decoder(Union[RouterEvent, WorkerHello])


def encode_router_event(event) -> bytes:
    """One event (or a :class:`WorkerHello`) of the router workers' bus, unframed."""
    return _ROUTER_ENCODER.encode(event)


def decode_router_event(data) -> Union[RouterEvent, WorkerHello]:
    """One event of the bus; :class:`MessageError` ``malformed`` on any defect."""
    try:
        return _ROUTER_DECODER.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as err:
        raise MessageError("malformed", str(err)) from None
