"""What prefill's WAN path carries to each main right now, and how fast it has been draining.

Congestion-aware placement (``policy.LineState``) predicts a new copy's WAN time from the bytes
already ahead of it on the line to its main and the throughput measured over recent copies. Both
are known only here, at the sender: bytes are *queued* while a live (not cancelled) work waits
on its line or a sender has not yet handed them to Mooncake (:mod:`~pdd_sglang.prefill.wan_lines`,
per copy class, read through :attr:`WanLine.queue_view`), then *in flight* from when a block is
handed to Mooncake until it completes or fails (counted here by the WAN engine). The router
reads :meth:`WanLine.snapshot` from the prefill's ``/pdd/line`` (or ``/server_info``).

Throughput is measured per main over its last :data:`RECENT_COPIES` completed batches: their
bytes over the time the line to that main was busy with them (overlapping batches counted once),
so idle gaps between requests do not lower it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

RECENT_COPIES = 32


@dataclass
class _MainLine:
    in_flight_bytes: int = 0
    busy_until: float = 0.0  # when the latest batch to this main completed
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT_COPIES))  # (bytes, busy_s)
    sent_bytes: int = 0
    failed_batches: int = 0
    dropped_cache_only_bytes: int = 0
    handed_by_class: dict = field(default_factory=dict)  # class -> bytes handed to Mooncake
    coded_raw_bytes: int = 0  # KV bytes of coded copies (issue 36) ...
    coded_wire_bytes: int = 0  # ... and the bytes they took on the wire

    def codec_ratio(self) -> float:
        """KV bytes per wire byte over the coded copies so far (1.0 before any)."""
        if not self.coded_wire_bytes:
            return 1.0
        return self.coded_raw_bytes / self.coded_wire_bytes

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
        # ``{session: {"needed_now": bytes, "cache_only": bytes}}`` not yet on the wire: the
        # fan-out's WanLines.queued_by_class; nothing queued where no lines are plugged in.
        self.queue_view: Callable[[], dict] = dict

    def _main(self, session: str) -> _MainLine:
        return self._mains.setdefault(session, _MainLine())

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
        """``{session: {queued_bytes, in_flight_bytes, bytes_ahead, first_token_bytes_ahead,
        needed_now_bytes_ahead, cache_only_bytes_ahead, recent_bytes_per_s, needed_now_sent_bytes,
        cache_only_sent_bytes, dropped_cache_only_bytes, kv_codec_ratio, ...}}``, every byte a
        wire byte: queued KV over the line's codec ratio (KV bytes per wire byte of its coded
        copies, issue 36). A new first-token copy (P->MD) waits behind
        ``first_token_bytes_ahead``: the first-token bytes queued and whatever is in flight (a
        window of any tier shares the line with it while it lands; a relay-covered or
        cache-only copy keeps at most policy.BACKGROUND_IN_FLIGHT_S of line in flight). ``needed_now_bytes_ahead`` adds
        the relay-covered bytes queued (a handoff's copy waits behind those too)."""
        queued = self.queue_view()  # outside this lock: the lines have their own
        with self._lock:
            for session in queued:
                self._main(session)
            out = {}
            for session, line in self._mains.items():
                classes = queued.get(session, {})
                # Queued work is counted in KV bytes; on the wire it takes 1/ratio of them.
                ratio = line.codec_ratio()
                needed_now = int(classes.get("needed_now", 0) / ratio)
                cache_only = int(classes.get("cache_only", 0) / ratio)
                first_token = needed_now - int(classes.get("relay_covered", 0) / ratio)
                out[session] = {
                    "queued_bytes": needed_now + cache_only,
                    "in_flight_bytes": line.in_flight_bytes,
                    "bytes_ahead": needed_now + cache_only + line.in_flight_bytes,
                    "first_token_bytes_ahead": max(first_token, 0) + line.in_flight_bytes,
                    "needed_now_bytes_ahead": needed_now + line.in_flight_bytes,
                    "cache_only_bytes_ahead": cache_only,
                    "recent_bytes_per_s": line.bytes_per_s(),
                    "sent_bytes": line.sent_bytes,
                    "failed_batches": line.failed_batches,
                    "dropped_cache_only_bytes": line.dropped_cache_only_bytes,
                    "needed_now_sent_bytes": line.handed_by_class.get("needed_now", 0),
                    "cache_only_sent_bytes": line.handed_by_class.get("cache_only", 0),
                    "kv_codec_ratio": round(ratio, 4),
                    "coded_kv_bytes": line.coded_raw_bytes,
                    "coded_wire_bytes": line.coded_wire_bytes,
                }
            return out

    def handed(self, session: str, copy_class: str, nbytes: int) -> None:
        """A WAN sender handed ``nbytes`` of a ``copy_class`` copy (``needed_now`` or
        ``cache_only``, its class at that slice) to the line: the report's bytes by class."""
        with self._lock:
            by_class = self._main(session).handed_by_class
            by_class[copy_class] = by_class.get(copy_class, 0) + int(nbytes)

    def coded(self, session: str, raw_bytes: int, wire_bytes: int) -> None:
        """A coded record of ``raw_bytes`` of KV took ``wire_bytes`` on the line (its wire bytes
        are counted in flight and sent as any block's): the line's codec ratio."""
        with self._lock:
            line = self._main(session)
            line.coded_raw_bytes += int(raw_bytes)
            line.coded_wire_bytes += int(wire_bytes)

    def dropped(self, session: str, nbytes: int) -> None:
        """The owner dropped ``nbytes`` (wire bytes: KV bytes over the codec ratio) of cache-only
        copies queued for ``session``."""
        with self._lock:
            self._main(session).dropped_cache_only_bytes += int(nbytes)

    def backlog_s(self, session: str) -> float | None:
        """Seconds of the line the bytes ahead of a new copy to ``session`` take at its
        measured rate; None before a copy has been measured."""
        ahead = self.snapshot().get(session)
        if ahead is None or not ahead["recent_bytes_per_s"]:
            return None
        return ahead["bytes_ahead"] / ahead["recent_bytes_per_s"]
