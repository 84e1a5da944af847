"""Main-bound work, one queue per destination line, and the copy a request waits for first.

Every main-bound :class:`~pdd_sglang.prefill.room.Work` carries a :class:`CopyClass`:

- ``NEEDED_NOW``: a request waits for this copy: a P->MD request (main decodes every token), a
  handoff waiting for main's copy, a request whose relay died. Every copy starts here.
- ``CACHE_ONLY``: the relay answered alone; the copy only warms main's cache for the
  conversation's next turn. A copy becomes cache-only when the router says its relay finished
  (``POST /pdd/cache_only``, :mod:`pdd_sglang.prefill.cache_only`).

Order (issue 34): work is queued per main session (one WAN line each), so a slow main's line
holds up no other main's copies. A line is served by one WAN sender at a time, so its window
(:meth:`~pdd_sglang.prefill.wan_engine.WanTransferEngine.copy`) is one copy's. Within a line,
needed-now goes before cache-only, a needed-now copy whose request no relay answers before a
relay-covered one (:func:`pdd_sglang.policy.wan_order.copy_tier`), and within a tier the copy (a
room's chunks) with the earliest deadline first: when it was first queued plus twice its bytes at the
declared line's rate (:func:`pdd_sglang.policy.wan_order.copy_deadline`, which the simulator's
line follows too). A short copy passes a long one; a copy queued after another's deadline never
passes it. A needed-now copy that ranks ahead of the copy on the line (any of a later tier; one
of its tier with a later deadline) takes the line at that copy's next slice: the sender
asks :meth:`WanLines.should_yield` between slices, hands the line over at once
(:meth:`WanLines.hand_over`: the other copy starts beside the window still in flight) and puts
the copy back with its progress (:attr:`Work.pages_done`) once that window has landed. A copy
whose request a relay answers meanwhile (:attr:`Work.relay_covered`: a handoff's, until the relay
fails) and a cache-only one keep a smaller window
(:func:`~pdd_sglang.prefill.wan_engine.background_window`), so the copy of a request with no
token yet shares the line with at most a tenth of a second of either.

Past a backlog bound (``--pdd-wan-cache-only-backlog-s``, seconds of the line at its measured
rate), the owner drops a line's queued cache-only copies (:meth:`WanLines.drop_cache_only`):
prefill frees their KV, main is told the copy failed and frees its slots (it is not taken out),
and the router, which records a prompt at main only once main's copy landed, forgets nothing it
had not got.

Threads: the fan-out's owner (``pdd-fanout``) puts work, reclassifies and drops; the WAN senders
(``pdd-wan-xfer-N``) take, hand over, put back and release, a sender only the work it took (so
a line may have one sender writing its holder and others still landing the windows of works
they handed over); the line report and ``/server_info`` read :meth:`queued_by_class`. Every
table here (each line's queue, holder, draining works, first-queued times) is under one
condition lock, held only for list work, never across a send. No SGLang table is touched here.
"""

from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from pdd_sglang.policy.wan_order import copy_deadline, copy_tier


class CopyClass(enum.Enum):
    NEEDED_NOW = "needed_now"
    CACHE_ONLY = "cache_only"


@dataclass
class _Line:
    queued: list = field(default_factory=list)  # Work, in arrival order
    holder: Any = None  # the Work a sender is writing on this line, if any
    # Works that gave the line up (hand_over) while their window in flight lands: a sender
    # still holds each, and none can be taken until it is put back.
    draining: list = field(default_factory=list)
    # room -> when its first work still on this line (or an earlier one, sent while its next was
    # queued) was queued: a copy's deadline starts at its first chunk, not at the chunk now due.
    first_queued: dict = field(default_factory=dict)
    copy_bytes: dict = field(default_factory=dict)  # room -> the bytes of its works queued since

    def works(self) -> list:
        """Every work on this line: queued, draining and the holder."""
        return [*self.queued, *self.draining, *([self.holder] if self.holder is not None else [])]


def remaining_bytes(work: Any) -> int:
    """What is left of a work's copy (its bytes less the pages already written)."""
    if not work.pages:
        return work.nbytes
    return work.nbytes * (work.pages - work.pages_done) // work.pages


