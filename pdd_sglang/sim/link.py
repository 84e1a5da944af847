"""A network line shared fairly by concurrent flows (processor sharing, like TCP fair share).

With n flows active each gets rate / n, so a small high-hit transfer slips through while a
large low-hit one crawls.  Implemented with a virtual clock: every active flow has received the
same number of bytes since it started, V(t), which grows at rate / n; a flow of size S that
started at V0 finishes when V reaches V0 + S.  Each change costs O(log n).
"""

from __future__ import annotations

import heapq

from .engine import Event, Simulator
from .profiles import LinkProfile


class Flow:
    __slots__ = ("flow_id", "size_bytes", "start_virtual", "finish_virtual", "on_delivered",
                 "active", "delivered_bytes")

    def __init__(self, flow_id, size_bytes, start_virtual, on_delivered):
        self.flow_id = flow_id
        self.size_bytes = size_bytes
        self.start_virtual = start_virtual
        self.finish_virtual = start_virtual + size_bytes
        self.on_delivered = on_delivered
        self.active = True
        self.delivered_bytes = 0.0


class LinkCheck(Event):
    """The earliest active flow may have finished sending (ignored if the link changed since)."""

    __slots__ = ("link", "version")

    def __init__(self, link, version):
        self.link = link
        self.version = version

    def fire(self, sim):
        if self.version == self.link.version:
            self.link._complete_due_flows()


class FlowDelivered(Event):
    """The last byte of a flow reaches the far end, one-way delay plus jitter after sending."""

    __slots__ = ("link", "flow")

    def __init__(self, link, flow):
        self.link = link
        self.flow = flow

    def fire(self, sim):
        self.link.bytes_received += self.flow.size_bytes
        self.flow.delivered_bytes = self.flow.size_bytes
        self.flow.on_delivered()


class FairShareLink:
    def __init__(self, sim: Simulator, profile: LinkProfile, name: str = "link"):
        if profile.bytes_per_s <= 0:
            raise ValueError(f"{name}: bandwidth must be positive")
        self.sim = sim
        self.profile = profile
        self.name = name
        self.rate = profile.bytes_per_s
        self.one_way_s = profile.rtt_s / 2
        self.version = 0
        self._virtual = 0.0
        self._last_update = 0.0
        self._active = 0
        self._heap: list = []
        self._next_id = 0
        self.bytes_sent = 0.0       # bytes that left the sender (whole flows or cancelled parts)
        self.bytes_received = 0.0   # bytes that reached the receiver
        self.messages_sent = 0

    @property
    def active_flows(self) -> int:
        return self._active

    def jitter(self) -> float:
        return self.sim.rng.uniform(0.0, self.profile.jitter_s) if self.profile.jitter_s else 0.0

    def start_flow(self, size_bytes: float, on_delivered) -> Flow:
        """Send size_bytes; on_delivered() runs when the last byte has arrived."""
        if size_bytes < 0:
            raise ValueError("flow size must be >= 0")
        self._advance()
        self._next_id += 1
        flow = Flow(self._next_id, float(size_bytes), self._virtual, on_delivered)
        heapq.heappush(self._heap, (flow.finish_virtual, flow.flow_id, flow))
        self._active += 1
        self._reschedule()
        return flow

    def cancel_flow(self, flow: Flow) -> float:
        """Stop a flow; returns the bytes it had already pushed (they still arrive, unused)."""
        if not flow.active:
            return 0.0
        self._advance()
        flow.active = False
        self._active -= 1
        pushed = min(flow.size_bytes, self._virtual - flow.start_virtual)
        self.bytes_sent += pushed
        self.bytes_received += pushed
        flow.delivered_bytes = pushed
        self._reschedule()
        return pushed

    def message_delay(self, size_bytes: float) -> float:
        """Delay of a small control message: one-way delay, jitter and its fair share of rate.

        Counted in the byte totals but not modelled as a flow (it is too small to matter to others).
        """
        self.messages_sent += 1
        self.bytes_sent += size_bytes
        self.bytes_received += size_bytes
        return self.one_way_s + self.jitter() + size_bytes * (self._active + 1) / self.rate

    def _advance(self) -> None:
        now = self.sim.now
        if self._active:
            self._virtual += (now - self._last_update) * self.rate / self._active
        self._last_update = now

    def _reschedule(self) -> None:
        self.version += 1
        heap = self._heap
        while heap and not heap[0][2].active:
            heapq.heappop(heap)
        if heap:
            delay = max(0.0, (heap[0][0] - self._virtual) * self._active / self.rate)
            self.sim.schedule(delay, LinkCheck(self, self.version))

    def _complete_due_flows(self) -> None:
        self._advance()
        heap = self._heap
        # Relative tolerance: virtual bytes reach 1e12, where float rounding exceeds one byte.
        tolerance = 1e-9 * max(1.0, self._virtual) + 1e-3
        while heap and (not heap[0][2].active or heap[0][0] <= self._virtual + tolerance):
            _, _, flow = heapq.heappop(heap)
            if not flow.active:
                continue
            flow.active = False
            self._active -= 1
            self.bytes_sent += flow.size_bytes
            self.sim.schedule(self.one_way_s + self.jitter(), FlowDelivered(self, flow))
        if not self._active:
            self._virtual = 0.0
            heap.clear()
        self._reschedule()
