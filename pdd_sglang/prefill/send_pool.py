"""The prefill's send pool: the registered memory packed records go out from, one per prefill.

A packed (or coded) copy to main writes each record into a place of this pool and hands that
place to Mooncake as one request (:mod:`pdd_sglang.prefill.wan_coded`). The pool is one region
per prefill (per TP rank), registered once with the WAN engine, shared by every WAN sender
thread, of a size declared from the line (:func:`send_pool_bytes`: one copy's window in flight
plus two records a sender, at least :data:`MIN_POOL_BYTES`), so the prefill's send memory is
bounded whatever the number of senders or mains.

A place is held from :meth:`SendPool.take` until Mooncake has ended the block written from it:
the block's release (:meth:`~pdd_sglang.prefill.wan_engine.WanCopy.submit`) gives it back when
the copy lands it, and for a block the copy gave up on, only when the engine's reaper sees
Mooncake end it; so no record is ever written over one a stalled request still reads.

Threads: the allocator is shared by the WAN senders under the pool's condition; a sender that
finds no place lands its own oldest block, or, with none in flight, waits for another sender's
block to end (at most the engine's transfer timeout, then its copy fails).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Optional

import numpy as np
import torch

from pdd_sglang.kv_codec.staging import StagingAllocator
from pdd_sglang.prefill.wan_engine import LONGEST_POLL_S, WAN_SENDERS

logger = logging.getLogger(__name__)

# Below this a slow line's pool would hold few records; 40 MiB is a few seconds of the demo's line.
MIN_POOL_BYTES = 40 << 20
RECORDS_PER_SENDER = 2


def send_pool_bytes(window_bytes: int, record_bytes: int, senders: int = WAN_SENDERS) -> int:
    """The pool's declared size: a copy's window in flight (the line is one: copies to several
    mains share it) and two records a sender, so each sender can gather its next record while
    the window flies."""
    return max(MIN_POOL_BYTES, int(window_bytes) + senders * RECORDS_PER_SENDER * int(record_bytes))


class SendPool:
    """``size`` bytes registered with ``wan``; places taken per record and released once Mooncake
    has ended the block written from them."""

    def __init__(self, wan: Any, size: int):
        self.size = int(size)
        self.buffer = torch.empty(self.size, dtype=torch.uint8)
        self.array = self.buffer.numpy()
        self.addr = self.buffer.data_ptr()
        wan.register_regions([(self.addr, self.size)])
        self._allocator = StagingAllocator(self.size)
        self._cond = threading.Condition()
        self.peak_bytes = 0
        self.waits = 0  # takes that found the pool full

    def take(self, nbytes: int, copy: Any) -> Optional[int]:
        """The offset of ``nbytes`` free bytes, held until its release; None when ``copy`` failed
        (or the engine stopped) while waiting. Waits by landing ``copy``'s own oldest block, or,
        with none in flight, for another copy's to end (up to the engine's timeout)."""
        if nbytes > self.size:
            raise ValueError(f"a record of {nbytes} bytes outgrows the send pool ({self.size})")
        deadline = time.monotonic() + copy.wan.timeout_s
        waited = False
        while True:
            with self._cond:
                offset = self._allocator.reserve(nbytes)
                if offset is not None:
                    self.peak_bytes = max(self.peak_bytes, self._allocator.in_use)
                    self.waits += waited
                    return offset
            waited = True
            if copy.in_flight:
                if not copy.land_oldest():
                    return None
                continue
            copy.wan._reap_abandoned()  # a stalled block that ended gives its place back
            if copy.failed or copy.wan._stopping or time.monotonic() > deadline:
                logger.error("PDD: no place in the prefill's %d-byte send pool for a %d-byte "
                             "record within the transfer timeout", self.size, nbytes)
                return None
            with self._cond:
                self._cond.wait(LONGEST_POLL_S)

    def write(self, copy: Any, data: bytes, peer_addr: int,
              release: Optional[Callable[[bool], None]] = None) -> bool:
        """Write ``data`` to ``peer_addr`` within ``copy`` from a place of the pool, held until
        Mooncake has ended the block (then ``release`` runs too); False when the copy failed."""
        place = self.take(len(data), copy)
        if place is None:
            if release is not None:
                release(False)
            return False
        self.array[place:place + len(data)] = np.frombuffer(data, np.uint8)
        return copy.submit([self.addr + place], [peer_addr], [len(data)],
                           release=self.releaser(place, release))

    def releaser(self, offset: int, also: Optional[Callable[[bool], None]] = None
                 ) -> Callable[[bool], None]:
        """The release of the place at ``offset`` (a block's, run once Mooncake ended it, with
        whether it landed), then ``also``'s."""
        def release(landed: bool) -> None:
            with self._cond:
                self._allocator.free(offset)
                self._cond.notify_all()
            if also is not None:
                also(landed)
        return release

    def state(self) -> dict:
        with self._cond:
            return {"bytes": self.size, "in_use_bytes": self._allocator.in_use,
                    "peak_bytes": self.peak_bytes, "waits": self.waits}


_MADE = threading.Lock()


def send_pool(wan: Any, record_bytes: int) -> SendPool:
    """The engine's send pool, made (and registered) at the first packed copy."""
    pool = getattr(wan, "send_pool", None)
    if pool is None:
        with _MADE:
            pool = getattr(wan, "send_pool", None)
            if pool is None:
                pool = SendPool(wan, send_pool_bytes(wan.window_bytes, record_bytes))
                logger.info("PDD: the prefill's WAN send pool: %.1f MiB", pool.size / (1 << 20))
                wan.send_pool = pool
    return pool
