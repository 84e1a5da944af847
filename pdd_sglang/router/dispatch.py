"""One request's life: place it, send it to its servers, splice their streams, clean up; and
place it again when a server fails it (:meth:`Dispatcher.serve`).

:meth:`Dispatcher.run` is the sequence of one attempt's steps; the attempt itself, and every
fault path with what the client sees, is :mod:`pdd_sglang.router.attempt`.

Every server that may hold the request is told to drop it on any exit that is not a clean finish
(client gone, server error, timeout, splice error): SGLang's /abort_request with the rid the router
gave it, on top of closing the HTTP stream (which SGLang also treats as an abort).
"""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator

from pdd_sglang.router.attempt import Attempt, retryable
from pdd_sglang.router.config import RouterConfig
from pdd_sglang.router.errors import RequestRejected
from pdd_sglang.router.finish_record import FinishRecorder
from pdd_sglang.router.landing import CacheOnlyNotices, LandingCopies
from pdd_sglang.router.metrics import RouterMetrics
from pdd_sglang.router.model import ModelInfo
from pdd_sglang.router.placement import Placement, Placer
from pdd_sglang.router.prefix_mirror import PrefixMirror
from pdd_sglang.router.pumps import ItemQueue, Pumps, StreamEndedEarly
from pdd_sglang.router.relay_loss import MAX_RELAY_LOSS_REPLACEMENTS, RelayLost
from pdd_sglang.router.request_parsing import GenerateJob, with_exact_prompt
from pdd_sglang.router.resume import Resumed, continuation
from pdd_sglang.router.shared_state import SharedState
from pdd_sglang.router.servers import RELAY, HealthMonitor, NoHealthyServer, ServerPool, Upstream
from pdd_sglang.router.splice import SplicedUpdate, SpliceError
from pdd_sglang.router.upstream import UpstreamClient, UpstreamError

logger = logging.getLogger("pdd_sglang.router")

__all__ = ["Dispatcher", "StreamEndedEarly"]


