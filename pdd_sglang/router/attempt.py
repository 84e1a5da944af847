"""One attempt at a request: its servers have it, their streams are spliced, and every way a
server can fail it is one function that says what the client sees.

Life cycle (``Dispatcher.run`` calls these in order):

1. :meth:`Attempt.__init__` fans the request out: one ``/generate`` body (a fresh rid and
   bootstrap room, the route in ``kv_hints``) to the prefill and the pipeline's decoders at once
   (:mod:`pumps`), each decoder's stream into its own queue.
2. :meth:`next_item` waits on the queue of the stream the client is reading now (the relay's,
   then main's: the splicer's phase); main's silence after a lost relay has a deadline.
3. :meth:`take` turns the item into the client's next update (:mod:`splice`), or into one of the
   fault paths below; :meth:`sent` stamps the update (times, the finish summary).
4. :meth:`failed` counts why the attempt failed; :meth:`close` ends what is left: aborts on every
   server unless the answer finished cleanly, and when the relay answered alone, main's WAN
   copy goes on so main caches the prompt (:func:`landing.keep_mains_copy`).

Fault paths (what the client sees):

- :meth:`Attempt.prefill_failed_behind_the_relay`: nothing; the relay finishes the answer.
- ``relay_loss.relay_lost``: a pause, then main's tokens from the next position it lacks; or,
  when the relay never had the request, a longer wait for a fresh placement without it.
- ``relay_loss.failed_after_the_relay_was_lost`` and ``relay_loss.main_never_noticed``: a pause,
  then the rest of the answer from a fresh placement, from the client's last token.
- :meth:`Attempt.stream_failed`: an error, unless ``Dispatcher.serve`` places the request again.

Owner: the request's handler task; the pumps only fill the queues.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import random
import time
from typing import Optional

from pdd_sglang import policy
from pdd_sglang.protocol.route import route_kv_hints
from pdd_sglang.router import relay_loss
from pdd_sglang.router.landing import keep_mains_copy
from pdd_sglang.router.metrics import TokenClock
from pdd_sglang.router.placement import Placement
from pdd_sglang.router.pumps import PREFILL_ANSWERED, ItemQueue, StreamEndedEarly
from pdd_sglang.router.relay_loss import MainSilence
from pdd_sglang.router.request_parsing import GenerateJob
from pdd_sglang.router.servers import Upstream
from pdd_sglang.router.splice import SplicedUpdate, SpliceError, StreamSplicer, UpstreamChunk
from pdd_sglang.router.stop_strings import StopStrings
from pdd_sglang.router.upstream import UpstreamError

logger = logging.getLogger("pdd_sglang.router")

# Request ids and bootstrap rooms: unique across router processes (a random prefix and a
# generator seeded from the OS, per process, again in a forked worker) without a system call per
# request. No rid is a prefix of another (a number, then RID_END): SGLang's scheduler aborts
# every request whose rid *starts with* the one it is told (Scheduler.abort_request), so
# aborting "pdd-x-2" aborted "pdd-x-21" to "pdd-x-29" too, wherever they were.
_RID_NUMBERS = itertools.count()
RID_END = "."
STREAM_END_GRACE_S = 5.0  # after an answer, for a server to end a stream that gave its finish


def _seed() -> None:
    global _RID_PREFIX, _ROOMS
    _RID_PREFIX = f"pdd-{os.urandom(6).hex()}-"
    _ROOMS = random.Random(os.urandom(16))


_seed()
os.register_at_fork(after_in_child=_seed)


def retryable(err: BaseException) -> bool:
    """A server's failure, not the request's: a 4xx is the request's fault and stays an error."""
    status = getattr(err, "status", None)
    return not (isinstance(status, int) and 400 <= status < 500)


def _from(item, upstream: Optional[Upstream]) -> bool:
    """Whether ``item`` is the failure, or the early end, of ``upstream``'s stream."""
    return getattr(item, "upstream", None) is upstream


