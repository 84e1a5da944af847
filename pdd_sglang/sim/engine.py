"""The discrete-event core: a clock, a heap of events and a seeded RNG.

Ties break in a fixed order: events at the same time fire in the order they were scheduled
(a monotone sequence number is the heap's second key), so a seed gives the same run.

A run that stops advancing its clock is a bug (an event rescheduling itself below the float step
of the clock); Simulator.run raises ClockStalled, naming the event and the time, instead of
spinning forever.
"""

from __future__ import annotations

import heapq
import random


class Event:
    """One thing that happens at a time. Subclasses implement fire(); keep each one small."""

    __slots__ = ()

    def fire(self, sim: "Simulator") -> None:  # pragma: no cover - abstract
        raise NotImplementedError


class Callback(Event):
    """Call a function later; for one-line reactions that need no class of their own."""

    __slots__ = ("function", "args")

    def __init__(self, function, *args):
        self.function = function
        self.args = args

    def fire(self, sim: "Simulator") -> None:
        self.function(*self.args)


class ClockStalled(RuntimeError):
    """Too many consecutive events fired without the clock advancing."""


class Simulator:
    # Consecutive events at one clock value before the run is declared stalled.  A real burst
    # (every request of a trace arriving at t = 0, each with a few follow-up events) stays far
    # below this; a self-rescheduling event reaches it in well under a second.
    STALL_EVENTS = 200_000

    def __init__(self, seed: int = 0, stall_events: int = STALL_EVENTS):
        self.now = 0.0
        self.rng = random.Random(seed)
        self._heap: list = []
        self._sequence = 0
        self.events_fired = 0
        self.stall_events = stall_events

    def schedule(self, delay_s: float, event: Event) -> None:
        if delay_s < 0:
            raise ValueError(f"cannot schedule into the past (delay {delay_s})")
        self._sequence += 1
        heapq.heappush(self._heap, (self.now + delay_s, self._sequence, event))

    def at(self, time_s: float, event: Event) -> None:
        self.schedule(max(0.0, time_s - self.now), event)

    def run(self, until_s: float = float("inf"), progress=None) -> None:
        heap = self._heap
        same_time = 0
        while heap and heap[0][0] <= until_s:
            time_s, _, event = heapq.heappop(heap)
            if time_s == self.now:
                same_time += 1
                if same_time >= self.stall_events:
                    raise ClockStalled(
                        f"the clock stopped advancing: {same_time} consecutive events at "
                        f"t = {time_s!r} s, the last a {type(event).__name__} ({event!r}); "
                        f"{len(heap)} events pending")
            else:
                same_time = 0
            self.now = time_s
            event.fire(self)
            self.events_fired += 1
            if progress is not None and not self.events_fired & 0x3FFF:
                progress(self.now)

    @property
    def pending(self) -> int:
        return len(self._heap)
