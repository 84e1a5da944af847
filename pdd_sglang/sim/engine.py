"""The discrete-event core: a clock, a heap of events and a seeded RNG.

Ties break in a fixed order: events at the same time fire in the order they were scheduled
(a monotone sequence number is the heap's second key), so a seed gives the same run.
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


class Simulator:
    def __init__(self, seed: int = 0):
        self.now = 0.0
        self.rng = random.Random(seed)
        self._heap: list = []
        self._sequence = 0
        self.events_fired = 0

    def schedule(self, delay_s: float, event: Event) -> None:
        if delay_s < 0:
            raise ValueError(f"cannot schedule into the past (delay {delay_s})")
        self._sequence += 1
        heapq.heappush(self._heap, (self.now + delay_s, self._sequence, event))

    def at(self, time_s: float, event: Event) -> None:
        self.schedule(max(0.0, time_s - self.now), event)

    def run(self, until_s: float = float("inf"), progress=None) -> None:
        heap = self._heap
        while heap and heap[0][0] <= until_s:
            time_s, _, event = heapq.heappop(heap)
            self.now = time_s
            event.fire(self)
            self.events_fired += 1
            if progress is not None and not self.events_fired & 0x3FFF:
                progress(self.now)

    @property
    def pending(self) -> int:
        return len(self._heap)
