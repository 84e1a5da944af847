"""The WAN line as prefill's sender drives it since issue 34 (pdd_sglang/prefill/wan_lines.py and
wan_engine.py), for ``ClusterConfig(wan_line="classed")``.

What the sender does, and how it is modelled here:

1. **One line per main, one copy on it at a time.** Main-bound copies queue per destination (a
   main); one sender writes one copy of a line at a time (the line's *holder*). Lines to several
   mains share the physical line fairly.
2. **The copy's rate** is min(its line's share, window / RTT): the sender keeps ``window_bytes``
   in flight (``prefill.wan_engine.window_for_line``: twelve bandwidth-delay products of the
   declared line plus a slice), the line's profile gives the RTT. (Over Mooncake TCP one copy
   measured 0.74-0.94 of the emulated line at BDPs of 0.5-10 MB, in requests of half a BDP: its
   lanes finish together and wait a round trip for their acknowledgements, about W / (W + BDP)
   with W the bytes on the wire, docs/measurements.md. So this cap is optimistic by up to a
   quarter on a long fat line, and by more for a deep model's copy written one-sided.)
3. **Order**: needed-now before cache-only, a P->MD copy before a relay-covered one
   (``policy.wan_order.copy_tier``), and within a tier the earliest deadline first:
   arrival plus twice its bytes at the line's rate
   (:func:`pdd_sglang.policy.wan_order.copy_deadline`, the sender's rule; ties: the earlier
   copy). Every copy starts needed-now; :meth:`ClassedLink.set_cache_only` turns one
   cache-only (its relay answered alone).
4. **Preemption at a slice boundary.** A needed-now copy queued behind a holder it ranks ahead
   of (any cache-only holder; a needed-now one due after it) takes the line at once, and the
   holder sends on beside it, the two sharing the line, until it reaches its next slice
   boundary after the bytes it already handed to the transport (the
   sender's window, ``in_flight_bytes``: ``prefill.wan_engine.window_for_line`` of the line the
   prefill is told, not the profile's per-flow window, which the validation calibrates as a
   copy's measured rate times the RTT): bytes ``ceil((sent + window) / slice) x slice``, at
   most its size (the sender's ``WanLines.hand_over``: the new copy does not wait for that
   window to land). The yielded copy then goes back to its line with its
   progress and keeps its deadline. A background holder (cache-only,
   or relay-covered: a P->RLD->MD request's copy, as the prefill marks one whose room has a
   relay) keeps the sender's smaller window and slices (``prefill.wan_engine.background_window``:
   at most ``policy.wan_order.BACKGROUND_IN_FLIGHT_S`` of the declared line), so it yields that
   much sooner, and moves slower: a copy that keeps ``W`` bytes in flight over Mooncake TCP
   waits a round trip for each request's acknowledgement, so it moves at most
   ``W / (W + BDP)`` of the line (:func:`stop_and_wait_share`; declared from that mechanism,
   not fitted: the window probe at the demo's 10 Mbit/s x 40 ms measured one copy at 0.70-0.71
   of the line with 150-250 KB in flight, where the rule gives 0.75-0.83, and the product's
   background window there is 125 KB, 0.71 by the rule). A line shares its rate among holders
   max-min fairly, so what a slowed background copy leaves goes to the others.
5. **Dropping.** When the bytes ahead on a line (queued and the holder's remaining) exceed
   ``backlog_s`` seconds of the line at its *measured* rate, its queued cache-only copies are
   dropped, newest first, down to that bound (the holder is never dropped). The rate is
   measured as the sender measures it (``prefill.wan_line``): bytes over the time the line
   was busy, over its last ``RECENT_COPIES`` slices; no drop before one is measured. So a line
   whose recent holders were background copies, slowed by their small window, drops at fewer
   bytes than the line alone would carry. A dropped copy calls its ``on_dropped``:
   main frees the request's slots, and main's cache does not get the prompt.

Events: a copy's last byte then reaches the far end after the one-way delay, jitter and the
transfer's fixed cost (link.FlowDelivered), as on the other lines. Deterministic: ties break by
arrival order, jitter comes from the simulator's seeded generator.
"""

from __future__ import annotations

import math
from collections import deque

