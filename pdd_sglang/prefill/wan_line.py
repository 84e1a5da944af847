"""What prefill's WAN path carries to each main right now, and how fast it has been draining.

Congestion-aware placement (``policy.LineState``) predicts a new copy's WAN time from the bytes
already ahead of it on the line to its main and the throughput measured over recent copies. Both
are known only here, at the sender: bytes are *queued* from when a chunk is put on a WAN queue
until a WAN sender takes it, then *in flight* from when its batch is handed to Mooncake until the
batch completes or fails. The router reads :meth:`WanLine.snapshot` from the prefill's
``/server_info`` (``pdd.wan_line``).

Throughput is measured per main over its last :data:`RECENT_COPIES` completed batches: their
bytes over the time the line to that main was busy with them (overlapping batches counted once),
so idle gaps between requests do not lower it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

RECENT_COPIES = 32


@dataclass
class _MainLine:
    queued_bytes: int = 0
    in_flight_bytes: int = 0
    busy_until: float = 0.0  # when the latest batch to this main completed
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT_COPIES))  # (bytes, busy_s)
    sent_bytes: int = 0
    failed_batches: int = 0

    def bytes_per_s(self) -> float | None:
        busy_s = sum(s for _, s in self.recent)
        sent = sum(b for b, _ in self.recent)
        return sent / busy_s if busy_s > 0 and sent > 0 else None


class WanLine:
    """Per-main counters of the WAN path; thread-safe, under one lock.

    Written by the fan-out's owner (``pdd-fanout``: a chunk queued), the WAN senders
    (``pdd-wan-xfer-N``: a chunk taken) and the WAN engine's batches (``started`` / ``finished``,
    on a WAN sender or its ``pdd-wan-layers-N`` executor); read whole by :meth:`snapshot` on the
    scheduler thread (``/server_info``), ``pdd-line-report`` and ``pdd-metrics``.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self._mains: dict[str, _MainLine] = {}

    def _main(self, session: str) -> _MainLine:
        return self._mains.setdefault(session, _MainLine())

    def queued(self, charges: Iterable[tuple[str, int]]) -> None:
        with self._lock:
            for session, nbytes in charges:
                self._main(session).queued_bytes += nbytes

    def dequeued(self, charges: Iterable[tuple[str, int]]) -> None:
        with self._lock:
            for session, nbytes in charges:
                line = self._main(session)
                line.queued_bytes = max(line.queued_bytes - nbytes, 0)

    def started(self, session: str, nbytes: int) -> float:
        """A batch of ``nbytes`` to ``session`` is handed to Mooncake; returns its start mark."""
        with self._lock:
            self._main(session).in_flight_bytes += nbytes
        return self._clock()

    def finished(self, session: str, nbytes: int, started_at: float, ok: bool) -> None:
        now = self._clock()
        with self._lock:
            line = self._main(session)
            line.in_flight_bytes = max(line.in_flight_bytes - nbytes, 0)
            if not ok:
                line.failed_batches += 1
                return
            # Only the part of this batch's time the line was not already counted busy for.
            busy_s = now - max(started_at, min(line.busy_until, now))
            line.busy_until = max(line.busy_until, now)
            line.sent_bytes += nbytes
            if busy_s > 0:
                line.recent.append((nbytes, busy_s))
            elif line.recent:  # finished inside another batch's busy time: same interval
                b, s = line.recent[-1]
                line.recent[-1] = (b + nbytes, s)

    def snapshot(self) -> dict:
        """``{session: {queued_bytes, in_flight_bytes, bytes_ahead, recent_bytes_per_s, ...}}``."""
        with self._lock:
            return {
                session: {
                    "queued_bytes": line.queued_bytes,
                    "in_flight_bytes": line.in_flight_bytes,
                    "bytes_ahead": line.queued_bytes + line.in_flight_bytes,
                    "recent_bytes_per_s": line.bytes_per_s(),
                    "sent_bytes": line.sent_bytes,
                    "failed_batches": line.failed_batches,
                }
                for session, line in self._mains.items()
            }


class ChargedQueue:
    """A WAN sender's queue that counts each chunk's bytes as queued until the sender takes it.

    ``put(item, charges)`` (the owner) takes the ``(main session, bytes)`` the chunk will carry;
    the sender's loop (:func:`~pdd_sglang.prefill.senders.run_sender`) calls ``get()`` as on any
    queue. ``None`` (the stop sentinel) passes through.
    """

    def __init__(self, inner: Any, line: WanLine):
        self.inner = inner
        self.line = line

    def put(self, item: Any, charges: tuple = ()) -> None:
        charges = tuple(charges)
        self.line.queued(charges)
        self.inner.put((item, charges))

    def get(self) -> Any:
        entry = self.inner.get()
        if entry is None:
            return None
        item, charges = entry
        self.line.dequeued(charges)
        return item

    def stop(self) -> None:
        """Wake the worker blocked in ``get`` and let it leave SGLang's loop."""
        self.inner.put(None)
