"""Samples a prefill's WAN backlog (``/server_info``'s ``wan_line``, what ``/pdd/line`` reports)
while a run goes on: bytes ahead of a new copy by class, in flight, the line's measured rate and
the cache-only bytes dropped so far, summed over its mains. The mechanism behind a recovery time
(the fault suite: a new P->MD copy waits behind these bytes) and behind a drop (the demo: a line
drops queued cache-only copies past ``--pdd-wan-cache-only-backlog-s`` of its measured rate).

One thread, :class:`LineBacklog`, owns its samples; :meth:`LineBacklog.stop` joins it and hands
them over.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

SAMPLED = ("bytes_ahead", "needed_now_bytes_ahead", "first_token_bytes_ahead",
           "cache_only_bytes_ahead", "in_flight_bytes", "dropped_cache_only_bytes")


class LineBacklog(threading.Thread):
    """Every ``interval_s`` from ``since`` (``time.monotonic``), at most ``max_samples``:
    ``{"t_s", <SAMPLED>..., "recent_bytes_per_s", "rooms_open"}``, or ``{"t_s", "bytes_ahead":
    None}`` while the prefill does not answer (a dead prefill is a fault being measured)."""

    def __init__(self, pdd_state: Callable[[], dict], since: float, interval_s: float = 0.5,
                 max_samples: int = 240):
        super().__init__(name="pdd-line-backlog", daemon=True)
        self.pdd_state, self.since = pdd_state, since
        self.interval_s, self.max_samples = interval_s, max_samples
        self.samples: list = []
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set() and len(self.samples) < self.max_samples:
            at = round(time.monotonic() - self.since, 1)
            try:
                state = self.pdd_state()
            except Exception:  # noqa: BLE001 - a prefill that does not answer is measured too
                self.samples.append({"t_s": at, "bytes_ahead": None})
            else:
                self.samples.append({"t_s": at, **summed(state)})
            self._stop_event.wait(self.interval_s)

    def stop(self) -> list:
        self._stop_event.set()
        if self.is_alive():
            self.join(timeout=5)
        return self.samples


def summed(state: dict) -> dict:
    """One sample of a prefill's ``pdd_state()``: the sampled figures summed over its mains, the
    lowest measured rate of any (None before a copy was measured)."""
    lines = (state.get("wan_line") or {}).values()
    rates = [line["recent_bytes_per_s"] for line in lines if line.get("recent_bytes_per_s")]
    return {**{key: sum(int(line.get(key) or 0) for line in lines) for key in SAMPLED},
            "recent_bytes_per_s": round(min(rates)) if rates else None,
            "rooms_open": (state.get("fanout") or {}).get("rooms_open")}