from pdd_sglang.policy.wan_order import copy_deadline, copy_tier
from pdd_sglang.prefill.wan_line import RECENT_COPIES

from .engine import Callback, Simulator
from .link import TIME_STEPS_TOLERANCE, FairShareLink, FlowDelivered, LinkCheck
from .profiles import LinkProfile

NEEDED_NOW = "needed_now"
CACHE_ONLY = "cache_only"


def stop_and_wait_share(window_bytes: float, bdp_bytes: float) -> float:
    """The most of a line one copy moves with ``window_bytes`` in flight when each window
    waits a round trip for its acknowledgement (``W / (W + BDP)``; 1 with no round trip)."""
    if not window_bytes > 0 or bdp_bytes < 0:
        raise ValueError(f"a window must be > 0 and a BDP >= 0, got {window_bytes!r}, "
                         f"{bdp_bytes!r}")
    return window_bytes / (window_bytes + bdp_bytes)


class Copy:
    """One main-bound copy on a classed line (the link's flow)."""

    __slots__ = ("flow_id", "size_bytes", "sent", "copy_class", "dest", "on_delivered",
                 "on_dropped", "active", "delivered_bytes", "yield_at", "handover_at", "dropped",
                 "queued_at", "relay_covered")

    def __init__(self, flow_id, size_bytes, dest, on_delivered, on_dropped, queued_at=0.0,
                 relay_covered=False):
        self.flow_id = flow_id
        self.size_bytes = float(size_bytes)
        self.sent = 0.0
        self.copy_class = NEEDED_NOW
        self.dest = dest
        self.on_delivered = on_delivered
        self.on_dropped = on_dropped
        self.active = True            # queued or being sent
        self.delivered_bytes = 0.0
        self.yield_at = None          # bytes at which it leaves the line for a needed-now copy
        self.handover_at = None       # bytes at which it hands the line over (before yield_at)
        self.dropped = False
        self.queued_at = float(queued_at)  # the simulator's clock when it was queued
        self.relay_covered = relay_covered  # a relay answers its request while it flies

    @property
    def remaining(self) -> float:
        return self.size_bytes - self.sent

    def rank(self, line_bytes_per_s: float) -> tuple:
        return (copy_tier(self.copy_class == CACHE_ONLY, self.relay_covered),
                copy_deadline(self.queued_at, self.size_bytes, line_bytes_per_s), self.flow_id)


class _Line:
    __slots__ = ("queued", "holder", "draining")

    def __init__(self):
        self.queued: list = []        # arrival order (a yielded copy goes to the back)
        self.holder: Copy | None = None
        # Copies that yielded the line and still send their window in flight (to yield_at)
        # beside the holder (the sender's WanLines.hand_over).
        self.draining: list = []

    def sending(self) -> list:
        """The copies on the wire: the holder and any still landing their window."""
        return [*self.draining, *([self.holder] if self.holder is not None else [])]


