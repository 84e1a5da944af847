"""One request's life: place it, fan it out to its servers, splice their streams, clean up.

Every server that may hold the request is told to drop it on any exit that is not a clean finish
(client gone, server error, timeout, splice error): SGLang's /abort_request with the rid the router
gave it, on top of closing the HTTP stream (which SGLang also treats as an abort).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from typing import AsyncIterator

from pdd_sglang import policy
from pdd_sglang.protocol.route import route_kv_hints
from pdd_sglang.router.config import RouterConfig
from pdd_sglang.router.landing import LandingCopies
from pdd_sglang.router.metrics import RouterMetrics, TokenClock
from pdd_sglang.router.model import ModelInfo
from pdd_sglang.router.placement import Placement, Placer
from pdd_sglang.router.prefix_mirror import PrefixMirror
from pdd_sglang.router.request_parsing import GenerateJob
from pdd_sglang.router.resume import Resumed, continuation
from pdd_sglang.router.errors import RequestRejected
from pdd_sglang.router.finish_record import FinishRecorder
from pdd_sglang.router.pumps import END, PREFILL_ANSWERED, Pumps
from pdd_sglang.router.relay_loss import (MAX_RELAY_LOSS_REPLACEMENTS, CachingCopies,
                                          MainSilence, RelayLost)
from pdd_sglang.router.servers import RELAY, HealthMonitor, NoHealthyServer, ServerPool, Upstream
from pdd_sglang.router.splice import SplicedUpdate, SpliceError, StreamSplicer, UpstreamChunk
from pdd_sglang.router.stop_strings import StopStrings
from pdd_sglang.router.upstream import UpstreamClient, UpstreamError

logger = logging.getLogger("pdd_sglang.router")


def _never_reached(err: BaseException) -> bool:
    """The connection itself was refused: the server never saw the request."""
    return isinstance(err, UpstreamError) and err.refused


async def _next_item(queue: asyncio.Queue, timeout_s: float | None):
    """The queue's next item; asyncio.TimeoutError after ``timeout_s`` without one."""
    if timeout_s is None:
        return await queue.get()
    try:
        return queue.get_nowait()  # what is there already counts, however short the timeout
    except asyncio.QueueEmpty:
        return await asyncio.wait_for(queue.get(), timeout_s)


def _from(item, upstream: Upstream) -> bool:
    """Whether ``item`` is an error that ``upstream`` caused."""
    return isinstance(item, UpstreamError) and item.upstream is upstream


def _retryable(err: BaseException) -> bool:
    """A server's failure, not the request's: a 4xx is the request's fault and stays an error."""
    status = getattr(err, "status", None)
    return not (isinstance(status, int) and 400 <= status < 500)


class StreamEndedEarly(RuntimeError):
    def __init__(self, upstream: Upstream):
        super().__init__(f"{upstream.role} {upstream.url} closed its stream before finishing")
        self.upstream = upstream


