"""Packed KV on the WAN path (issues 36, 50): the ring of records prefill writes into at main.

A main registers a staging region with its Mooncake engine and gives each prefill that writes
to it a **ring** of it (:class:`RingLayout`), named in every hello of that prefill's rooms
(``DestinationHello.staging_addr`` / ``staging_bytes`` / ``staging_slot_bytes``). A ring is:

- at offset 0, the **freed words** (one little-endian uint64 per slot), written by main only:
  ``freed[i]`` is one more than the sequence number of the last record main has landed (or
  refused) from slot ``i``; prefill reads them, one-sided, as its credits;
- then the **arrived words** (one per slot), written by prefill only: ``arrived[i]`` is one more
  than the sequence number of the last record written into slot ``i``, written only once
  Mooncake has said that record's write ended (so main never reads a record still landing);
- then ``slots`` slots of ``slot_bytes``, each holding one record at a time.

A slot is written by prefill only while main has landed what it last held (``freed[i]`` caught
up with what prefill last wrote there) or when prefill's own last write there never arrived and
Mooncake has ended it; main reads a slot only while ``arrived[i] > freed[i]``. So the two never
touch a slot at once. Sequence numbers are prefill's, one count per ring, so a word left by an
older record is never taken for a newer one.

A **record** (:data:`RECORD`): the room, its sequence number, its page count, its frame's length,
a CRC-32 of the header and the page ids; the destination page ids (int32); and one
:mod:`pdd_sglang.kv_codec` frame of those pages' KV (per pool buffer, then page, then the page's
bytes, :mod:`pdd_sglang.kv_codec.pool`). An **end record** (:data:`END`) says a room's copy to
this main is complete: how many records it had, their raw KV bytes; prefill writes it last (even
when the copy went one-sided: then 0 records), and says the room's KV landed only once it has
arrived. Stateless: nothing here is a shared table.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Optional

import numpy as np

from pdd_sglang.kv_codec import HEADER as FRAME_HEADER, CorruptFrame

# magic, room, sequence, pages, frame bytes, CRC-32 of the fields before it and the page ids
RECORD = struct.Struct("<4sQQIQI")
RECORD_MAGIC = b"PDKR"
# magic, room, sequence, records, raw KV bytes, CRC-32 of the fields before it
END = struct.Struct("<4sQQIQI")
END_MAGIC = b"PDKE"
PAGE_ID = np.dtype("<i4")
WORD = np.dtype("<u8")
ALIGN = 64


def record_overhead(pages: int) -> int:
    """Bytes a record adds to its pages' KV at most: its header, page ids, the frame's header
    (a codec whose frame would outgrow the raw one is replaced by the raw codec's)."""
    return RECORD.size + PAGE_ID.itemsize * pages + FRAME_HEADER.size


def pages_per_slot(slot_bytes: int, page_bytes: int) -> int:
    """The most pages one record of a ``slot_bytes`` slot carries raw (0: not even one)."""
    if page_bytes <= 0:
        return 0
    pages = max((slot_bytes - record_overhead(0)) // (page_bytes + PAGE_ID.itemsize), 0)
    return int(pages)


def _aligned(n: int) -> int:
    return -(-int(n) // ALIGN) * ALIGN


@dataclass(frozen=True)
class RingLayout:
    """Where a ring's words and slots lie, from its base address, size and slot size."""

    addr: int
    nbytes: int
    slot_bytes: int

    @classmethod
    def for_slots(cls, addr: int, slots: int, slot_bytes: int) -> "RingLayout":
        return cls(addr, _aligned(2 * WORD.itemsize * slots) + slots * slot_bytes, slot_bytes)

    @property
    def slots(self) -> int:
        if self.slot_bytes <= 0:
            return 0
        slots = self.nbytes // (self.slot_bytes + 2 * WORD.itemsize)
        while slots and _aligned(2 * WORD.itemsize * slots) + slots * self.slot_bytes > self.nbytes:
            slots -= 1
        return int(slots)

    @property
    def freed_addr(self) -> int:
        return self.addr

    def arrived_addr(self, slot: int) -> int:
        return self.addr + WORD.itemsize * (self.slots + slot)

    def slot_offset(self, slot: int) -> int:
        """A slot's offset from the ring's base."""
        return _aligned(2 * WORD.itemsize * self.slots) + slot * self.slot_bytes

    def slot_addr(self, slot: int) -> int:
        return self.addr + self.slot_offset(slot)


def pack_record(room: int, seq: int, pages: np.ndarray, frame_len: int) -> bytes:
    """A record's header and page ids: what precedes its frame of ``frame_len`` bytes (a sender
    writes the frame beside it, or gathers its payload in place)."""
    ids = np.ascontiguousarray(pages, dtype=PAGE_ID).tobytes()
    head = struct.pack("<4sQQIQ", RECORD_MAGIC, room, seq, len(pages), frame_len)
    return head + struct.pack("<I", zlib.crc32(ids, zlib.crc32(head))) + ids


def record_frame_offset(pages: int) -> int:
    """Where a record's frame starts, from the record's start."""
    return RECORD.size + PAGE_ID.itemsize * pages


def pack_end(room: int, seq: int, records: int, raw_bytes: int) -> bytes:
    head = struct.pack("<4sQQIQ", END_MAGIC, room, seq, records, raw_bytes)
    return head + struct.pack("<I", zlib.crc32(head))


@dataclass(frozen=True)
class Record:
    """What main read from a slot: a record (``pages`` and ``frame``) or an end record
    (``end``: its records and raw bytes)."""

    room: int
    seq: int
    pages: Optional[np.ndarray] = None
    frame: Optional[memoryview] = None
    end: Optional[tuple[int, int]] = None


def read_slot(view: memoryview, seq: int) -> Record:
    """The record in a slot that prefill said holds record ``seq``, every header and CRC checked
    before a byte of it is used (the frame's own CRC is checked as it decodes)."""
    if len(view) < RECORD.size:
        raise CorruptFrame(f"a slot of {len(view)} bytes holds no record")
    magic = bytes(view[:4])
    if magic == END_MAGIC:
        _, room, got_seq, records, raw, crc = END.unpack_from(view)
        if zlib.crc32(bytes(view[:END.size - 4])) != crc or got_seq != seq:
            raise CorruptFrame(f"the end record of slot seq {seq} is damaged (seq {got_seq})")
        return Record(room, seq, end=(records, raw))
    if magic != RECORD_MAGIC:
        raise CorruptFrame(f"slot seq {seq} holds no record (magic {magic!r})")
    _, room, got_seq, pages, frame_len, crc = RECORD.unpack_from(view)
    ids_end = RECORD.size + PAGE_ID.itemsize * pages
    if got_seq != seq or ids_end + frame_len > len(view):
        raise CorruptFrame(f"record seq {seq} of room {room} is damaged ({pages} pages, "
                           f"{frame_len} B, seq {got_seq})")
    head, ids = bytes(view[:RECORD.size - 4]), bytes(view[RECORD.size:ids_end])
    if zlib.crc32(ids, zlib.crc32(head)) != crc:
        raise CorruptFrame(f"record seq {seq} of room {room} fails its CRC-32")
    return Record(room, seq, pages=np.frombuffer(ids, PAGE_ID),
                  frame=view[ids_end:ids_end + frame_len])
