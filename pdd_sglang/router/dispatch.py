"""One request's life: place it, fan it out to its servers, splice their streams, clean up.

Every server that may hold the request is told to drop it on any exit that is not a clean finish
(client gone, server error, timeout, splice error): SGLang's /abort_request with the rid the router
gave it, on top of closing the HTTP stream (which SGLang also treats as an abort).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid
from typing import AsyncIterator

from pdd_sglang import policy
from pdd_sglang.protocol.route import route_kv_hints
from pdd_sglang.router.landing import LandingCopies
from pdd_sglang.router.metrics import RouterMetrics, TokenClock
from pdd_sglang.router.model import ModelInfo
from pdd_sglang.router.placement import Placement, Placer
from pdd_sglang.router.prefix_mirror import PrefixMirror
from pdd_sglang.router.request_parsing import GenerateJob
from pdd_sglang.router.resume import Resumed, continuation
from pdd_sglang.router.errors import RequestRejected
from pdd_sglang.router.servers import HealthMonitor, NoHealthyServer, ServerPool, Upstream
from pdd_sglang.router.splice import SplicedUpdate, SpliceError, StreamSplicer
from pdd_sglang.router.upstream import UpstreamClient, UpstreamError

logger = logging.getLogger("pdd_sglang.router")

_END = object()


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
                 model: ModelInfo, landing: LandingCopies | None = None,
                 main_wait_for_landing_s: float = 20.0, retry_max_retries: int = 0,
                 retry_after_first_token: bool = False):
        self.pool = pool
        self.landing = landing if landing is not None else placer.landing
        self.main_wait_for_landing_s = main_wait_for_landing_s
        self.retry_max_retries = retry_max_retries
        self.retry_after_first_token = retry_after_first_token
        self.placer = placer
        self.mirrors = mirrors
        self.client = client
        self.health = health
        self.metrics = metrics
        self.model = model
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

    def place(self, job: GenerateJob) -> Placement:
        return self.placer.place(job.prompt_ids, job.max_new_tokens)

    async def serve(self, job: GenerateJob, placement: Placement, api: str,
                    started: float) -> AsyncIterator[SplicedUpdate]:
        """:meth:`run`, again on a fresh placement (new rid, new room) if a server fails it: from
        scratch if the client has none of the answer yet; with ``retry_after_first_token``, as a
        continuation from the last token the client has (:mod:`pdd_sglang.router.resume`)."""
        retries = 0
        attempt_job, resumed, last = job, None, None
        while True:
            attempt = self.run(attempt_job, placement, api, started)
            answered = False
            try:
                async for update in attempt:
                    answered = True
                    last = update if resumed is None else resumed.update(update)
                    yield last
                return
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
                    resumed = Resumed(len(job.prompt_ids), list(last.output_ids), last.text,
                                      lambda ids: self.model.decode(ids, job.skip_special_tokens))
                failure = err
            finally:
                await attempt.aclose()  # the attempt's own cleanup: aborts on every server
            retries += 1
            try:
                placement = self.place(attempt_job)  # without a server the failure took out
            except (NoHealthyServer, RequestRejected):
                raise failure from None  # nowhere to go: the failure is the answer
            cause = (failure.cause if isinstance(failure, UpstreamError)
                     else "splice" if isinstance(failure, SpliceError)
                     else "upstream_stream_ended")
            self.metrics.retries.labels(cause).inc()
            logger.warning("retrying a request %s (%s), retry %d of %d",
                           "from scratch" if resumed is None else
                           f"after its first {len(resumed.sent_ids)} tokens", failure, retries,
                           self.retry_max_retries)

    async def run(self, job: GenerateJob, placement: Placement, api: str,
                  started: float) -> AsyncIterator[SplicedUpdate]:
        """Yield the client's updates; the last one has ``finished`` set."""
        rid = f"pdd-{uuid.uuid4().hex}"
        body = {
            **job.extra,
            "input_ids": job.prompt_ids,
            "sampling_params": job.sampling_params,
            "rid": rid,
            "bootstrap_host": placement.prefill.host,
            "bootstrap_port": placement.prefill.bootstrap_port,
            "bootstrap_room": secrets.randbits(62),
            "kv_hints": route_kv_hints(placement.route_name, **placement.route_fields),
        }
        pipeline = placement.pipeline.label
        self.metrics.requests.labels(pipeline, api).inc()
        clock = TokenClock(self.metrics, pipeline, started)
        # Wall-clock marks (comparable with SGLang's own *_ts time stats on this host) for the
        # stage split of TTFT; the prefill's own stats are logged when its answer comes.
        marks = {"router_received_ts": time.time() - (time.perf_counter() - started)}
        copies: dict = {}  # main's WAN copy (router/line_state.py), shared by the two pumps
        splicer = StreamSplicer(
            with_relay=placement.relay is not None,
            decode=lambda ids: self.model.decode(ids, job.skip_special_tokens))
        queues = {u.role: asyncio.Queue() for u in placement.decoders}
        main_after = self._main_waits_for(job, placement)
        tasks = {u.role: self._spawn(self._pump(u, body, queues[u.role], splicer,
                                                main_after if u is placement.main else None,
                                                placement, job, marks, copies))
                 for u in placement.decoders}
        prefill_task = self._spawn(self._prefill(placement.prefill, body, list(queues.values()),
                                                 marks))
        clean = False
        with self.pool.holding(placement.upstreams):
            try:
                while not splicer.finished:
                    source = splicer.phase
                    if source not in queues:
                        raise SpliceError(f"{pipeline}: the relay handed off but there is no main")
                    item = await queues[source].get()
                    if (source == "relay" and "main" in queues and splicer.emitted
                            and _from(item, placement.prefill)):
                        # Prefill failed after the relay had its KV (e.g. main's WAN copy
                        # failed): the relay finishes the request; main's failure, if any, is
                        # its own and is ignored until a handoff.
                        logger.warning("%s: prefill failed after the relay started (%s); the "
                                       "relay goes on", rid, item)
                        continue
                    if source == "relay" and "main" in queues and (
                            item is _END or _from(item, placement.relay)):
                        # The relay died before any handoff: main decodes from the first
                        # token; the client sees a pause, not an error.
                        logger.warning("%s: relay %s lost (%s); going on with main %s", rid,
                                       placement.relay.url, item if item is not _END
                                       else "stream ended", placement.main.url)
                        self.metrics.errors.labels("relay_lost").inc()
                        if isinstance(item, UpstreamError) and item.cause in (
                                "upstream_connection", "upstream_timeout"):
                            self.health.report_failure(placement.relay)
                        splicer.relay_lost()
                        self._abort([placement.relay], rid)
                        continue
                    if isinstance(item, BaseException):
                        raise item
                    if item is _END:
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
                        update.meta["pdd"] = self._summary(placement, splicer, clock, marks)
                        self._record_finish(job, placement, splicer, update)
                        clean = True
                    yield update
            except UpstreamError as err:
                self.metrics.errors.labels(err.cause).inc()
                if err.cause in ("upstream_connection", "upstream_timeout"):
                    self.health.report_failure(err.upstream)
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
                             and placement.main is not None
                             and not self._cancels_wan_copy(job, placement, splicer))
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
                    else:
                        # Singular traffic: drop main's copy and the WAN transfer feeding it.
                        prefill_task.cancel()
                        self._abort([placement.main, placement.prefill], rid)

    def _cancels_wan_copy(self, job: GenerateJob, placement: Placement,
                          splicer: StreamSplicer) -> bool:
        uncached = max(len(job.prompt_ids) - placement.main_cached_tokens, 0)
        return policy.cancel_wan_copy(uncached, len(splicer.emitted), self.placer.cfg)

    def _abort(self, upstreams: list[Upstream], rid: str) -> None:
        for upstream in upstreams:
            self._spawn(self.client.abort(upstream, rid))

    def _main_waits_for(self, job: GenerateJob, placement: Placement) -> asyncio.Event | None:
        """On P->RLD->MD: the landing copy of the turn this one extends, if any."""
        if (placement.pipeline is not policy.Pipeline.PREFILL_RELAY_MAIN
                or placement.main is None or self.main_wait_for_landing_s <= 0):
            return None
        landing = self.landing.predecessor(placement.main.url, job.prompt_ids)
        return None if landing is None else landing.done

    async def _pump(self, upstream: Upstream, body: dict, queue: asyncio.Queue,
                    splicer: StreamSplicer, after: asyncio.Event | None = None,
                    placement: Placement | None = None, job: GenerateJob | None = None,
                    marks: dict | None = None, copies: dict | None = None) -> None:
        copy = None
        try:
            if after is not None and not after.is_set():
                # The relay streams meanwhile; prefill holds main's KV until main registers.
                try:
                    await asyncio.wait_for(after.wait(), self.main_wait_for_landing_s)
                    self.metrics.main_waits.labels("landed").inc()
                except asyncio.TimeoutError:
                    self.metrics.main_waits.labels("timed_out").inc()
            if upstream.role == "main" and placement is not None and job is not None:
                uncached = max(len(job.prompt_ids) - placement.main_cached_tokens, 0)
                copy = self.placer.lines.begin(upstream.url,
                                               uncached * self.model.kv_bytes_per_token)
                if copies is not None:
                    copies["main"] = copy
            async for chunk in self.client.generate_stream(upstream, body):
                if upstream.role == "main" and splicer.main_cached_tokens is None:
                    splicer.main_cached_tokens = chunk.meta.get("cached_tokens")
                if copy is not None and copy.open:
                    self.placer.lines.land(copy)  # main ran a forward on the landed KV
                if marks is not None and f"{upstream.role}_first_chunk_ts" not in marks:
                    marks[f"{upstream.role}_first_chunk_ts"] = time.time()
                    if upstream.role == "relay" and copies is not None:
                        # Prefill's forward is done: main's copy is on the line from here.
                        self.placer.lines.on_wire(copies.get("main"))
                queue.put_nowait(chunk)
            queue.put_nowait(_END)
        except asyncio.CancelledError:
            raise
        except BaseException as err:  # handed to the splice loop, which owns error handling
            queue.put_nowait(err)
        finally:
            if copy is not None:
                self.placer.lines.drop(copy)  # no-op once landed

    async def _prefill(self, upstream: Upstream, body: dict, queues: list[asyncio.Queue],
                       marks: dict) -> None:
        """The prefill's answer carries nothing for the client; only its failure matters (and
        its time stats, logged for the stage split)."""
        try:
            marks["prefill_sent_ts"] = time.time()
            answer = await self.client.generate_final(upstream, body)
        except asyncio.CancelledError:
            raise
        except BaseException as err:
            for queue in queues:
                queue.put_nowait(err)
            return
        meta = (answer or {}).get("meta_info") or {}
        stats = {k: v for k, v in meta.items() if isinstance(v, (int, float)) and (
            k.endswith(("_ts", "_time", "_latency")) or k == "queue_time")}
        logger.info("pdd-prefill-stats %s", json.dumps({"rid": body["rid"], **stats}))

    def _summary(self, placement: Placement, splicer: StreamSplicer, clock: TokenClock,
                 marks: dict) -> dict:
        """What the router adds to meta_info["pdd"]: its decisions and its measurements."""
        return {
            "pipeline": placement.route_name,
            "outcome": splicer.outcome,
            "prefill": placement.prefill.url,
            "relay": placement.relay.url if placement.relay else None,
            "main": placement.main.url if placement.main else None,
            "predicted_main_cached_tokens": placement.main_cached_tokens,
            "predicted_wan_s": placement.predicted_wan_s,
            "relay_fallback": placement.relay_fallback,
            "main_fallback": placement.main_fallback,
            "handed_tokens": splicer.handed_tokens,
            "relay_lost_at": splicer.relay_lost_at,
            "diverged": splicer.diverged,
            "ttft_s": clock.ttft_s,
            "handoff_gap_s": clock.handoff_gap_s,
            "handoff_mode": (splicer.handoff_info or {}).get("mode"),
            "line_bytes_ahead": placement.line_bytes_ahead,
            "marks": dict(marks),
        }

    def _record_finish(self, job: GenerateJob, placement: Placement, splicer: StreamSplicer,
                       update: SplicedUpdate) -> None:
        outcome = splicer.outcome
        mode = "none"
        if outcome == "handoff":
            mode = str((splicer.handoff_info or {}).get("mode", "unknown"))
        label = "main_only" if outcome == "main" else outcome
        self.metrics.outcomes.labels(label, mode).inc()
        main = placement.main
        if main is None:
            return
        if outcome == "relay_finished":
            if not self._cancels_wan_copy(job, placement, splicer):
                self.mirrors[main.url].insert(list(job.prompt_ids))  # main caches the prompt
            return
        mirror = self.mirrors[main.url]
        actual = splicer.main_cached_tokens
        prompt = job.prompt_ids
        predicted_uncached = len(prompt) - placement.main_cached_tokens
        self.metrics.wan_bytes_predicted.labels(main.url).inc(
            max(predicted_uncached, 0) * self.model.kv_bytes_per_token)
        if isinstance(actual, int):
            self.metrics.wan_bytes.labels(main.url).inc(
                max(len(prompt) - actual, 0) * self.model.kv_bytes_per_token)
            self.metrics.mirror_error_tokens.observe(placement.main_cached_tokens - actual)
            mirror.observe_hit(prompt, actual)
        # Main keeps the prompt and the output's KV, all but the last token (never computed).
        mirror.insert(list(prompt) + update.output_ids[:-1])
