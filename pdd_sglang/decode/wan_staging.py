"""Main's staging region: rings of records prefill writes packed KV into, landed off the
scheduler thread as they arrive (issues 36, 50).

Life cycle of a request's packed copy on a main:

1. SGLang's decode receiver sends its transfer metadata; :meth:`MainStaging.offer` gives the
   room's prefill rank its ring (:class:`~pdd_sglang.kv_codec.wire.RingLayout`, one per prefill
   rank writing to this main rank, out of a region sized from the declared line:
   :func:`pdd_sglang.policy.wan_codec.staging_ring`), tells the landing thread the room and its
   pages, and the hello names the ring. A room reserves nothing: its records share the ring's
   slots with every other room of that prefill. No ring left: the room goes one-sided.
2. Prefill writes each record into a slot main has freed and, once the write has ended, says so
   in the slot's arrived word (:mod:`pdd_sglang.kv_codec.wire`); its end record comes last.
3. Thread ``pdd-main-landing`` polls the rings' arrived words. For each record that arrived it
   checks the header and CRCs, decodes the frame and scatters it into the room's pages (on the
   pool's device; on a GPU on a stream of its own), then frees the slot. A room has landed once
   its end record and every record it counts have; a record that fails its check fails the room.
4. The scheduler, when the receiver's poll first sees the room Success (prefill's word, sent only
   once the end record arrived), asks :meth:`MainStaging.land`: landed, the request counts as
   landed (SGLang's commit, the handoff's hold and EXTEND, the KV digest); failed, the room fails
   through SGLang's failed-transfer path (a counter says so, the router places the request
   again); not yet, the poll says Transferring and asks again at its next round.
5. SGLang clears a room's receiver before it gives the room's pages to anything else (patch 0020
   calls :meth:`MainStaging.forget` there, as at a failure): that waits until the landing thread
   has applied it, so no record is scattered into pages after they leave the room.

Owners: the landing thread owns the room table and the rings' freed words, and writes a room's
pages from its offer until it has landed or is forgotten (SGLang gave them to the room and reads
them only once it has landed). The scheduler thread (each TP rank its own region, pages and
rooms) owns the rings' assignment to prefill ranks and sends the landing thread events: a room
offered, a room forgotten (waited for). Outcomes go back in ``_outcomes``, which only the landing
thread adds to and only the scheduler pops.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from pdd_sglang import seam
from pdd_sglang.kv_codec import (DTYPES, HEADER, CorruptFrame, RawCodec, codec_named,
                                 frame_codec_name)
from pdd_sglang.kv_codec.pool import PoolPages
from pdd_sglang.kv_codec.wire import WORD, RingLayout, read_slot

logger = logging.getLogger(__name__)

LANDED = "landed"
PENDING = "pending"
# The landing thread's back-off between polls of idle rings.
FIRST_POLL_S = 0.0005
LONGEST_POLL_S = 0.01
# How long a room prefill said landed may wait for its records to land before it fails (a record
# whose arrival word was lost); far above a record's decode.
LANDING_GRACE_S = 30.0
FORGET_WAIT_S = 10.0


@dataclass
class _Room:
    pages: np.ndarray  # the pages SGLang gave this room: the only ones a record may name
    request: Any  # weakref to its request (seam.main_staged_kv), or None
    records: int = 0
    raw_bytes: int = 0
    end: Optional[tuple[int, int]] = None  # (records, raw bytes) of its end record
    last_decode_s: float = 0.0  # its last record's check, decode and scatter


@dataclass
class _Ring:
    layout: RingLayout
    offset: int  # in the region
    freed: np.ndarray  # main's words, uint64 per slot
    arrived: np.ndarray  # prefill's words


@dataclass
class _Event:
    room: int
    offered: Optional[_Room] = None  # None: forget the room
    done: threading.Event = field(default_factory=threading.Event)


class MainStaging:
    """One main rank's staging region, its rings, and the thread that lands their records."""

    def __init__(self, kv_mgr: Any, size_bytes: int, ring_bytes: int, slot_bytes: int,
                 device: str = "cpu"):
        args = kv_mgr.kv_args
        self.pool = PoolPages(args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens,
                              torch.uint8, 1, device)
        # left untouched but for the words (a slot is read only once prefill wrote it), so a
        # ring sized for a long fat line costs memory only as far as its records reach
        self.region = torch.empty(int(size_bytes), dtype=torch.uint8)
        self.addr = self.region.data_ptr()
        self._engine = kv_mgr.engine
        self._engine.register(self.addr, int(size_bytes))
        self._stream = torch.cuda.Stream() if device.startswith("cuda") else None
        array = self.region.numpy()
        self.rings: list[_Ring] = []
        slots = RingLayout(0, int(ring_bytes), int(slot_bytes)).slots
        for offset in range(0, int(size_bytes) - int(ring_bytes) + 1, int(ring_bytes)):
            layout = RingLayout(self.addr + offset, int(ring_bytes), int(slot_bytes))
            words = array[offset:offset + 2 * WORD.itemsize * slots].view(WORD)
            words[:] = 0
            self.rings.append(_Ring(layout, offset, words[:slots], words[slots:]))
        self._peers: dict[str, int] = {}  # scheduler thread: prefill rank -> ring index
        self._offered: set[int] = set()  # scheduler thread: rooms offered, not yet forgotten
        self._said_landed: dict[int, float] = {}  # scheduler thread: when prefill said so
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._rooms: dict[int, _Room] = {}  # landing thread
        self._outcomes: dict[int, str] = {}  # landing thread adds, scheduler pops
        self.last_landed: Optional[dict] = None  # landing thread replaces it whole
        self.counters = {"offered": 0, "no_ring": 0, "landed_packed": 0, "landed_one_sided": 0,
                         "records": 0, "raw_bytes": 0, "corrupt": 0, "foreign": 0,
                         "forgotten_unlanded": 0, "peak_slots": 0, "failed_rooms": 0}
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pdd-main-landing", daemon=True)
        self._thread.start()

    # ---- scheduler thread --------------------------------------------------------------------
    def offer(self, receiver: Any, room: int, pages: np.ndarray, peer: str) -> Optional[RingLayout]:
        """The ring the room's prefill rank ``peer`` writes its records into, or None (the room
        goes one-sided) when every ring serves another prefill rank."""
        index = self._peers.get(peer)
        if index is None:
            if len(self._peers) >= len(self.rings):
                self.counters["no_ring"] += 1
                return None
            index = self._peers[peer] = len(self._peers)
        request = getattr(receiver, "pdd_request", None)
        self.forget(room)  # a room bootstrapped again
        self._offered.add(room)
        self._events.put(_Event(room, _Room(np.asarray(pages, dtype=np.int64).copy(), request)))
        self.counters["offered"] += 1
        return self.rings[index].layout

    def land(self, room: int, landed: bool) -> Optional[str]:
        """The receiver's poll saw the room concluded (``landed``: prefill's Success). LANDED once
        its records have landed, PENDING while they land, else the reason it failed; None for a
        room never offered here (one-sided) or one that failed (it is forgotten)."""
        if room not in self._offered:
            return None
        if not landed:
            self.forget(room)
            return None
        outcome = self._outcomes.pop(room, None)
        if outcome is None:
            since = self._said_landed.setdefault(room, time.monotonic())
            if time.monotonic() - since < LANDING_GRACE_S:
                return PENDING
            outcome = (f"PDD: main's packed KV copy of room {room} did not land within "
                       f"{LANDING_GRACE_S:.0f} s of prefill's word")
        if outcome != LANDED:
            self.counters["failed_rooms"] += 1
            logger.error("%s; the room fails and is placed again", outcome)
        self.forget(room)
        return outcome

    def forget(self, room: int) -> None:
        """The room leaves the landing thread (landed, failed, or its pages about to go
        elsewhere); returns once no record of it can be scattered any more."""
        if room not in self._offered:
            return
        self._offered.discard(room)
        self._said_landed.pop(room, None)
        event = _Event(room)
        self._events.put(event)
        self._wake.set()
        if self._thread.is_alive() and not event.done.wait(FORGET_WAIT_S):
            logger.error("PDD: main's landing thread did not let room %s go in %.0f s", room,
                         FORGET_WAIT_S)
        self._outcomes.pop(room, None)

    def state(self) -> dict:
        """The region, its rings, what they hold now (records arrived, not yet landed) and at
        most, the last room landed, the counters (a snapshot: the landing thread counts on)."""
        slot_bytes = self.rings[0].layout.slot_bytes if self.rings else 0
        held = sum(int(np.count_nonzero(r.arrived > r.freed)) for r in self.rings)
        return {"bytes": self.region.numel(), "rings": len(self.rings),
                "prefills": len(self._peers), "rooms": len(self._offered),
                "slots_per_ring": self.rings[0].layout.slots if self.rings else 0,
                "slot_bytes": slot_bytes, "in_use_bytes": held * slot_bytes,
                "peak_bytes": self.counters["peak_slots"] * slot_bytes,
                "last_landed": self.last_landed, **self.counters}

    def close(self) -> None:
        """Scheduler exit (``lifecycle.close_scheduler``): the landing thread stops and the region
        leaves Mooncake; safe twice."""
        self._stop.set()
        self._wake.set()
        self._thread.join(FORGET_WAIT_S)
        engine, self._engine = self._engine, None
        if engine is None:
            return
        try:
            engine.deregister(self.addr)
        except Exception as err:  # shutting down: log, never raise
            logger.warning("PDD: deregistering main's staging region failed: %s", err)

    # ---- landing thread ----------------------------------------------------------------------
    def _run(self) -> None:
        from pdd_sglang.lifecycle import name_os_thread

        name_os_thread("pdd-main-landing")
        pause = FIRST_POLL_S
        while not self._stop.is_set():
            try:
                arrived = self._arrived()
                for ring, slot in arrived:
                    # after the words: a room is offered before its records arrive; and between
                    # records, so a forget waits one record's landing at most
                    self._apply_events()
                    self._land_slot(ring, slot)
                self._apply_events()
            except Exception:  # the thread must outlive one bad record
                logger.exception("PDD: main's landing thread failed on a record")
                arrived = []
            if arrived:
                pause = FIRST_POLL_S
                continue
            self._wake.wait(pause)
            self._wake.clear()
            pause = min(pause * 2, LONGEST_POLL_S)
        self._apply_events()

    def _arrived(self) -> list[tuple[_Ring, int]]:
        found = []
        for ring in self.rings:
            slots = np.nonzero(ring.arrived > ring.freed)[0]
            found.extend((ring, int(slot)) for slot in slots)
        if found:
            self.counters["peak_slots"] = max(self.counters["peak_slots"], len(found))
        return found

    def _apply_events(self) -> None:
        while True:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                return
            if event.offered is not None:
                self._rooms[event.room] = event.offered
            elif self._rooms.pop(event.room, None) is not None \
                    and event.room not in self._outcomes:
                self.counters["forgotten_unlanded"] += 1
            event.done.set()

    def _land_slot(self, ring: _Ring, slot: int) -> None:
        seq = int(ring.arrived[slot]) - 1
        offset = ring.offset + ring.layout.slot_offset(slot)
        view = memoryview(self.region.numpy())[offset:offset + ring.layout.slot_bytes]
        try:
            record = read_slot(view, seq)
            room = self._rooms.get(record.room)
            if room is None:
                self.counters["foreign"] += 1  # a room forgotten (failed, let go) or unknown
                return
            if record.end is not None:
                room.end = record.end
            else:
                request = room.request() if room.request is not None else None
                seam.aids.main_staged_kv(request, record.frame)
                self._scatter(room, record.room, record.pages, record.frame)
            self._settle(record.room, room)
        except (CorruptFrame, ValueError, KeyError) as err:
            self.counters["corrupt"] += 1
            logger.error("PDD: a packed KV record in main's staging failed its check: %s", err)
            self._fail_by_slot(view, err)
        finally:
            ring.freed[slot] = seq + 1

    def _scatter(self, room: _Room, room_id: int, pages: np.ndarray, frame: memoryview) -> None:
        if not np.isin(pages, room.pages).all():
            raise CorruptFrame(f"room {room_id}: a record names pages SGLang did not give it")
        header = HEADER.unpack_from(frame)
        into = self.pool.empty_for(len(pages), DTYPES.get(header[3], torch.uint8))
        began = time.perf_counter()
        codec = codec_named(frame_codec_name(frame))
        if isinstance(codec, RawCodec):  # scattered straight from the slot, once checked
            data = torch.from_numpy(codec.payload(frame, into)).view(into.dtype).view(into.shape)
        else:
            codec.decode(frame, into)
            data = into
        self.pool.scatter(pages, data, self._stream)
        room.last_decode_s = time.perf_counter() - began
        room.records += 1
        room.raw_bytes += into.numel() * into.element_size()

    def _settle(self, room_id: int, room: _Room) -> None:
        if room.end is None or room.records < room.end[0]:
            return
        del self._rooms[room_id]
        if room.records != room.end[0]:
            self._outcomes[room_id] = (f"PDD: room {room_id}'s packed copy landed "
                                       f"{room.records} records, its end record says {room.end[0]}")
            return
        self.counters["landed_packed" if room.records else "landed_one_sided"] += 1
        self.counters["records"] += room.records
        self.counters["raw_bytes"] += room.raw_bytes
        self.last_landed = {"room": room_id, "records": room.records,
                            "last_record_decode_s": round(room.last_decode_s, 6),
                            "landed_at": time.time()}
        self._outcomes[room_id] = LANDED

    def _fail_by_slot(self, view: memoryview, err: Exception) -> None:
        """A record that failed its check fails its room, when its header names one this main
        holds (else its room fails when its end record's count comes short)."""
        try:
            room_id = int.from_bytes(bytes(view[4:12]), "little")
        except ValueError:
            return
        if self._rooms.pop(room_id, None) is not None:
            self._outcomes[room_id] = (f"PDD: main's packed KV copy of room {room_id} failed "
                                       f"to decode: {err}")
