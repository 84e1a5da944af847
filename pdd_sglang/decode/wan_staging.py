"""Main's staging region: where prefill writes coded KV, decoded into the pool before it lands.

Life cycle of a request's coded copy on a main (issue 36):

1. SGLang's decode receiver sends its transfer metadata; :meth:`MainStaging.offer` reserves a
   range of the region for the room (enough for its pages raw plus each record's overhead,
   :func:`pdd_sglang.kv_codec.wire.staging_bytes_for`), clears its end record, and the hello names
   it (``DestinationHello.staging_addr`` / ``staging_bytes``). No range free: 0 bytes, and
   prefill sends that room raw into the pages as before.
2. Prefill writes coded slices into the range, one-sided over the WAN, and its end record last
   (:mod:`pdd_sglang.kv_codec.wire`); a copy it sends raw goes straight into the pages and
   leaves the range's end record clear (prefill says the room landed only once every write of
   it has, so a clear end record means no record was written).
3. Prefill says the room's KV landed. When the receiver's poll first sees it,
   :meth:`MainStaging.land` reads the end record and every record, checks each header, CRC and
   page (only pages SGLang gave this room), decodes every frame, and only then writes the
   decoded KV into the pages, and frees the range. So the request counts as landed (SGLang's
   commit, the handoff's hold and EXTEND, the KV digest) only with its pages restored. A missing,
   damaged or foreign record fails the room (SGLang's failed-transfer path frees its pages and
   tells the client) with no page written.
4. A room that fails or is let go keeps its range until SGLang drops its receiver, which it
   does once it frees the room's pages (after prefill acked the abort, so no late write of the
   copy can still land); the next :meth:`sweep` (each offer, each ``/server_info``) frees it.

Owner: the scheduler thread (each TP rank its own region, pages and rooms): SGLang polls
receivers and sends their metadata there. Should a late write of a failed room's copy still land
in a range given to another room, the records carry the room and a CRC: that room fails cleanly
instead of decoding another's KV.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from pdd_sglang import seam
from pdd_sglang.kv_codec import DTYPES, HEADER, CorruptFrame, codec_named, frame_codec_name
from pdd_sglang.kv_codec.pool import PoolPages
from pdd_sglang.kv_codec.staging import StagingAllocator
from pdd_sglang.kv_codec.wire import END_BYTES, read_end, records, staging_bytes_for

logger = logging.getLogger(__name__)


@dataclass
class _Range:
    offset: int
    nbytes: int
    pages: np.ndarray  # the pages SGLang gave this room: the only ones a record may name
    receiver: Any  # weakref to SGLang's receiver


class MainStaging:
    """One main rank's staging region, its ranges per room, and their landing."""

    def __init__(self, kv_mgr: Any, size_bytes: int, device: str = "cpu"):
        args = kv_mgr.kv_args
        self.pool = PoolPages(args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens,
                              torch.uint8, 1, device)
        self.region = torch.zeros(int(size_bytes), dtype=torch.uint8)
        self.addr = self.region.data_ptr()
        self._engine = kv_mgr.engine
        self._engine.register(self.addr, int(size_bytes))
        self.allocator = StagingAllocator(int(size_bytes))
        self._ranges: dict[int, _Range] = {}
        self.counters = {"offered": 0, "no_room": 0, "landed_coded": 0, "landed_raw": 0,
                         "records": 0, "raw_bytes": 0, "wire_bytes": 0, "corrupt": 0,
                         "freed_unlanded": 0}

    def offer(self, receiver: Any, room: int, pages: np.ndarray) -> tuple[int, int]:
        """``(addr, bytes)`` of the room's range, or ``(0, 0)`` when none fits."""
        self.sweep()
        self._free(room, landed=False)  # a room bootstrapped again
        nbytes = staging_bytes_for(len(pages), self.pool.page_bytes)
        offset = self.allocator.reserve(nbytes)
        if offset is None:
            self.counters["no_room"] += 1
            return 0, 0
        self.region[offset:offset + END_BYTES].zero_()
        self._ranges[room] = _Range(offset, nbytes, np.asarray(pages, dtype=np.int64).copy(),
                                    weakref.ref(receiver))
        self.counters["offered"] += 1
        return self.addr + offset, nbytes

    def land(self, receiver: Any, room: int, landed: bool) -> Optional[str]:
        """The room's KV landed (``landed``): decode it into its pages and free the range (every
        write of prefill's has landed). The reason it failed, or None. A room that failed keeps
        its range until SGLang drops its receiver (:meth:`sweep`): as its pages, the range may
        still take a late write of the copy until prefill has acked the abort."""
        held = self._ranges.get(room)
        if held is None or held.receiver() is not receiver or not landed:
            return None
        try:
            self._decode(room, held)
            return None
        except (CorruptFrame, ValueError, KeyError) as err:
            self.counters["corrupt"] += 1
            reason = f"PDD: main's coded KV copy of room {room} failed to decode: {err}"
            logger.error("%s; the room fails, no page was written", reason)
            return reason
        finally:
            self._free(room, landed=True)

    def _decode(self, room: int, held: _Range) -> None:
        view = memoryview(self.region.numpy())[held.offset:held.offset + held.nbytes]
        if not self.region[held.offset:held.offset + END_BYTES].any():
            self.counters["landed_raw"] += 1  # prefill sent every page raw: no end record
            return
        count, wire, raw = read_end(view, room)
        request = getattr(held.receiver(), "pdd_request", None)
        seam.aids.main_staged_kv(request() if request is not None else None, view)
        decoded = []
        for pages, frame in records(view, room, count, wire):
            if not np.isin(pages, held.pages).all():
                raise CorruptFrame(f"room {room}: a record names pages SGLang did not give it")
            header = HEADER.unpack_from(frame)
            into = self.pool.empty_for(len(pages), DTYPES.get(header[3], torch.uint8))
            codec_named(frame_codec_name(frame)).decode(frame, into)
            decoded.append((pages, into))
        for pages, into in decoded:  # every frame checked and decoded before a page is written
            self.pool.scatter(pages, into)
        self.counters["landed_coded"] += 1
        self.counters["records"] += count
        self.counters["raw_bytes"] += raw
        self.counters["wire_bytes"] += wire

    def _free(self, room: int, landed: bool) -> None:
        held = self._ranges.pop(room, None)
        if held is not None:
            self.allocator.free(held.offset)
            if not landed:
                self.counters["freed_unlanded"] += 1

    def sweep(self) -> None:
        """Free the ranges of rooms whose receiver SGLang has dropped: it does so once it frees
        the room's pages (after prefill acked an abort, or its deferred-release timeout), so no
        late write of the copy can land in a range given to another room."""
        for room, held in list(self._ranges.items()):
            if held.receiver() is None:
                self._free(room, landed=False)

    def state(self) -> dict:
        self.sweep()
        return {"bytes": self.allocator.size, "in_use_bytes": self.allocator.in_use,
                "rooms": self.allocator.ranges, **self.counters}

    def close(self) -> None:
        """Scheduler exit (``lifecycle.close_scheduler``): the region leaves Mooncake; safe twice."""
        engine, self._engine = self._engine, None
        if engine is None:
            return
        try:
            engine.deregister(self.addr)
        except Exception as err:  # shutting down: log, never raise
            logger.warning("PDD: deregistering main's staging region failed: %s", err)
