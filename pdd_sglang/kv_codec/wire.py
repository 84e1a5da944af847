"""Coded KV on the WAN path (issue 36): what prefill writes into a main's staging region.

A main that can take coded copies reserves, per room, a range of its staging region (registered
with its Mooncake engine) and names it in its hello (``DestinationHello.staging_addr`` /
``staging_bytes``). Prefill writes that range, one-sided, as:

- at offset 0, the **end record** (:data:`END`, padded to :data:`END_BYTES`): the room, how many
  records follow and their bytes, and the raw KV bytes they hold; written last, once per room and
  destination, even when every copy went raw (then 0 records), so a main that offered staging
  always finds it once prefill says the room's KV landed;
- from :data:`END_BYTES` on, one **record** per coded slice: a header (:data:`RECORD`: the room,
  the page count, the frame's length, a CRC-32 of the header and the page ids), the destination
  page ids (int32), and one :mod:`pdd_sglang.kv_codec` frame of those pages' KV.

Main reads it on the thread that owns its pool (:func:`read_end`, :func:`records`), checks every
header and CRC before decoding a byte into a page, and only into pages it gave that room. A frame's
KV is laid out per pool buffer (K and V of each layer), then page, then the page's bytes
(:mod:`pdd_sglang.kv_codec.pool`). Stateless: nothing here is a shared table.
"""

from __future__ import annotations

import struct
import zlib
from typing import Iterator

import numpy as np

from pdd_sglang.kv_codec import HEADER as FRAME_HEADER, CorruptFrame

# magic, room, records, record bytes (wire), raw KV bytes, CRC-32 of the fields before it
END = struct.Struct("<4sQIQQI")
END_MAGIC = b"PDKE"
END_BYTES = 64
# magic, room, pages, frame bytes, CRC-32 of the fields before it and the page ids
RECORD = struct.Struct("<4sQIQI")
RECORD_MAGIC = b"PDKR"
PAGE_ID = np.dtype("<i4")


def record_overhead(pages: int) -> int:
    """Bytes a record adds to its pages' KV at most: its header, page ids, the frame's header
    (a codec whose frame would outgrow the raw one is replaced by the raw codec's)."""
    return RECORD.size + PAGE_ID.itemsize * pages + FRAME_HEADER.size


def staging_bytes_for(pages: int, page_bytes: int) -> int:
    """A room's reservation for ``pages`` pages of ``page_bytes`` each: enough for any split of
    them into records, one page per record at worst."""
    return END_BYTES + pages * (page_bytes + record_overhead(1))


def pack_record(room: int, pages: np.ndarray, frame: bytes) -> bytes:
    ids = np.ascontiguousarray(pages, dtype=PAGE_ID).tobytes()
    head = struct.pack("<4sQIQ", RECORD_MAGIC, room, len(pages), len(frame))
    return head + struct.pack("<I", zlib.crc32(ids, zlib.crc32(head))) + ids + frame


def pack_end(room: int, records: int, wire_bytes: int, raw_bytes: int) -> bytes:
    head = struct.pack("<4sQIQQ", END_MAGIC, room, records, wire_bytes, raw_bytes)
    return (head + struct.pack("<I", zlib.crc32(head))).ljust(END_BYTES, b"\0")


def read_end(view: memoryview, room: int) -> tuple[int, int, int]:
    """``(records, wire_bytes, raw_bytes)`` of the end record at the start of ``view``."""
    if len(view) < END_BYTES:
        raise CorruptFrame(f"a staging range of {len(view)} bytes has no room for its end record")
    magic, got_room, records, wire, raw, crc = END.unpack_from(view)
    if magic != END_MAGIC:
        raise CorruptFrame(f"room {room}: prefill's end record is missing from main's staging "
                           "range (the copy was interrupted, or prefill predates the coded path)")
    if zlib.crc32(bytes(view[:END.size - 4])) != crc or got_room != room:
        raise CorruptFrame(f"room {room}: the end record in main's staging range is damaged or "
                           f"another room's ({got_room})")
    if END_BYTES + wire > len(view):
        raise CorruptFrame(f"room {room}: the end record claims {wire} bytes of records, past "
                           f"the {len(view) - END_BYTES} bytes reserved")
    return records, wire, raw


def records(view: memoryview, room: int, count: int, wire_bytes: int
            ) -> Iterator[tuple[np.ndarray, memoryview]]:
    """Each record's ``(page ids, frame)``, in order, every header checked before it is
    yielded; exactly ``count`` of them filling exactly ``wire_bytes``."""
    offset, end = END_BYTES, END_BYTES + wire_bytes
    for index in range(count):
        if offset + RECORD.size > end:
            raise CorruptFrame(f"room {room}: record {index} of {count} runs past the records' "
                               f"{wire_bytes} bytes")
        magic, got_room, pages, frame_len, crc = RECORD.unpack_from(view, offset)
        ids_end = offset + RECORD.size + PAGE_ID.itemsize * pages
        if magic != RECORD_MAGIC or got_room != room or ids_end + frame_len > end:
            raise CorruptFrame(f"room {room}: record {index} of {count} is damaged (magic "
                               f"{bytes(magic)!r}, room {got_room}, {pages} pages, {frame_len} B)")
        head = bytes(view[offset:offset + RECORD.size - 4])
        ids = bytes(view[offset + RECORD.size:ids_end])
        if zlib.crc32(ids, zlib.crc32(head)) != crc:
            raise CorruptFrame(f"room {room}: record {index} of {count} fails its CRC-32")
        yield np.frombuffer(ids, PAGE_ID), view[ids_end:ids_end + frame_len]
        offset = ids_end + frame_len
    if offset != end:
        raise CorruptFrame(f"room {room}: {count} records fill {offset - END_BYTES} bytes, the "
                           f"end record says {wire_bytes}")