class ClassedLink(FairShareLink):
    """The WAN line of issue 34's sender (see the module docstring). The interface of
    link.FairShareLink (start_flow, remaining_bytes, cancel_flow, message_delay, byte counters),
    plus a copy's destination and class, dropping, and the bytes ahead per class."""

    def __init__(self, sim: Simulator, profile: LinkProfile, slice_bytes: float,
                 backlog_s: float | None, name: str = "wan",
                 background_window: tuple[float, float] | None = None,
                 in_flight_bytes: float | None = None):
        """background_window: (slice, window) bytes of a background holder (cache-only or
        relay-covered); None: as any. in_flight_bytes: what the sender keeps in flight of any
        other copy (``prefill.wan_engine.window_for_line``), which a copy taking the line from
        it waits for; None: the profile's per-flow window. The two differ where the profile's
        window is a measured rate times the RTT (the validation's calibration) rather than
        the bytes the sender hands Mooncake ahead."""
        super().__init__(sim, profile, name)
        if not slice_bytes > 0:
            raise ValueError(f"{name}: slice_bytes must be > 0, got {slice_bytes!r}")
        if backlog_s is not None and not backlog_s > 0:
            raise ValueError(f"{name}: backlog_s must be > 0 or None, got {backlog_s!r}")
        if background_window is not None and not min(background_window) > 0:
            raise ValueError(f"{name}: a background slice and window must be > 0, got "
                             f"{background_window!r}")
        if in_flight_bytes is not None and not in_flight_bytes > 0:
            raise ValueError(f"{name}: in_flight_bytes must be > 0 or None, got "
                             f"{in_flight_bytes!r}")
        self.in_flight_bytes = in_flight_bytes or profile.window_bytes
        self.slice_bytes = float(slice_bytes)
        self.background_window = background_window
        # A background holder's most bytes/s (module docstring, point 4).
        self.background_cap = None if background_window is None else (
            self.rate * stop_and_wait_share(background_window[1], self.rate * profile.rtt_s))
        self.backlog_s = backlog_s
        self._lines: dict = {}
        # Per destination, as the sender measures its line: (bytes, busy seconds) of its last
        # slices, and the slice being summed.
        self._recent: dict = {}
        self._summing: dict = {}
        self._last = 0.0
        self.sent_by_class = {NEEDED_NOW: 0.0, CACHE_ONLY: 0.0}
        self.dropped_cache_only_bytes = 0.0
        self.dropped_copies = 0

    # --- what the rest of the simulator asks -------------------------------------------
    @property
    def active_flows(self) -> int:
        return sum(len(line.queued) + len(line.sending()) for line in self._lines.values())

    def alone_rate(self) -> float:
        return self.flow_rate(1)

    def message_delay(self, size_bytes: float) -> float:
        """A small control message on an open connection (as link.FairShareLink)."""
        self.messages_sent += 1
        self.bytes_sent += size_bytes
        self.bytes_received += size_bytes
        return self.one_way_s + self.jitter() + size_bytes / self.flow_rate(self._holders() + 1)

    def remaining_bytes(self, flow: Copy) -> float:
        if not flow.active:
            return 0.0
        self._advance()
        return max(flow.remaining, 0.0)

    def first_token_bytes_ahead(self, dest) -> float:
        """What a new first-token copy (P->MD) to `dest` waits behind (the prefill's
        ``first_token_bytes_ahead``): the first-token bytes queued or being written, and a
        relay-covered or cache-only holder's window in flight."""
        line = self._lines.get(dest)
        if line is None:
            return 0.0
        self._advance()
        ahead = sum(c.remaining for c in line.queued if _first_token(c))
        ahead += sum(copy.yield_at - copy.sent for copy in line.draining)  # windows landing
        holder = line.holder
        if holder is not None:
            ahead += (holder.remaining if _first_token(holder)
                      else min(holder.remaining, self._window_of(holder)[1] or self.slice_bytes))
        return ahead

    def _window_of(self, holder: Copy) -> tuple[float, float]:
        """(slice, window) bytes the holder goes out with."""
        window = self.in_flight_bytes or 0.0
        if self.background_window is not None and (holder.copy_class == CACHE_ONLY
                                                   or holder.relay_covered):
            return (min(self.background_window[0], self.slice_bytes),
                    min(self.background_window[1], window or self.background_window[1]))
        return self.slice_bytes, window

    # --- copies --------------------------------------------------------------------------
    def start_flow(self, size_bytes: float, on_delivered, dest=0, on_dropped=None,
                   relay_covered=False) -> Copy:
        """Queue a needed-now copy of size_bytes to `dest`; on_delivered() once its last byte
        arrived, on_dropped() if it is dropped while cache-only. relay_covered: a relay answers
        its request meanwhile (a handoff's copy), so it keeps the background window."""
        if size_bytes < 0:
            raise ValueError("flow size must be >= 0")
        self._advance()
        self._next_id += 1
        copy = Copy(self._next_id, size_bytes, dest, on_delivered, on_dropped, self.sim.now,
                    relay_covered)
        line = self._lines.setdefault(dest, _Line())
        line.queued.append(copy)
        self._preempt(line)
        self._serve(line)
        self._drop_past_backlog(dest, line)
        self._reschedule()
        return copy

    def set_cache_only(self, copy: Copy) -> None:
        """The copy's relay answered alone: it only warms main's cache now."""
        if not copy.active or copy.copy_class == CACHE_ONLY:
            return
        self._advance()
        copy.copy_class = CACHE_ONLY
        line = self._lines[copy.dest]
        self._preempt(line)
        self._drop_past_backlog(copy.dest, line)
        self._reschedule()

    def cancel_flow(self, copy: Copy) -> float:
        """Stop a copy; returns the bytes it had pushed (they still arrive, unused)."""
        if not copy.active:
            return 0.0
        self._advance()
        pushed = self._leave(copy)
        self._serve(self._lines[copy.dest])
        self._reschedule()
        return pushed

    # --- the line's clock ----------------------------------------------------------------
    def _holders(self) -> int:
        return len(self._sending())

    def _sending(self) -> list:
        """Every copy on the wire, over all lines."""
        return [copy for line in self._lines.values() for copy in line.sending()]

    def _background(self, copy: Copy) -> bool:
        return self.background_window is not None and (copy.copy_class == CACHE_ONLY
                                                       or copy.relay_covered)

    def _rates(self, holders: list) -> dict:
        """``{flow_id: bytes/s}`` of the holders now: the line shared max-min fairly, each at
        most the per-flow cap, a background holder at most its stop-and-wait share."""
        caps = sorted((min(self.per_flow_cap, self.background_cap)
                       if self._background(h) else self.per_flow_cap, h.flow_id)
                      for h in holders)
        left, rates = float(self.rate), {}
        for count, (cap, flow_id) in enumerate(caps):
            rates[flow_id] = min(cap, left / (len(caps) - count))
            left -= rates[flow_id]
        return rates

    def _advance(self) -> None:
        now = self.sim.now
        holders = self._sending()
        if holders and now > self._last:
            rates = self._rates(holders)
            by_dest: dict = {}  # the sender measures a line's busy time once, however many send
            for holder in holders:
                step = min((now - self._last) * rates[holder.flow_id], holder.remaining)
                holder.sent += step
                self.sent_by_class[holder.copy_class] += step
                sent, first = by_dest.get(holder.dest, (0.0, holder))
                by_dest[holder.dest] = (sent + step, first)
            for sent, holder in by_dest.values():
                self._measure(holder, sent, now - self._last)
        self._last = now

    def _measure(self, holder: Copy, sent: float, busy_s: float) -> None:
        """The sender's rate measurement: a slice's bytes over its busy time, once whole."""
        summing = self._summing.setdefault(holder.dest, [0.0, 0.0])
        summing[0] += sent
        summing[1] += busy_s
        if summing[0] >= self._window_of(holder)[0]:
            self._recent.setdefault(holder.dest, deque(maxlen=RECENT_COPIES)).append(
                tuple(summing))
            self._summing[holder.dest] = [0.0, 0.0]

    def measured_rate(self, dest) -> float | None:
        """Bytes/s of the line to ``dest`` over its recent slices; None before one."""
        recent = self._recent.get(dest)
        busy_s = sum(s for _, s in recent) if recent else 0.0
        return sum(b for b, _ in recent) / busy_s if busy_s > 0 else None

    @staticmethod
    def _target(holder: Copy) -> float:
        """The bytes at which a copy on the wire next changes state: it hands the line over, its
        window has landed (it yielded), or it is sent whole."""
        if holder.handover_at is not None:
            return holder.handover_at
        return holder.size_bytes if holder.yield_at is None else holder.yield_at

    def _reschedule(self) -> None:
        self.version += 1
        holders = self._sending()
        if not holders:
            return
        rates = self._rates(holders)
        delay = min((self._target(h) - h.sent) / rates[h.flow_id] for h in holders)
        tolerance = TIME_STEPS_TOLERANCE * math.ulp(max(self.sim.now, 1.0))
        self.sim.schedule(max(delay, tolerance), LinkCheck(self, self.version))

    def _complete_due_flows(self) -> None:
        """A copy on the wire may have reached its target (sent whole, or its yield boundary:
        its window landed, so it goes back to its line's queue)."""
        self._advance()
        slack = (TIME_STEPS_TOLERANCE * math.ulp(max(self.sim.now, 1.0))
                 * max(self._rates(self._sending()).values(), default=0.0))
        for line in list(self._lines.values()):
            for holder in line.sending():
                if holder.sent + slack < self._target(holder):
                    continue
                holder.sent = self._target(holder)
                if line.holder is holder:
                    line.holder = None
                else:
                    line.draining.remove(holder)
                if holder.handover_at is not None:        # between slices: it hands over ...
                    holder.handover_at = None
                    if not self._outranked(line, holder):  # ... unless none waits now
                        holder.yield_at = None
                        line.holder = holder
                        continue
                    if holder.sent < holder.yield_at:     # its window lands beside the next
                        line.draining.append(holder)
                        continue
                if holder.sent >= holder.size_bytes:      # sent whole: it lands after the delay
                    holder.active = False
                    self.bytes_sent += holder.size_bytes
                    self.sim.schedule(self.one_way_s + self.jitter() + self.transfer_fixed_s,
                                      FlowDelivered(self, holder))
                else:                                      # yielded, its window landed
                    holder.yield_at = None
                    line.queued.append(holder)
            self._serve(line)
            self._preempt(line)  # a copy back in the queue may rank ahead of the holder
        self._reschedule()

    # --- order, preemption, dropping -----------------------------------------------------
    def _serve(self, line: _Line) -> None:
        if line.holder is None and line.queued:
            best = min(line.queued, key=lambda copy: copy.rank(self.rate))
            line.queued.remove(best)
            line.holder = best
        if line.holder is None and not line.queued and not line.draining:
            for dest, other in list(self._lines.items()):
                if other is line:
                    del self._lines[dest]

    def _preempt(self, line: _Line) -> None:
        """A holder with a needed-now copy waiting that ranks ahead of it (any, for a cache-only
        holder) hands the line over when its sender is next between slices, and sends on,
        beside the copy that takes it, to the slice boundary its window in flight reaches (the
        sender's WanLines.should_yield and hand_over); then it goes back to the queue."""
        holder = line.holder
        if holder is None or holder.yield_at is not None:
            return
        if not self._outranked(line, holder):
            return
        slice_bytes, window_bytes = self._window_of(holder)
        handed = holder.sent + window_bytes
        boundary = math.ceil(handed / slice_bytes) * slice_bytes
        holder.yield_at = min(max(boundary, holder.sent), holder.size_bytes)
        # The sender hands over once its window has room for its next slice: once the line has
        # taken a slice past what the window held (with no window, at the next event, never in
        # this call: a copy started this instant may still turn cache-only first).
        holder.handover_at = min(max(boundary + slice_bytes - window_bytes, holder.sent),
                                 holder.yield_at)

    def _outranked(self, line: _Line, holder: Copy) -> bool:
        """A needed-now copy waits on ``line`` that ranks ahead of ``holder``."""
        own = holder.rank(self.rate)
        return any(c.copy_class == NEEDED_NOW and c.rank(self.rate) < own for c in line.queued)

    def _drop_past_backlog(self, dest, line: _Line) -> None:
        rate = self.measured_rate(dest)
        if self.backlog_s is None or rate is None:
            return
        keep = self.backlog_s * rate
        ahead = sum(c.remaining for c in [*line.queued, *line.sending()])
        for copy in reversed(list(line.queued)):
            if ahead <= keep:
                break
            if copy.copy_class == CACHE_ONLY:
                ahead -= copy.remaining
                self.dropped_cache_only_bytes += copy.remaining
                self.dropped_copies += 1
                copy.dropped = True
                self._leave(copy)
                if copy.on_dropped is not None:
                    self.sim.schedule(0.0, Callback(copy.on_dropped))

    def _leave(self, copy: Copy) -> float:
        """Take a copy off its line (cancelled or dropped); the bytes it pushed still arrive."""
        line = self._lines[copy.dest]
        if line.holder is copy:
            line.holder = None
        elif copy in line.draining:
            line.draining.remove(copy)
        else:
            line.queued.remove(copy)
        copy.active = False
        self.bytes_sent += copy.sent
        self.bytes_received += copy.sent
        copy.delivered_bytes = copy.sent
        return copy.sent


def _first_token(copy: Copy) -> bool:
    """A copy whose request has no token without it (the first tier)."""
    return copy.copy_class == NEEDED_NOW and not copy.relay_covered
