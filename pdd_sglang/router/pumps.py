"""The I/O side of one request: each decoder's stream and the prefill's answer, fed into the
queues that the dispatcher's splice loop reads. Plumbing only: the loop owns every decision.

A decoder's queue receives its chunks, put there by the connection's read callback as they
arrive (upstream.UpstreamClient.stream_into: the decoder's task wakes only at the stream's end),
then the end of its stream (:class:`StreamEndedEarly`, read only when the stream ended before the
answer did) or the exception that broke it; the decoder's task returns how its stream ended
(:class:`StreamEnd`), which tells whether a copy kept after the client's answer landed at main
(landing.py). Every decoder's queue also receives the prefill's failure, or PREFILL_ANSWERED:
prefill answers once its last KV copy has landed, main's across the WAN included, which is how
the router knows main has the prompt (dispatch.py's relay-loss handling relies on it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Optional

from pdd_sglang.router.metrics import RouterMetrics
from pdd_sglang.router.placement import Placement
from pdd_sglang.router.request_parsing import GenerateJob
from pdd_sglang.router.servers import Upstream
from pdd_sglang.router.shared_state import SharedState
from pdd_sglang.router.splice import StreamSplicer
from pdd_sglang.router.upstream import UpstreamClient

logger = logging.getLogger("pdd_sglang.router")

PREFILL_ANSWERED = object()


class ItemQueue:
    """One stream's items for the splice loop: one producer and one consumer on the event loop
    it was made on. asyncio.Queue looks the running loop up at every wait, which in Python 3.11
    is a system call (getpid), once per chunk relayed."""

    __slots__ = ("_items", "_loop", "_waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._items: deque = deque()
        self._loop = loop
        self._waiter: Optional[asyncio.Future] = None

    def put_nowait(self, item) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def get_nowait(self):
        if not self._items:
            raise asyncio.QueueEmpty
        return self._items.popleft()

    async def get(self):
        while not self._items:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()


class StreamEndedEarly(RuntimeError):
    """A decoder closed its stream before finishing (or handing off) the answer."""

    def __init__(self, upstream: Upstream):
        super().__init__(f"{upstream.role} {upstream.url} closed its stream before finishing")
        self.upstream = upstream


@dataclass(frozen=True)
class StreamEnd:
    """How a decoder's stream ended: after how many chunks, and the error that ended it."""

    chunks: int
    error: Optional[BaseException] = None


class Pumps:
    def __init__(self, client: UpstreamClient, metrics: RouterMetrics, shared: SharedState,
                 kv_bytes_per_token: float, wait_for_landing_s: float,
                 log_prefill_stats: bool):
        self.client = client
        self.log_prefill_stats = log_prefill_stats
        self.metrics = metrics
        self.shared = shared  # the line accounting, kept alike across workers
        self.kv_bytes_per_token = kv_bytes_per_token
        self.wait_for_landing_s = wait_for_landing_s

    async def decoder(self, upstream: Upstream, body: dict, queue: ItemQueue,
                      splicer: StreamSplicer, after: asyncio.Event | None = None,
                      placement: Placement | None = None, job: GenerateJob | None = None,
                      marks: dict | None = None, copies: dict | None = None) -> StreamEnd:
        """A relay's or main's stream, chunk by chunk; main's also accounts its WAN copy."""
        copy = None
        chunks = 0

        def deliver(chunk) -> None:  # from the event loop's read callback, chunk by chunk
            nonlocal chunks
            chunks += 1
            if chunks == 1:
                self._first_chunk(upstream, chunk, splicer, copy, placement, marks, copies)
            queue.put_nowait(chunk)

        try:
            if after is not None and not after.is_set():
                # The relay streams meanwhile; prefill holds main's KV until main registers.
                try:
                    async with asyncio.timeout(self.wait_for_landing_s):  # no task, as wait_for's
                        await after.wait()
                    self.metrics.child(self.metrics.main_waits, "landed").inc()
                except TimeoutError:
                    self.metrics.child(self.metrics.main_waits, "timed_out").inc()
            if upstream.role == "main" and placement is not None and job is not None:
                uncached = max(job.prompt.tokens - placement.main_cached_tokens, 0)
                # main's leg of P->RLD->MD: its relay answers meanwhile (relay_covered)
                copy = self.shared.copy_begun(upstream.url, uncached * self.kv_bytes_per_token,
                                              relay_covered=placement.relay is not None)
                if copies is not None:
                    copies["main"] = copy
            await self.client.stream_into(upstream, body, deliver)
            queue.put_nowait(StreamEndedEarly(upstream))
            return StreamEnd(chunks)
        except asyncio.CancelledError:
            raise
        except BaseException as err:  # handed to the splice loop, which owns error handling
            queue.put_nowait(err)
            return StreamEnd(chunks, err)
        finally:
            if copy is not None:
                self.shared.copy_ended(copy, landed=False)  # no-op once landed

    def _first_chunk(self, upstream: Upstream, chunk, splicer: StreamSplicer, copy,
                     placement: Placement | None, marks: dict | None,
                     copies: dict | None) -> None:
        """What a decoder's first chunk tells: main has its KV (its copy landed), the relay's
        says prefill's forward is done (main's copy is on the line from here)."""
        if upstream.role == "main" and splicer.main_cached_tokens is None:
            splicer.main_cached_tokens = chunk.meta.get("cached_tokens")
        if copy is not None and copy.open:
            self.shared.copy_ended(copy, landed=True)  # main ran a forward on the landed KV
            self.metrics.wan_copy_landed(placement.predicted_wan_s,
                                         time.monotonic() - copy.started)
        if marks is not None:
            marks[f"{upstream.role}_first_chunk_ts"] = time.time()
        if upstream.role == "relay" and copies is not None:
            self.shared.copy_on_wire(copies.get("main"))

    async def prefill(self, upstream: Upstream, body: dict, queues: list[ItemQueue],
                      marks: dict) -> None:
        """The prefill's answer carries nothing for the client; only its failure matters (and
        its time stats, logged for the demo's stage split with --log-prefill-stats)."""
        try:
            marks["prefill_sent_ts"] = time.time()
            answer = await self.client.generate_final(upstream, body)
        except asyncio.CancelledError:
            raise
        except BaseException as err:
            for queue in queues:
                queue.put_nowait(err)
            return
        for queue in queues:  # prefill answers once its last copy has landed, main's included
            queue.put_nowait(PREFILL_ANSWERED)
        if not self.log_prefill_stats:
            return
        meta = (answer or {}).get("meta_info") or {}
        stats = {k: v for k, v in meta.items() if isinstance(v, (int, float)) and (
            k.endswith(("_ts", "_time", "_latency")) or k == "queue_time")}
        logger.info("pdd-prefill-stats %s", json.dumps({"rid": body["rid"], **stats}))
