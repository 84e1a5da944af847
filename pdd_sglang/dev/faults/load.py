"""A steady request load through the router, and how each request ended.

Each client thread sends one streamed ``/generate`` after another until told to stop. A request
ends in exactly one of three ways:

  completed  the whole answer arrived (``[DONE]``, every asked-for token);
  errored    the router or a server said why it failed (an HTTP error, an error chunk, a stream
             that ended early): the client knows and can retry;
  lost       nothing conclusive within ``answer_timeout_s``: the promise is that this never
             happens.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from pdd_sglang.dev.testing import agentic


@dataclass(frozen=True)
class LoadProfile:
    """What the clients send: ``shared_tokens`` of one common prefix (main's cache hits them
    after the first request), ``unique_tokens`` per request (they cross the WAN), and outputs of
    ``output_tokens`` (EOS ignored, greedy)."""

    shared_tokens: int
    unique_tokens: int
    output_tokens: int
    concurrency: int = 3


@dataclass
class Sent:
    result: agentic.RequestResult
    started: float  # time.monotonic() at send
    ended: Optional[float] = None
    body: Optional[dict] = None  # what was sent (input_ids, sampling_params)
    probe: bool = False  # sent once, right after a fault, outside the clients' closed loop

    @property
    def status(self) -> str:
        error = self.result.error
        if error is None:
            return "completed"
        return "lost" if _is_timeout(error) else "errored"


def _is_timeout(error: str) -> bool:
    return "TimeoutError" in error or "timed out" in error


@dataclass
class SteadyLoad:
    host: str
    port: int
    profile: LoadProfile
    seed: int = 0
    answer_timeout_s: float = 120.0
    thread_setup: Optional[Callable[[], object]] = None  # e.g. entering the client's namespace
    sent: list = field(default_factory=list)
    headers: Optional[dict] = None  # the router's key (RouterProcess.headers)

    def __post_init__(self) -> None:
        rng = random.Random(self.seed)
        self._prefix = [rng.randrange(10, 1000) for _ in range(self.profile.shared_tokens)]
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._count = 0
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        for index in range(self.profile.concurrency):
            thread = threading.Thread(target=self._client, args=(index,), daemon=True,
                                      name=f"fault-load-{index}")
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        """Send nothing new; wait for every request in flight to end (at most its timeout)."""
        self._stop.set()
        for thread in self._threads:
            thread.join(self.answer_timeout_s + 30)

    def send_probe(self) -> threading.Thread:
        """Send one request now, beside the clients: the first request after a fault, which the
        closed loop would only send once one of its own requests ended."""
        thread = threading.Thread(target=self._probe, daemon=True, name="fault-load-probe")
        thread.start()
        self._threads.append(thread)
        return thread

    def _probe(self) -> None:
        context = self.thread_setup() if self.thread_setup else contextlib.nullcontext()
        with context:
            self._send(self.profile.concurrency, probe=True)

    def in_flight(self) -> list[Sent]:
        with self._lock:
            return [s for s in self.sent if s.ended is None]

    def _next_body(self, index: int) -> tuple[int, dict]:
        """The next request of client ``index``: (its number, its /generate body)."""
        with self._lock:
            number = self._count
            self._count += 1
        rng = random.Random(f"{self.seed}-{number}")
        unique = [rng.randrange(10, 1000) for _ in range(self.profile.unique_tokens)]
        return number, {"input_ids": self._prefix + unique,
                        "sampling_params": {"max_new_tokens": self.profile.output_tokens,
                                            "temperature": 0.0, "ignore_eos": True}}

    def _client(self, index: int) -> None:
        context = self.thread_setup() if self.thread_setup else contextlib.nullcontext()
        with context:
            while not self._stop.is_set():
                record = self._send(index)
                self._finished(index, record)
                if record.result.error:
                    time.sleep(0.5)  # a client backs off after an error instead of spinning

    def _send(self, index: int, probe: bool = False) -> Sent:
        number, body = self._next_body(index)
        result = agentic.RequestResult(index, number, len(body["input_ids"]),
                                       self.profile.unique_tokens,
                                       body["sampling_params"]["max_new_tokens"])
        record = Sent(result, time.monotonic(), body=body, probe=probe)
        with self._lock:
            self.sent.append(record)
        agentic.stream_generate(self.host, self.port, body, self.answer_timeout_s, result,
                                self.headers)
        record.ended = time.monotonic()
        return record

    def _finished(self, index: int, record: Sent) -> None:
        """Client ``index``'s request ended (a multi-turn load extends its history here)."""


def tally(sent: list[Sent]) -> dict:
    counts = {"sent": len(sent), "completed": 0, "errored": 0, "lost": 0}
    for record in sent:
        counts[record.status] += 1
    return counts
