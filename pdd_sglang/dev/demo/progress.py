"""The demo's one-line progress bar on stderr (a line every 5 s when stderr is not a terminal)."""

from __future__ import annotations

import sys
import time

from pdd_sglang.dev.testing import agentic


class Progress:
    """One-line progress bar on stderr."""

    def __init__(self, label: str, total: int, width: int = 30):
        self.label, self.total, self.width = label, total, width
        self.done = self.errors = 0
        self.started = time.perf_counter()
        self.tty = sys.stderr.isatty()
        self._last_line = 0.0

    def update(self, result: agentic.RequestResult) -> None:
        self.done += 1
        self.errors += bool(result.error)
        now = time.perf_counter()
        if self.tty or now - self._last_line > 5 or self.done == self.total:
            self._last_line = now
            filled = int(self.width * self.done / max(self.total, 1))
            bar = "#" * filled + "-" * (self.width - filled)
            sys.stderr.write(f"\r  {self.label:<26} [{bar}] {self.done:>4}/{self.total} requests"
                             f"  errors {self.errors}  {now - self.started:6.1f} s"
                             f"{'' if self.tty else chr(10)}")
            sys.stderr.flush()

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\n")
            sys.stderr.flush()