class Dispatcher:
    def __init__(self, pool: ServerPool, placer: Placer, mirrors: dict[str, PrefixMirror],
                 client: UpstreamClient, health: HealthMonitor, metrics: RouterMetrics,
                 model: ModelInfo, config: RouterConfig, landing: LandingCopies | None = None):
        self.pool = pool
        self.relay_loss_main_grace_s = config.relay_loss_main_grace_s
        self.caching = CachingCopies()  # main copies kept only to cache a prompt, by relay
        health.on_removed.append(self._server_left)  # a relay gone: drop the copies kept for it
        self.landing = landing if landing is not None else placer.landing
        self.main_wait_for_landing_s = config.main_wait_for_landing_s
        self.retry_max_retries = config.retry_max_retries
        self.retry_after_first_token = config.retry_after_first_token
        self.placer = placer
        self.mirrors = mirrors
        self.client = client
        self.health = health
        self.metrics = metrics
        self.model = model
        self.pumps = Pumps(client, metrics, placer.lines, model.kv_bytes_per_token,
                           config.main_wait_for_landing_s)
        self.finish = FinishRecorder(metrics, mirrors, model.kv_bytes_per_token, placer.cfg)
        self._background: set[asyncio.Task] = set()

    def _spawn(self, coro) -> asyncio.Task:
        """A task nobody awaits (aborts, a prefill's trailing answer), kept alive until done."""
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def drain(self) -> None:
        if self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    def place(self, job: GenerateJob, avoid: frozenset = frozenset()) -> Placement:
        return self.placer.place(job.prompt_ids, job.max_new_tokens, avoid, job.ttft_slo_s)

    async def serve(self, job: GenerateJob, placement: Placement, api: str,
                    started: float) -> AsyncIterator[SplicedUpdate]:
        """:meth:`run`, again on a fresh placement (new rid, new room) if a server fails it: from
        scratch if the client has none of the answer yet; with ``retry_after_first_token``, as a
        continuation from the last token the client has (:mod:`pdd_sglang.router.resume`).
        A lost relay is no failure: the request goes on without it (:mod:`relay_loss`), whatever
        the retry settings say."""
        retries = relay_losses = 0
        attempt_job, resumed, last = job, None, None
        avoid: set = set()  # relays that failed this request
        while True:
            attempt = self.run(attempt_job, placement, api, started)
            answered = False
            try:
                async for update in attempt:
                    answered = True
                    last = update if resumed is None else resumed.update(update)
                    if last.finished and relay_losses:
                        # Main answered after the relay was lost: a relay_lost outcome, whatever
                        # pipeline the last attempt took.
                        last.meta.setdefault("pdd", {}).update(outcome="relay_lost",
                                                               relay_lost_replacements=relay_losses)
                    yield last
                return
            except RelayLost as lost:
                relay_losses += 1
                avoid.add(lost.relay)
                failure = lost.cause
                if relay_losses > MAX_RELAY_LOSS_REPLACEMENTS:
                    raise failure from None
                if last is not None:
                    following = continuation(job, last.output_ids)
                    if following is None:
                        raise failure from None
                    attempt_job = following
                    resumed = self._resumed(job, last)
                cause = "relay_lost"
            except (UpstreamError, StreamEndedEarly, SpliceError) as err:
                if retries >= self.retry_max_retries or not _retryable(err):
                    raise
                if answered or resumed is not None:
                    following = continuation(job, last.output_ids)
                    # Two servers that disagree on a position leave no right answer to re-send
                    # but the client's own: it goes on from there, whatever
                    # --retry-after-first-token says (failing is the only other answer).
                    if following is None or not (self.retry_after_first_token
                                                 or isinstance(err, SpliceError)):
                        raise
                    attempt_job = following
                    resumed = self._resumed(job, last)
                failure = err
                retries += 1
                cause = (err.cause if isinstance(err, UpstreamError)
                         else "splice" if isinstance(err, SpliceError)
                         else "upstream_stream_ended")
            finally:
                await attempt.aclose()  # the attempt's own cleanup: aborts on every server
            try:
                # Without a server the failure took out, nor a relay that failed this request.
                placement = self.place(attempt_job, frozenset(avoid))
            except (NoHealthyServer, RequestRejected):
                raise failure from None  # nowhere to go: the failure is the answer
            self.metrics.retries.labels(cause).inc()
            logger.warning("re-placing a request %s (%s) on %s, retry %d of %d, relay losses %d",
                           "from scratch" if resumed is None else
                           f"after its first {len(resumed.sent_ids)} tokens", failure,
                           placement.route_name, retries, self.retry_max_retries, relay_losses)

    def _resumed(self, job: GenerateJob, last: SplicedUpdate) -> Resumed:
        # The text held back from the client goes on before the continuation's: the client has
        # every token of it, and the continuation's server sees no stop string across them.
        return Resumed(len(job.prompt_ids), list(last.output_ids), last.text + last.held_text,
                       lambda ids: self.model.decode(ids, job.skip_special_tokens))

    async def run(self, job: GenerateJob, placement: Placement, api: str,
                  started: float) -> AsyncIterator[SplicedUpdate]:
        """Yield the client's updates; the last one has ``finished`` set."""
        rid = f"pdd-{uuid.uuid4().hex}"
        body = {
            **job.extra,
            "input_ids": job.prompt_ids,
            "sampling_params": job.sampling_params,
            "rid": rid,
            "bootstrap_host": placement.prefill.bootstrap_host,
            "bootstrap_port": placement.prefill.bootstrap_port,
            "bootstrap_room": secrets.randbits(62),
            "kv_hints": route_kv_hints(placement.route_name, **placement.route_fields),
        }
        pipeline = placement.pipeline.label
        self.metrics.requests.labels(pipeline, api).inc()
        self.metrics.ttft_budget.labels(placement.ttft_budget).inc()
        self.metrics.placed(placement)
        clock = TokenClock(self.metrics, pipeline, started)
        # Wall-clock marks (comparable with SGLang's own *_ts time stats on this host) for the
        # stage split of TTFT; the prefill's own stats are logged when its answer comes.
        marks = {"router_received_ts": time.time() - (time.perf_counter() - started)}
        copies: dict = {}  # main's WAN copy (router/line_state.py), shared by the two pumps
        splicer = StreamSplicer(
            with_relay=placement.relay is not None,
            decode=lambda ids: self.model.decode(ids, job.skip_special_tokens),
            stops=StopStrings.of(job.sampling_params))
        queues = {u.role: asyncio.Queue() for u in placement.decoders}
        main_after = self._main_waits_for(job, placement)
        tasks = {u.role: self._spawn(self.pumps.decoder(
                     u, body, queues[u.role], splicer, main_after if u is placement.main else None,
                     placement, job, marks, copies))
                 for u in placement.decoders}
        prefill_task = self._spawn(self.pumps.prefill(placement.prefill, body,
                                                      list(queues.values()), marks))
        clean = False
        silence = MainSilence(self.relay_loss_main_grace_s)
        relay_failure = None  # the relay's failure, once it was lost
        clock_now = asyncio.get_running_loop().time
        with self.pool.holding(placement.upstreams):
            try:
                while not splicer.finished:
                    source = splicer.phase
                    if source not in queues:
                        raise SpliceError(f"{pipeline}: the relay handed off but there is no main")
                    try:
                        item = await _next_item(queues[source], silence.remaining(clock_now())
                                                if source == "main" else None)
                    except asyncio.TimeoutError:
                        raise await self._main_never_noticed(
                            placement, rid, splicer, relay_failure, job.prompt_ids) from None
                    if item is PREFILL_ANSWERED:
                        if silence.copy_landed_at is None:
                            silence.copy_landed_at = clock_now()
                        continue
                    if source == "main" and isinstance(item, UpstreamChunk):
                        silence.main_spoke = True
                    if (source == "relay" and "main" in queues and splicer.emitted
                            and _from(item, placement.prefill)):
                        # Prefill failed after the relay had its KV (e.g. main's WAN copy
                        # failed): the relay finishes the request; main's failure, if any, is
                        # its own and is ignored until a handoff.
                        logger.warning("%s: prefill failed after the relay started (%s); the "
                                       "relay goes on", rid, item)
                        continue
                    if source == "relay" and "main" in queues and (
                            item is END or _from(item, placement.relay)):
                        relay_failure = (StreamEndedEarly(placement.relay) if item is END
                                         else item)
                        self.metrics.errors.labels("relay_lost").inc()
                        self._report(relay_failure)
                        if _never_reached(relay_failure) and not splicer.emitted:
                            # The relay never had the request, so it never registered: a fresh
                            # placement without it beats prefill waiting for its registration.
                            raise RelayLost(placement.relay, relay_failure, 0,
                                            "refused before its first token")
                        # The relay had the request and died before any handoff: main, whose
                        # copy is already on the line (relay_loss.py, step 2), decodes from the
                        # first token; the client sees a pause, not an error.
                        logger.warning("%s: relay %s lost (%s); going on with main %s", rid,
                                       placement.relay.url, relay_failure, placement.main.url)
                        splicer.relay_lost()
                        silence.relay_lost_at = clock_now()
                        self._abort([placement.relay], rid)
                        continue
                    if relay_failure is not None and (item is END or (
                            isinstance(item, UpstreamError) and _retryable(item))):
                        # Main or prefill failed the request after its relay was lost (prefill
                        # fails a whole room when one of its copies fails): the relay's loss
                        # is the cause, and the request goes on without it.
                        if isinstance(item, UpstreamError):
                            self._report(item)
                        raise RelayLost(placement.relay, relay_failure, len(splicer.emitted),
                                        f"{source} failed after it: "
                                        f"{item if item is not END else 'stream ended'}")
                    if isinstance(item, BaseException):
                        raise item
                    if item is END:
                        raise StreamEndedEarly(placement.relay if source == "relay"
                                               else placement.main)
                    update = (splicer.relay_chunk(item) if source == "relay"
                              else splicer.main_chunk(item))
                    if update is None:
                        continue
                    clock.tokens_sent(len(update.new_ids), update.first_after_handoff)
                    if update.new_ids and "first_token_ts" not in marks:
                        marks["first_token_ts"] = time.time()
                    update.meta["id"] = rid
                    if update.finished:
                        update.meta["e2e_latency"] = time.perf_counter() - started
                        update.meta["pdd"] = self.finish.summary(placement, splicer, clock, marks)
                        self.finish.record(job, placement, splicer, update)
                        clean = True
                    yield update
            except UpstreamError as err:
                self.metrics.errors.labels(err.cause).inc()
                self._report(err)
                raise
            except StreamEndedEarly:
                self.metrics.errors.labels("upstream_stream_ended").inc()
                raise
            except SpliceError:
                self.metrics.errors.labels("splice").inc()
                raise
            except (asyncio.CancelledError, GeneratorExit):
                if not clean:
                    self.metrics.errors.labels("client_disconnect").inc()
                raise
            finally:
                keep_main = (clean and splicer.outcome == "relay_finished"
                             and placement.main is not None and placement.relay.healthy
                             and not self.finish.cancels_wan_copy(job, placement, splicer))
                for role, task in tasks.items():
                    if not (keep_main and role == "main"):
                        task.cancel()
                if not clean:
                    prefill_task.cancel()
                    self._abort(placement.upstreams, rid)
                elif splicer.outcome == "relay_finished" and placement.main is not None:
                    if keep_main:
                        # The relay answered alone, but main's WAN copy completes and main
                        # caches the prompt (the relay refuses main's handoff, main frees the
                        # request): the conversation's next turn still hits at main, and waits
                        # for this copy to land rather than pull the same pages again.
                        self.metrics.outcomes.labels("relay_finished_main_cached", "none").inc()
                        landing = self.landing.add(placement.main.url, job.prompt_ids,
                                                   placement.main_cached_tokens)
                        tasks["main"].add_done_callback(
                            lambda _, url=placement.main.url, landing=landing:
                            self.landing.landed(url, landing))
                        self.caching.keep(placement.relay, rid, tasks["main"],
                                          lambda tasks=(tasks["main"], prefill_task):
                                          self._drop_copy(tasks, placement, rid))
                    else:
                        # Singular traffic: drop main's copy and the WAN transfer feeding it.
                        prefill_task.cancel()
                        self._abort([placement.main, placement.prefill], rid)

    def _abort(self, upstreams: list[Upstream], rid: str) -> None:
        for upstream in upstreams:
            self._spawn(self.client.abort(upstream, rid))

    def _drop_copy(self, tasks: tuple, placement: Placement, rid: str) -> None:
        """Main's copy of a request the client has: its stream, and the transfer feeding it."""
        for task in tasks:  # main's stream and prefill's answer
            task.cancel()
        self._abort([placement.main, placement.prefill], rid)

    def _report(self, err: BaseException) -> None:
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

    def _server_left(self, upstream: Upstream) -> None:
        if upstream.role == RELAY:
            dropped = self.caching.drop_for(upstream)
            if dropped:
                logger.warning("relay %s left rotation: dropped %d main copies kept only to "
                               "cache prompts it answered", upstream.url, len(dropped))

    async def _main_never_noticed(self, placement: Placement, rid: str, splicer: StreamSplicer,
                                  relay_failure: BaseException, job_prompt: list) -> RelayLost:
        logger.warning("%s: main %s silent %.1f s after its copy landed and relay %s was lost; "
                       "going on from token %d on a fresh placement", rid, placement.main.url,
                       self.relay_loss_main_grace_s, placement.relay.url, len(splicer.emitted))
        # Abort main's copy before the continuation reaches main: main then has the prompt in
        # its radix cache (an aborted held request keeps its landed KV there), and only the
        # emitted tokens' KV crosses the line.
        await self.client.abort(placement.main, rid)
        self.mirrors[placement.main.url].insert(list(job_prompt))
        return RelayLost(placement.relay, relay_failure, len(splicer.emitted),
                         "main never noticed")

    def _main_waits_for(self, job: GenerateJob, placement: Placement) -> asyncio.Event | None:
        """On P->RLD->MD: the landing copy of the turn this one extends, if any."""
        if (placement.pipeline is not policy.Pipeline.PREFILL_RELAY_MAIN
                or placement.main is None or self.main_wait_for_landing_s <= 0):
            return None
        landing = self.landing.predecessor(placement.main.url, job.prompt_ids)
        return None if landing is None else landing.done