async def _next_item(queue: ItemQueue, timeout_s: Optional[float]):
    """The queue's next item; asyncio.TimeoutError after ``timeout_s`` without one."""
    if timeout_s is None:
        return await queue.get()
    try:
        return queue.get_nowait()  # what is there already counts, however short the timeout
    except asyncio.QueueEmpty:
        return await asyncio.wait_for(queue.get(), timeout_s)


def new_rid() -> str:
    """A request id no other of this router's is a prefix of (see RID_END)."""
    return f"{_RID_PREFIX}{next(_RID_NUMBERS)}{RID_END}"


def request_body(job: GenerateJob, placement: Placement) -> dict:
    """The one /generate body every server of the placement gets."""
    rid = new_rid()
    return {
        **job.extra,
        **job.prompt.body_fields(),
        "sampling_params": job.sampling_params,
        "rid": rid,
        "bootstrap_host": placement.prefill.bootstrap_host,
        "bootstrap_port": placement.prefill.bootstrap_port,
        "bootstrap_room": _ROOMS.getrandbits(62),
        "kv_hints": route_kv_hints(placement.route_name, message_id=rid,
                                   **placement.route_fields),
    }


class Attempt:
    """``router`` is the Dispatcher: the services (client, metrics, health, pumps, the shared
    tables) one attempt uses."""

    def __init__(self, router, job: GenerateJob, placement: Placement, api: str,
                 started: float):
        self.router, self.job, self.placement = router, job, placement
        self.loop = asyncio.get_running_loop()  # once: each look-up is a system call (3.11)
        self.body = request_body(job, placement)
        self.rid = self.body["rid"]
        self.pipeline = placement.pipeline.label
        router.metrics.request_placed(placement, api)
        self.clock = TokenClock(router.metrics, self.pipeline, started)
        # Wall-clock marks (comparable with SGLang's own *_ts time stats on this host) for the
        # stage split of TTFT; the prefill's own stats are logged when its answer comes.
        self.marks = {"router_received_ts": time.time() - (time.perf_counter() - started)}
        self.splicer = StreamSplicer(
            with_relay=placement.relay is not None,
            decode=lambda ids: router.model.decode(ids, job.skip_special_tokens),
            stops=StopStrings.of(job.sampling_params),
            start_detokenizer=router.model.detokenizer(job.skip_special_tokens))
        self.silence = MainSilence(router.relay_loss_main_grace_s)
        self.relay_failure: Optional[BaseException] = None  # once the relay was lost
        self.clean = False
        self.queues, self.tasks, self.copy, self.prefill_task = router.fan_out(self)

    # ---- the splice loop's steps ----------------------------------------------------------
    async def next_item(self):
        """The next item of the stream the client reads now; main's silence after a lost relay
        ends in ``relay_loss.main_never_noticed``."""
        source = self.splicer.phase
        if source not in self.queues:
            raise SpliceError(f"{self.pipeline}: the relay handed off but there is no main")
        silence = self.silence  # a deadline only once the relay is lost: no clock read before
        timeout = (silence.remaining(self.loop.time())
                   if source == "main" and silence.relay_lost_at is not None else None)
        try:
            return await _next_item(self.queues[source], timeout)
        except asyncio.TimeoutError:
            raise await relay_loss.main_never_noticed(self) from None

    def take(self, item) -> Optional[SplicedUpdate]:
        """The client's next update from ``item``, None when it adds nothing; a fault raises."""
        source = self.splicer.phase
        if item is PREFILL_ANSWERED:  # main's copy has landed (prefill answers after it)
            if self.silence.copy_landed_at is None:
                self.silence.copy_landed_at = self.loop.time()
            return None
        if isinstance(item, UpstreamChunk):
            self.silence.main_spoke |= source == "main"
            return self.splicer.chunk(source, item)
        with_main = "main" in self.queues
        if source == "relay" and with_main and _from(item, self.placement.relay):
            return relay_loss.relay_lost(self, item)
        if self.relay_failure is not None and (isinstance(item, StreamEndedEarly) or (
                isinstance(item, UpstreamError) and retryable(item))):
            raise relay_loss.failed_after_the_relay_was_lost(self, source, item)
        if source == "relay" and with_main and self.splicer.emitted \
                and _from(item, self.placement.prefill):
            return self.prefill_failed_behind_the_relay(item)
        raise self.stream_failed(item)

    def sent(self, update: SplicedUpdate) -> SplicedUpdate:
        """Stamp an update on its way to the client; the last one carries the summary."""
        self.clock.tokens_sent(len(update.new_ids), update.first_after_handoff)
        if update.new_ids and "first_token_ts" not in self.marks:
            self.marks["first_token_ts"] = time.time()
        update.meta["id"] = self.rid
        if update.finished:
            finish = self.router.finish
            update.meta["e2e_latency"] = time.perf_counter() - self.clock.started
            update.meta["pdd"] = finish.summary(self.job, self.placement, self.splicer,
                                                self.clock, self.marks)
            finish.record(self.job, self.placement, self.splicer, update)
            self.clean = True
            self.clock.close()
        return update

    def failed(self, err: BaseException) -> None:
        """Count why the attempt ended without a clean answer."""
        errors = self.router.metrics.errors
        if isinstance(err, UpstreamError):
            errors.labels(err.cause).inc()
            self.router.report(err)
        elif isinstance(err, StreamEndedEarly):
            errors.labels("upstream_stream_ended").inc()
        elif isinstance(err, SpliceError):
            errors.labels("splice").inc()
        elif isinstance(err, (asyncio.CancelledError, GeneratorExit)) and not self.clean:
            errors.labels("client_disconnect").inc()

    def close(self) -> None:
        """End what the attempt leaves behind: every server drops an unclean request; when the
        relay answered alone, main's copy goes on to cache the prompt, or goes too."""
        self.clock.close()
        relay_alone = (self.clean and self.splicer.outcome == "relay_finished"
                       and self.placement.main is not None)
        keep_main = relay_alone and self.placement.relay.healthy and not \
            self.router.finish.cancels_wan_copy(self.job, self.placement, self.splicer)
        for role, task in self.tasks.items():
            if not self.clean:
                task.cancel()
            elif not (keep_main and role == "main") and not task.done():
                # Its stream gave the finish (or the handoff): it reads the end and hands the
                # connection back to the pool; cancelled now, it would close it. A server
                # that never ends its stream gets STREAM_END_GRACE_S.
                self.loop.call_later(STREAM_END_GRACE_S, task.cancel)
        if not self.clean:
            self.prefill_task.cancel()
            self.router.abort(self.placement.upstreams, self.rid)
        elif keep_main:
            keep_mains_copy(self)
        elif relay_alone:  # singular traffic: main's copy and the WAN transfer feeding it go
            self.drop_mains_copy()

    # ---- fault paths ----------------------------------------------------------------------
    def prefill_failed_behind_the_relay(self, err: BaseException) -> None:
        """Prefill failed after the relay had its KV (main's WAN copy failed, say). The client
        sees nothing: the relay finishes the answer; main's failure, if any, is its own and is
        ignored until a handoff."""
        logger.warning("%s: prefill failed after the relay started (%s); the relay goes on",
                       self.rid, err)

    @staticmethod
    def stream_failed(failure: BaseException) -> BaseException:
        """A server failed the request, or its stream ended before the answer did. The client
        sees an error, unless ``Dispatcher.serve`` places the request again (before its first
        token, or with --retry-after-first-token)."""
        return failure

    def drop_mains_copy(self) -> None:
        """Main's copy of a request the client has: its stream, and the transfer feeding it."""
        self.tasks["main"].cancel()
        self.prefill_task.cancel()
        self.router.abort([self.placement.main, self.placement.prefill], self.rid)

    def main_waits_for(self) -> Optional[asyncio.Event]:
        """On P->RLD->MD: the landing copy of the turn this one extends, if any."""
        router, placement = self.router, self.placement
        if (placement.pipeline is not policy.Pipeline.PREFILL_RELAY_MAIN
                or placement.main is None or router.main_wait_for_landing_s <= 0):
            return None
        landing = router.landing.predecessor(placement.main.url, self.job.prompt.key)
        return None if landing is None else landing.done
