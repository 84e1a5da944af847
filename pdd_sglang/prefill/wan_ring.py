"""Prefill's side of a main's staging ring (issue 50): the slots a packed copy may write, and the
words that tell main a record arrived (the ring itself: :mod:`pdd_sglang.kv_codec.wire`).

A :class:`RingWriter` is this prefill rank's view of one ring at one main rank. Each slot is

- ``FREE``: main has landed what it last held (its freed word caught up), or prefill's last
  write there never arrived and Mooncake has ended it, or it was never written;
- ``IN_FLIGHT``: a record's write is with Mooncake;
- ``LANDED``: that write ended, its arrival word not yet sent;
- ``ANNOUNCED``: its arrival word sent (sent again should that write fail); main may be landing
  it.

:meth:`RingWriter.take` gives a free slot and the next sequence number; with none free it sends
the arrival words due, lands the copy's own oldest block, and reads main's freed words (one
one-sided read) until one is, up to the transfer timeout. The first take reads every word first,
so a writer that starts after another (a restarted prefill) continues the ring's sequence and
leaves the slots main still lands alone.

Threads: a writer is used by the WAN sender holding its main's line (one at a time,
:mod:`pdd_sglang.prefill.wan_lines`) and by the releases of its blocks, which run on whichever
sender lands or reaps them; its slot states are under its lock. Its registered words (the read's
landing place and the arrival words' sources) belong to the WAN engine's memory, unregistered
with it.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Optional

import numpy as np
import torch

from pdd_sglang.kv_codec.wire import WORD, RingLayout

logger = logging.getLogger(__name__)

FREE, IN_FLIGHT, LANDED, ANNOUNCED = "free", "in_flight", "landed", "announced"
FIRST_READ_PAUSE_S = 0.0005
LONGEST_READ_PAUSE_S = 0.02


class RingWriter:
    """Slots of one main's ring this prefill rank may write, and its sequence numbers."""

    def __init__(self, wan: Any, session: str, layout: RingLayout):
        self.session, self.layout = session, layout
        slots = layout.slots
        self._lock = threading.Lock()
        self._state = [FREE] * slots
        self._written = np.zeros(slots, dtype=np.uint64)  # seq + 1 last written per slot
        self._next_seq: Optional[int] = None  # read from main's words at the first take
        self._landed: list[int] = []  # LANDED slots, oldest first
        # main's words as last read (freed, then arrived) and the arrival words' sources
        self._words = torch.zeros(2 * slots * WORD.itemsize, dtype=torch.uint8)
        self._announce = torch.zeros(slots * WORD.itemsize, dtype=torch.uint8)
        wan.register_regions([(self._words.data_ptr(), self._words.numel()),
                              (self._announce.data_ptr(), self._announce.numel())])
        self.reads = 0

    def take(self, wan: Any, copy: Any) -> Optional[tuple[int, int]]:
        """``(slot, seq)`` for the next record, or None when the copy failed or no slot came
        free within the transfer timeout."""
        deadline = time.monotonic() + wan.timeout_s
        pause = FIRST_READ_PAUSE_S
        while True:
            with self._lock:
                if self._next_seq is not None:
                    for slot, state in enumerate(self._state):
                        if state == FREE:
                            seq = self._next_seq
                            self._next_seq += 1
                            self._state[slot] = IN_FLIGHT
                            self._written[slot] = seq + 1
                            return slot, seq
            if not self.announce(copy):
                return None
            if copy.in_flight:  # its landing frees nothing at main, but lets main land it
                if not copy.land_oldest():
                    return None
                continue
            if not self._read(wan):
                return None
            with self._lock:
                if FREE in self._state:
                    continue
            if time.monotonic() > deadline:
                logger.error("PDD: no slot of main %s's staging ring came free within %.0f s",
                             self.session, wan.timeout_s)
                return None
            time.sleep(pause)
            pause = min(pause * 2, LONGEST_READ_PAUSE_S)

    def releaser(self, slot: int, seq: int) -> Callable[[bool], None]:
        """The release of the record ``seq`` written into ``slot``: run once Mooncake ended its
        write (``ok``: it landed); a write that never landed leaves the slot free again."""
        def release(ok: bool) -> None:
            with self._lock:
                if self._state[slot] != IN_FLIGHT or int(self._written[slot]) != seq + 1:
                    return
                if ok:
                    self._state[slot] = LANDED
                    self._landed.append(slot)
                else:
                    self._state[slot] = FREE
        return release

    def announce(self, copy: Any) -> bool:
        """Send the arrival word of every record that landed since the last call (each its own
        8-byte write inside ``copy``); False when the copy failed. A word whose write did not
        land is sent again by the next call (the same word twice is harmless: main lands a
        slot once its arrived word passes its freed one)."""
        with self._lock:
            due, self._landed = self._landed, []
            for slot in due:
                self._state[slot] = ANNOUNCED
        words = self._announce.numpy().view(WORD)
        for index, slot in enumerate(due):
            words[slot] = self._written[slot]
            address = self._announce.data_ptr() + slot * WORD.itemsize
            if not copy.submit([address], [self.layout.arrived_addr(slot)], [WORD.itemsize],
                               release=self._announced(slot)):
                with self._lock:  # the rest were never sent
                    for later in due[index + 1:]:
                        self._state[later] = LANDED
                        self._landed.append(later)
                return False
        return True

    def _announced(self, slot: int) -> Callable[[bool], None]:
        written = int(self._written[slot])

        def release(ok: bool) -> None:
            with self._lock:
                if not ok and self._state[slot] == ANNOUNCED \
                        and int(self._written[slot]) == written:
                    self._state[slot] = LANDED
                    self._landed.append(slot)
        return release

    def _read(self, wan: Any) -> bool:
        """Read main's words; slots main has landed come free (the first read also sets the
        sequence past every number the ring has seen)."""
        slots = self.layout.slots
        first = self._next_seq is None
        nbytes = (2 if first else 1) * slots * WORD.itemsize
        if not wan.read(self.session, self._words.data_ptr(), self.layout.freed_addr, nbytes):
            return False
        self.reads += 1
        words = self._words.numpy().view(WORD)
        freed, arrived = words[:slots], words[slots:]
        with self._lock:
            if first:
                self._next_seq = int(max(words.max(initial=0), 0))
                for slot in range(slots):
                    if arrived[slot] > freed[slot]:  # main still lands an earlier writer's
                        self._state[slot], self._written[slot] = ANNOUNCED, arrived[slot]
            for slot in range(slots):
                if self._state[slot] == ANNOUNCED and freed[slot] >= self._written[slot]:
                    self._state[slot] = FREE
        return True

    def state(self) -> dict:
        with self._lock:
            return {"slots": self.layout.slots, "free": self._state.count(FREE),
                    "next_seq": self._next_seq, "reads": self.reads}


_MADE = threading.Lock()


def ring_writer(wan: Any, session: str, layout: RingLayout) -> RingWriter:
    """The engine's writer for ``session``'s ring at ``layout`` (a main that restarts offers a
    new session, hence a new writer)."""
    writers = getattr(wan, "ring_writers", None)
    if writers is None:
        with _MADE:
            writers = wan.__dict__.setdefault("ring_writers", {})
    key = (session, layout.addr, layout.nbytes, layout.slot_bytes)
    writer = writers.get(key)
    if writer is None:
        with _MADE:
            writer = writers.get(key)
            if writer is None:
                writer = writers[key] = RingWriter(wan, session, layout)
    return writer
