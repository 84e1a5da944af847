"""What other threads tell the prefill fan-out's owner: one frozen dataclass per event.

Posted on :attr:`PrefillFanout.events <pdd_sglang.prefill.fanout.PrefillFanout>` by SGLang's
bootstrap thread (:class:`Registered`), the scheduler (:class:`ChunkReady`, :class:`RoomCleared`), the senders
(:class:`ChunkSent`), the bootstrap thread again (:class:`AbortNotified`) the peer thread (:class:`ProbeAnswered`) and the cache-only intake (:class:`CacheOnly`, :class:`RelayLost`); applied in order by the owner.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from pdd_sglang.prefill.room import Work
from pdd_sglang.protocol.messages import DestinationHello


@dataclasses.dataclass(frozen=True)
class Registered:
    room: int
    session: str
    info: Any  # SGLang's TransferInfo, parsed on the bootstrap thread
    hello: Optional[DestinationHello]
    refusal: Optional[str] = None  # a hello the bootstrap thread could not accept


@dataclasses.dataclass(frozen=True)
class ChunkReady:
    chunk: Any  # SGLang's TransferKVChunk


@dataclasses.dataclass(frozen=True)
class RoomCleared:
    """SGLang's sender let the room go (finished, failed, aborted): its request is over."""

    room: int


@dataclasses.dataclass(frozen=True)
class ChunkSent:
    work: Work
    ok: Optional[bool]  # None: skipped, the room had already ended at SGLang
    reason: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class ProbeAnswered:
    session: str
    ok: bool


@dataclasses.dataclass(frozen=True)
class AbortNotified:
    """A destination aborted its request (SGLang's ABORT to the prefill's bootstrap thread)."""

    room: int
    decode_ip: Optional[str]
    decode_port: Optional[int]
    ack_target: Any  # SGLang's AckTarget, or None: that decode waits for no ack


@dataclasses.dataclass(frozen=True)
class CacheOnly:
    """The router: ``room``'s relay answered alone, so main's copy only warms its cache (the
    cache-only intake thread, :mod:`pdd_sglang.prefill.cache_only`)."""

    room: int


@dataclasses.dataclass(frozen=True)
class RelayLost:
    """The router: ``room``'s relay died while it answered, so main's copy is the request's only
    way on (the same intake thread)."""

    room: int
