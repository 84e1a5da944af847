"""Bytes and pages that a prefill server hands to Mooncake, per destination and per request.

Measured at the sender, on the lengths passed to Mooncake's batch transfer, so the figures that
benchmarks and the paper's plots read are what crossed the wire, not a count inferred from token
totals. The sender (SGLang's transfer worker, or PDD's own on a PDD room) opens a scope (room,
destination session) before it sends a request's chunk, and SGLang's aux path (the first output
token and its metadata) opens an aux scope; every batch written inside a scope is charged to it,
KV and aux apart. Batches written in another thread (Mooncake's custom-memory-pool path fans
layers out to an executor) are charged to the destination alone.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass

# Enough for every request of a test or benchmark run; old rooms fall out first.
MAX_TRACKED_REQUESTS = 8192


@dataclass
class TransferCount:
    bytes: int = 0  # KV pages only
    pages: int = 0
    batches: int = 0
    aux_bytes: int = 0  # SGLang's per-request metadata (first token, logprobs)
    wire_bytes: int = 0  # what the KV pages took on the wire: fewer when coded (issue 36)

    def charge(self, kind: str, nbytes: int, wire: int | None = None) -> None:
        if kind == "aux":
            self.aux_bytes += nbytes
        else:
            self.bytes += nbytes
            self.wire_bytes += nbytes if wire is None else wire
            self.batches += 1


class _PrometheusCounters:
    """The ledger's totals as Prometheus counters, in SGLang's own /metrics (--enable-metrics).

    SGLang collects metrics of its scheduler processes through prometheus_client's multiprocess
    mode; counters exist only when it set that up, so plain runs pay nothing.
    """

    def __init__(self):
        from prometheus_client import Counter

        self.bytes = Counter("sglang:pdd_kv_transfer_bytes_total",
                             "KV bytes prefill handed to Mooncake, by destination role", ["role"])
        self.pages = Counter("sglang:pdd_kv_transfer_pages_total",
                             "KV pages prefill sent, by destination role", ["role"])
        self.aux_bytes = Counter("sglang:pdd_kv_transfer_aux_bytes_total",
                                 "Aux metadata bytes prefill sent, by destination role", ["role"])

    @staticmethod
    def create():
        return _PrometheusCounters() if os.environ.get("PROMETHEUS_MULTIPROC_DIR") else None


class TransferLedger:
    def __init__(self, max_tracked_requests: int = MAX_TRACKED_REQUESTS):
        self._lock = threading.Lock()
        self._scope = threading.local()
        self._max_tracked = max_tracked_requests
        self._by_destination: dict[str, TransferCount] = {}
        self._by_request: OrderedDict[tuple[int, str], TransferCount] = OrderedDict()
        self._roles: dict[str, str] = {}
        self._counters = None
        self._counters_checked = False

    def _metrics(self):
        if not self._counters_checked:
            self._counters_checked = True
            self._counters = _PrometheusCounters.create()
        return self._counters

    def set_role(self, destination: str, role: str) -> None:
        """Name a destination session by its PDD role (relay or main) in the figures."""
        with self._lock:
            self._roles[str(destination)] = role

    def begin(self, room: int, destination: str, pages: int) -> None:
        """Open the scope of one chunk of one request to one destination."""
        self._scope.key = (int(room), str(destination))
        self._scope.kind = "kv"
        with self._lock:
            self._request(self._scope.key).pages += int(pages)
            self._destination(str(destination)).pages += int(pages)
            role = self._roles.get(str(destination), "decode")
            metrics = self._metrics()
        if metrics is not None:
            metrics.pages.labels(role=role).inc(int(pages))

    def scope(self) -> tuple:
        """This thread's open scope, to carry to a worker thread (:meth:`run_in_scope`)."""
        return getattr(self._scope, "key", None), getattr(self._scope, "kind", "kv")

    def run_in_scope(self, scope: tuple, fn, *args, **kwargs):
        """Call ``fn`` in ``scope`` (another thread's, from :meth:`scope`) on this thread."""
        self._scope.key, self._scope.kind = scope
        return fn(*args, **kwargs)

    def begin_aux(self, room: int, destination: str) -> None:
        """Open the scope of one request's aux metadata to one destination."""
        self._scope.key = (int(room), str(destination))
        self._scope.kind = "aux"

    def record_batch(self, destination: str, lengths, wire_bytes: int | None = None) -> None:
        """A batch of KV ``lengths`` (or aux) handed to Mooncake; ``wire_bytes``: what it took
        on the wire when coded (issue 36), else its KV bytes."""
        nbytes = int(sum(lengths))
        wire = nbytes if wire_bytes is None else int(wire_bytes)
        key = getattr(self._scope, "key", None)
        kind = getattr(self._scope, "kind", "kv")
        with self._lock:
            self._destination(str(destination)).charge(kind, nbytes, wire)
            if key is not None and key[1] == str(destination):
                self._request(key).charge(kind, nbytes, wire)
            role = self._roles.get(str(destination), "decode")
            metrics = self._metrics()
        if metrics is not None:
            (metrics.aux_bytes if kind == "aux" else metrics.bytes).labels(role=role).inc(nbytes)

    def request_summary(self, room: int) -> str:
        """One log line's worth: what each destination of ``room`` was sent."""
        with self._lock:
            parts = [
                f"{self._roles.get(dest, 'decode')} {count.pages} pages / {count.bytes} B"
                for (r, dest), count in self._by_request.items() if r == room
            ]
        return "; ".join(parts) or "nothing"

    def snapshot(self) -> dict:
        with self._lock:
            by_role: dict[str, TransferCount] = {}
            for dest, count in self._by_destination.items():
                total = by_role.setdefault(self._roles.get(dest, "decode"), TransferCount())
                total.bytes += count.bytes
                total.pages += count.pages
                total.batches += count.batches
                total.aux_bytes += count.aux_bytes
                total.wire_bytes += count.wire_bytes
            return {
                "by_destination": {
                    k: {"role": self._roles.get(k, "decode"), **asdict(v)}
                    for k, v in self._by_destination.items()
                },
                "by_role": {k: asdict(v) for k, v in by_role.items()},
                "by_request": [
                    {"room": room, "destination": dest, "role": self._roles.get(dest, "decode"),
                     **asdict(count)}
                    for (room, dest), count in self._by_request.items()
                ],
            }

    def _destination(self, destination: str) -> TransferCount:
        return self._by_destination.setdefault(destination, TransferCount())

    def _request(self, key: tuple[int, str]) -> TransferCount:
        count = self._by_request.get(key)
        if count is None:
            count = self._by_request[key] = TransferCount()
            while len(self._by_request) > self._max_tracked:
                self._by_request.popitem(last=False)
        return count


LEDGER = TransferLedger()
