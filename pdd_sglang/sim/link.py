"""A network line: concurrent flows share it fairly (FairShareLink: processor sharing, like TCP
fair share) or leave one after another in the order they started (InOrderLink: a copy that
starts behind others waits for their bytes; ``LinkProfile.copy_order``, which
scripts/profile_cpu.py measures for the demo's line), with a per-flow throughput cap and a
per-transfer fixed cost.

With n flows active each gets min(per_flow_cap, rate / n): one TCP flow cannot go faster than
its window over the RTT, however idle the line.  Implemented with a virtual clock: every active
flow has received the same number of bytes since it started, V(t), which grows at that per-flow
rate; a flow of size S that started at V0 finishes when V reaches V0 + S.  Each change costs
O(log n).  The last byte then reaches the far end after the one-way delay, jitter and the
transfer's fixed cost (connection, handshake, completion notice), which occupy no bandwidth.

Completion is decided in time, not in bytes: a flow whose remaining bytes take less than a few
float steps of the clock is done.  (A byte tolerance cannot work: at t ~ 500 s one float step
is 1e-13 s, and a 40 GB/s line moves 0.004 B in it, so a byte test could leave a flow whose
next check lands on the same clock value forever.)
"""

from __future__ import annotations

import heapq
import math

from .engine import Event, Simulator
from .profiles import LinkProfile

TIME_STEPS_TOLERANCE = 16    # a flow this many float steps of the clock from done is done


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
    """The last byte of a flow reaches the far end: one-way delay, jitter and the transfer's
    fixed cost after sending."""

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
        self.per_flow_cap = profile.per_flow_bytes_per_s
        self.one_way_s = profile.rtt_s / 2
        self.transfer_fixed_s = profile.per_transfer_fixed_s
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

    @property
    def virtual_bytes(self) -> float:
        """Bytes every active flow has received since the line was last idle (now)."""
        self._advance()
        return self._virtual

    def flow_rate(self, flows: int) -> float:
        """Bytes per second each of `flows` concurrent flows gets."""
        return min(self.per_flow_cap, self.rate / max(flows, 1))

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

    def remaining_bytes(self, flow: Flow) -> float:
        """Bytes of the flow not yet sent (0 once it has left)."""
        if not flow.active:
            return 0.0
        return max(0.0, min(flow.size_bytes, flow.finish_virtual - self.virtual_bytes))

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
        """Delay of a small control message on an open connection: one-way delay, jitter and its
        share of the rate (no per-transfer fixed cost: the control channel stays connected).

        Counted in the byte totals but not modelled as a flow (it is too small to matter to others).
        """
        self.messages_sent += 1
        self.bytes_sent += size_bytes
        self.bytes_received += size_bytes
        return self.one_way_s + self.jitter() + size_bytes / self.flow_rate(self._active + 1)

    def _advance(self) -> None:
        now = self.sim.now
        if self._active:
            self._virtual += (now - self._last_update) * self.flow_rate(self._active)
        self._last_update = now

    def _time_tolerance(self) -> float:
        return TIME_STEPS_TOLERANCE * math.ulp(max(self.sim.now, 1.0))

    def _reschedule(self) -> None:
        self.version += 1
        heap = self._heap
        while heap and not heap[0][2].active:
            heapq.heappop(heap)
        if heap:
            delay = max(0.0, (heap[0][0] - self._virtual) / self.flow_rate(self._active))
            # _complete_due_flows finishes every flow due within the tolerance, so the check
            # always lands on a later clock value.
            self.sim.schedule(max(delay, self._time_tolerance()), LinkCheck(self, self.version))

    def _complete_due_flows(self) -> None:
        self._advance()
        heap = self._heap
        due_virtual = self._virtual + self._time_tolerance() * self.flow_rate(self._active)
        while heap and (not heap[0][2].active or heap[0][0] <= due_virtual):
            _, _, flow = heapq.heappop(heap)
            if not flow.active:
                continue
            flow.active = False
            self._active -= 1
            self.bytes_sent += flow.size_bytes
            self.sim.schedule(self.one_way_s + self.jitter() + self.transfer_fixed_s,
                              FlowDelivered(self, flow))
        if not self._active:
            self._virtual = 0.0
            heap.clear()
        self._reschedule()


class InOrderLink(FairShareLink):
    """Flows leave one after another in the order they started, each at the full rate (capped by
    its window).  The virtual clock counts the bytes the line has sent since it was last idle; a
    flow starts where the last queued one ends, so it finishes after every byte queued before it
    and its own."""

    def __init__(self, sim: Simulator, profile: LinkProfile, name: str = "link"):
        super().__init__(sim, profile, name)
        self._queue_end = 0.0          # virtual position where the last queued flow ends

    def flow_rate(self, flows: int) -> float:
        return min(self.per_flow_cap, self.rate)

    def start_flow(self, size_bytes: float, on_delivered) -> Flow:
        if size_bytes < 0:
            raise ValueError("flow size must be >= 0")
        self._advance()
        self._next_id += 1
        flow = Flow(self._next_id, float(size_bytes), max(self._queue_end, self._virtual),
                    on_delivered)
        self._queue_end = flow.finish_virtual
        heapq.heappush(self._heap, (flow.finish_virtual, flow.flow_id, flow))
        self._active += 1
        self._reschedule()
        return flow

    def cancel_flow(self, flow: Flow) -> float:
        """Stop a flow: the bytes it pushed arrive unused, and the flows behind it move up by
        the bytes it will not send."""
        if not flow.active:
            return 0.0
        self._advance()
        flow.active = False
        self._active -= 1
        pushed = min(flow.size_bytes, max(0.0, self._virtual - flow.start_virtual))
        self.bytes_sent += pushed
        self.bytes_received += pushed
        flow.delivered_bytes = pushed
        unsent = flow.size_bytes - pushed
        behind = [f for _, _, f in self._heap if f.active and f.start_virtual > flow.start_virtual]
        for later in behind:
            later.start_virtual = max(later.start_virtual - unsent, self._virtual)
            later.finish_virtual = later.start_virtual + later.size_bytes
        self._heap = [(f.finish_virtual, f.flow_id, f) for _, _, f in self._heap if f.active]
        heapq.heapify(self._heap)
        self._queue_end = max([self._virtual] + [f.finish_virtual for _, _, f in self._heap])
        self._reschedule()
        return pushed

    def _complete_due_flows(self) -> None:
        super()._complete_due_flows()
        if not self._active:
            self._queue_end = 0.0


def make_link(sim: Simulator, profile: LinkProfile, name: str = "link") -> FairShareLink:
    """The line its profile describes: copies in order, or shared fairly."""
    kind = InOrderLink if profile.copy_order == "in_order" else FairShareLink
    return kind(sim, profile, name)