class Dispatcher:
    def __init__(self, pool: ServerPool, placer: Placer, mirrors: dict[str, PrefixMirror],
                 client: UpstreamClient, health: HealthMonitor, metrics: RouterMetrics,
                 model: ModelInfo, config: RouterConfig, landing: LandingCopies | None = None,
                 shared: SharedState | None = None):
        self.pool = pool
        self.relay_loss_main_grace_s = config.relay_loss_main_grace_s
        self.landing = landing if landing is not None else placer.landing
        self.cache_only_notices = CacheOnlyNotices(client, self.spawn)
        # Every change to the mirrors, the landing copies and the line goes through it.
        self.shared = shared or SharedState(mirrors, self.landing, placer.lines)
        health.on_removed.append(self._server_left)  # a relay gone: drop the copies kept for it
        self.main_wait_for_landing_s = config.main_wait_for_landing_s
        self.retry_max_retries = config.retry_max_retries
        self.retry_after_first_token = config.retry_after_first_token
        self.placer = placer
        self.mirrors = mirrors
        self.client = client
        self.health = health
        self.metrics = metrics
        self.model = model
        self.pumps = Pumps(client, metrics, self.shared, model.kv_bytes_per_token,
                           config.main_wait_for_landing_s, config.log_prefill_stats)
        self.finish = FinishRecorder(metrics, self.shared, model.kv_bytes_per_token, placer.cfg,
                                     model.estimate)
        self._background: set[asyncio.Task] = set()
        self._loop: asyncio.AbstractEventLoop | None = None  # the first spawn's

    def spawn(self, coro) -> asyncio.Task:
        """A task nobody awaits (aborts, a prefill's trailing answer), kept alive until done."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        task = self._loop.create_task(coro)  # asyncio.create_task looks the loop up each time
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def drain(self) -> None:
        if self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    def place(self, job: GenerateJob, avoid: frozenset = frozenset()) -> Placement:
        return self.placer.place(job.prompt, job.max_new_tokens, avoid, job.ttft_slo_s)

    async def serve(self, job: GenerateJob, placement: Placement, api: str,
                    started: float) -> AsyncIterator[SplicedUpdate]:
        """:meth:`run`, again on a fresh placement (new rid, new room) if a server fails it: from
        scratch if the client has none of the answer yet; with ``retry_after_first_token``, as a
        continuation from the last token the client has (:mod:`pdd_sglang.router.resume`).
        A lost relay is no failure: the request goes on without it (:mod:`relay_loss`), whatever
        the retry settings say."""
        retry = _Retries(job)
        attempt_job = job
        while True:
            attempt = self.run(attempt_job, placement, api, started)
            try:
                async for update in attempt:
                    yield retry.client_view(update)
                return
            except RelayLost as lost:
                attempt_job = await retry.after_relay_lost(lost, self)
            except (UpstreamError, StreamEndedEarly, SpliceError) as err:
                attempt_job = await retry.after_failure(err, self)
            finally:
                await attempt.aclose()  # the attempt's own cleanup: aborts on every server
            try:
                # Without a server the failure took out, nor a relay that failed this request.
                placement = self.place(attempt_job, frozenset(retry.avoid))
            except (NoHealthyServer, RequestRejected):
                raise retry.failure from None  # nowhere to go: the failure is the answer
            self.metrics.retries.labels(retry.cause).inc()
            logger.warning("re-placing a request %s (%s) on %s, retry %d of %d, relay losses %d",
                           retry.progress, retry.failure, placement.route_name, retry.retries,
                           self.retry_max_retries, retry.relay_losses)

    async def run(self, job: GenerateJob, placement: Placement, api: str,
                  started: float) -> AsyncIterator[SplicedUpdate]:
        """One attempt, step by step (:mod:`pdd_sglang.router.attempt`): send the request to its
        servers, then until the splicer has the whole answer, take the next item of the stream
        the client reads and yield the update it makes (a fault path raises); then close."""
        attempt = Attempt(self, job, placement, api, started)
        with self.pool.holding(placement.upstreams):
            try:
                while not attempt.splicer.finished:
                    update = attempt.take(await attempt.next_item())
                    if update is not None:
                        yield attempt.sent(update)
            except BaseException as err:
                attempt.failed(err)
                raise
            finally:
                attempt.close()

    def fan_out(self, attempt: Attempt) -> tuple[dict, dict, dict, asyncio.Task]:
        """Send ``attempt``'s body to its decoders (each stream into its queue) and its prefill;
        the queues and tasks by role, main's WAN copy (filled by its pump), the prefill's task."""
        placement = attempt.placement
        queues = {u.role: ItemQueue(attempt.loop) for u in placement.decoders}
        main_after = attempt.main_waits_for()
        copy: dict = {}  # main's WAN copy (router/line_state.py), shared by the two pumps
        tasks = {u.role: self.spawn(self.pumps.decoder(
                     u, attempt.body, queues[u.role], attempt.splicer,
                     main_after if u is placement.main else None, placement, attempt.job,
                     attempt.marks, copy))
                 for u in placement.decoders}
        prefill_task = self.spawn(self.pumps.prefill(placement.prefill, attempt.body,
                                                     list(queues.values()), attempt.marks))
        return queues, tasks, copy, prefill_task

    def abort(self, upstreams: list[Upstream], rid: str) -> None:
        for upstream in upstreams:
            self.spawn(self.client.abort(upstream, rid))

    def report(self, err: BaseException) -> None:
        """Tell the health monitor what a request learnt about a server."""
        if not isinstance(err, UpstreamError):
            if isinstance(err, StreamEndedEarly) and err.upstream.role == RELAY:
                self.health.probe(err.upstream)
            return
        if err.refused:
            self.health.report_unreachable(err.upstream)
        elif err.cause in ("upstream_connection", "upstream_timeout"):
            self.health.report_failure(err.upstream)
            if err.upstream.role == RELAY:
                self.health.probe(err.upstream)  # dead or not: ask it now, not at its next poll

    def resumed(self, job: GenerateJob, last: SplicedUpdate) -> Resumed:
        # The text held back from the client goes on before the continuation's: the client has
        # every token of it, and the continuation's server sees no stop string across them.
        return Resumed(job.prompt.tokens, list(last.output_ids), last.text + last.held_text,
                       lambda ids: self.model.decode(ids, job.skip_special_tokens))

    def _server_left(self, upstream: Upstream) -> None:
        if upstream.role == RELAY:
            dropped = self.landing.drop_for(upstream)
            if dropped:
                logger.warning("relay %s left rotation: dropped %d main copies kept only to "
                               "cache prompts it answered", upstream.url, len(dropped))


class _Retries:
    """What :meth:`Dispatcher.serve` knows across one request's attempts: the client's view of
    the answer so far, and whether another attempt is allowed."""

    def __init__(self, job: GenerateJob):
        self.job = job
        self.retries = self.relay_losses = 0
        self.avoid: set = set()  # relays that failed this request
        self.resumed: Resumed | None = None
        self.last: SplicedUpdate | None = None
        self.answered = False  # the current attempt yielded
        self.failure: BaseException | None = None
        self.cause = ""

    @property
    def progress(self) -> str:
        return ("from scratch" if self.resumed is None
                else f"after its first {len(self.resumed.sent_ids)} tokens")

    def client_view(self, update: SplicedUpdate) -> SplicedUpdate:
        self.answered = True
        self.last = update if self.resumed is None else self.resumed.update(update)
        if self.last.finished and self.relay_losses:
            # Main answered after the relay was lost: a relay_lost outcome, whatever pipeline
            # the last attempt took.
            self.last.meta.setdefault("pdd", {}).update(
                outcome="relay_lost", relay_lost_replacements=self.relay_losses)
        return self.last

    async def after_relay_lost(self, lost: RelayLost, router: Dispatcher) -> GenerateJob:
        """The next attempt after a lost relay, from the client's last token, or the failure."""
        self.relay_losses += 1
        self.avoid.add(lost.relay)
        self.failure, self.cause = lost.cause, "relay_lost"
        if self.relay_losses > MAX_RELAY_LOSS_REPLACEMENTS:
            raise lost.cause from None
        return await self._from_the_clients_last_token(router, lost.cause)

    async def after_failure(self, err: BaseException, router: Dispatcher) -> GenerateJob:
        """The next attempt after a server failed one, or ``err`` again when none is allowed.
        Two servers that disagree on a position leave no right answer to re-send but the
        client's own: it goes on from there, whatever --retry-after-first-token says."""
        if self.retries >= router.retry_max_retries or not retryable(err):
            raise err
        if (self.answered or self.resumed is not None) and not (
                router.retry_after_first_token or isinstance(err, SpliceError)):
            raise err
        self.retries += 1
        self.failure = err
        self.cause = (err.cause if isinstance(err, UpstreamError) else "splice"
                      if isinstance(err, SpliceError) else "upstream_stream_ended")
        return await self._from_the_clients_last_token(router, err)

    async def _from_the_clients_last_token(self, router: Dispatcher,
                                           failure: BaseException) -> GenerateJob:
        self.answered = False
        if self.last is None:
            return self.job
        self.job = await with_exact_prompt(self.job, router.model)
        following = continuation(self.job, self.last.output_ids)
        if following is None:  # nothing left to produce
            raise failure from None
        self.resumed = router.resumed(self.job, self.last)
        return following