def _ranker(line: _Line, line_bytes_per_s: float):
    """The order of ``line``'s queued works: cancelled work first (a sender only skips and reports
    it, and its room's conclusion, which frees prefill's KV, waits for that report), then by
    tier (:func:`~pdd_sglang.policy.wan_order.copy_tier`: needed-now with no relay answering,
    relay-covered, cache-only), then the copy (the room) with the earliest deadline (its first work's queueing
    plus its time alone, stretched: :func:`~pdd_sglang.policy.wan_order.copy_deadline`), then
    the copy that came first.

    A copy is a room's works (chunked prefill queues one per chunk as its forward ends), so its
    deadline is the room's: from its first chunk, for the bytes of all its chunks: ranking the
    chunks alone would interleave concurrent copies chunk by chunk, and every one of them would
    land as late as the last.
    """
    def rank(work: Any) -> tuple:
        first = line.first_queued.get(work.room, work.queued_at)
        due = copy_deadline(first, line.copy_bytes.get(work.room, work.nbytes), line_bytes_per_s)
        return (not work.cancelled,
                copy_tier(work.copy_class is CopyClass.CACHE_ONLY, work.relay_covered), due,
                first, work.queued_at)
    return rank


class WanLines:
    """Main-bound work per main session, served best first (see the module docstring)."""

    def __init__(self, line_bytes_per_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not line_bytes_per_s > 0:
            raise ValueError(f"the WAN line's rate must be positive, got {line_bytes_per_s!r}")
        self.line_bytes_per_s = float(line_bytes_per_s)  # the declared line: deadlines' scale
        self.clock = clock
        self._cond = threading.Condition()
        self._lines: dict[str, _Line] = {}
        self._stopped = False

    # ---- the owner -------------------------------------------------------------------------
    def put(self, work: Any, nbytes: int, pages: int, copy_class: CopyClass) -> None:
        work.nbytes, work.pages, work.copy_class = int(nbytes), int(pages), copy_class
        work.queued_at = self.clock()
        with self._cond:
            line = self._lines.setdefault(work.session, _Line())
            line.queued.append(work)
            line.first_queued.setdefault(work.room, work.queued_at)
            line.copy_bytes[work.room] = line.copy_bytes.get(work.room, 0) + work.nbytes
            self._cond.notify_all()

    def reclassify(self, room: int, copy_class: CopyClass) -> int:
        """Every queued or written work of ``room`` becomes ``copy_class``; how many did."""
        changed = 0
        with self._cond:
            for line in self._lines.values():
                for work in line.works():
                    if work.room == room and work.copy_class is not copy_class:
                        work.copy_class = copy_class
                        changed += 1
            self._cond.notify_all()
        return changed

    def uncover(self, room: int) -> int:
        """``room``'s relay failed: its queued or written works are no longer relay-covered (they
        go on with the full window); how many were."""
        changed = 0
        with self._cond:
            for line in self._lines.values():
                for work in line.works():
                    if work.room == room and work.relay_covered:
                        work.relay_covered = False
                        changed += 1
        return changed

    def drop_cache_only(self, session: str, keep_bytes: int) -> list:
        """The queued cache-only works of ``session``'s line, newest first, past the first
        ``keep_bytes`` of everything ahead on it: the owner cancels and fails them."""
        with self._cond:
            line = self._lines.get(session)
            if line is None:
                return []
            ahead = sum(remaining_bytes(w) for w in line.works() if not w.cancelled)
            dropped = []
            for work in reversed(line.queued):
                if ahead <= keep_bytes:
                    break
                if work.copy_class is CopyClass.CACHE_ONLY and not work.cancelled:
                    dropped.append(work)
                    ahead -= remaining_bytes(work)
            return dropped

    # ---- the WAN senders -------------------------------------------------------------------
    def take(self) -> Optional[Any]:
        """The best work of a line no sender holds (waiting for one); None once stopped."""
        with self._cond:
            while True:
                if self._stopped:
                    return None
                best = None  # (rank, line, work): the lines' best works compared across lines
                for line in self._lines.values():
                    if line.holder is None and line.queued:
                        rank = _ranker(line, self.line_bytes_per_s)
                        candidate = min(line.queued, key=rank)
                        if best is None or rank(candidate) < best[0]:
                            best = (rank(candidate), line, candidate)
                if best is not None:
                    _, line, work = best
                    line.queued.remove(work)
                    line.holder = work
                    return work
                self._cond.wait()

    def should_yield(self, work: Any) -> bool:
        """Between two slices of ``work``: a needed-now work of another copy waits on its line
        and ranks ahead of it (any needed-now one, when ``work`` is cache-only; within
        needed-now, one with an earlier deadline). Within needed-now the holder used to keep the
        line to its end: a P->MD request's 60-token copy waited 7.1 s behind a document's
        9.9 MB copy for a handoff (the demo's idle-line setup, fresh clone of 347a3d3). A
        yielded copy keeps its deadline, so only copies due before it pass it."""
        with self._cond:
            line = self._lines.get(work.session)
            if line is None:
                return False
            rank = _ranker(line, self.line_bytes_per_s)
            own = rank(work)
            return any(w.copy_class is CopyClass.NEEDED_NOW and not w.cancelled
                       and w.room != work.room and rank(w) < own for w in line.queued)

    def hand_over(self, work: Any) -> None:
        """The holder ``work`` yields: the line is free now, while its sender waits for the
        window it has in flight to land (:meth:`put_back` or :meth:`release` then). So the copy
        that overtakes it starts beside that window instead of after it and its
        acknowledgement: in the demo's idle-line setup a P->MD copy waited 0.14-0.23 s for a
        background holder to yield (its 0.1 s of line in flight, the last acknowledgement's
        round trip, the sender's poll and hand-over), against 0.2 s alone on the line for a
        26-token copy (docs/measurements.md)."""
        with self._cond:
            line = self._lines.get(work.session)
            if line is None or line.holder is not work:
                return
            line.holder = None
            line.draining.append(work)
            self._cond.notify_all()

    def put_back(self, work: Any) -> None:
        """A yielded work goes back to its line, with its progress, once its window landed; the
        line is free (it was from :meth:`hand_over` on). It is in no sender now: the owner's
        stuck check (``started_at``) leaves it alone until a sender takes it again."""
        work.started_at = None
        with self._cond:
            line = self._lines.setdefault(work.session, _Line())
            self._let_go(line, work)
            line.queued.append(work)
            self._cond.notify_all()

    def release(self, work: Any) -> None:
        """The sender is done with ``work`` (sent, failed or skipped): its line is free."""
        with self._cond:
            line = self._lines.get(work.session)
            if line is not None and self._let_go(line, work):
                if not any(w.room == work.room for w in line.works()):
                    line.first_queued.pop(work.room, None)
                    line.copy_bytes.pop(work.room, None)
                if not line.works():
                    del self._lines[work.session]
            self._cond.notify_all()

    @staticmethod
    def _let_go(line: _Line, work: Any) -> bool:
        """``work`` holds or drains on ``line`` no more; whether it did."""
        if line.holder is work:
            line.holder = None
            return True
        if any(w is work for w in line.draining):
            line.draining = [w for w in line.draining if w is not work]
            return True
        return False

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    # ---- readers ---------------------------------------------------------------------------
    def queued_by_class(self) -> dict:
        """``{session: {"needed_now": bytes, "cache_only": bytes, "relay_covered": bytes}}`` of
        live work not yet on the wire: queued works and the unwritten part of the one a sender
        holds; ``relay_covered`` is the part of ``needed_now`` a relay covers (the middle tier).
        A cancelled work counts nothing, though it waits in a queue until a sender skips it."""
        out: dict = {}
        with self._cond:
            for session, line in self._lines.items():
                counts = {c.value: 0 for c in CopyClass}
                counts["relay_covered"] = 0
                for work in line.works():
                    if not work.cancelled:
                        counts[work.copy_class.value] += remaining_bytes(work)
                        if work.copy_class is CopyClass.NEEDED_NOW and work.relay_covered:
                            counts["relay_covered"] += remaining_bytes(work)
                out[session] = counts
        return out
