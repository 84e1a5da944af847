"""The cluster: builds the servers and links of a setup and moves each request through it.

Setups and their knobs: config.py (Setup, ClusterConfig; re-exported here).
"""

from __future__ import annotations

import math
from dataclasses import replace

from .. import policy
from ..policy import Pipeline
from .cache import BlockPrefixCache
from .config import PLACEMENTS, SETUP_LABELS, ClusterConfig, Setup  # noqa: F401 (re-exported)
from .engine import Callback, Event, Simulator
from .handoff import HandoffProtocol
from .link import FairShareLink, make_link
from .wan_lines import ClassedLink
from ..prefill.wan_engine import background_window, window_for_line
from ..policy.wan_codec import RAW, CodecCost, choose_wan_codec, coded_copy_seconds
from .profiles import InstanceCost, load_codec, load_hardware, load_link, load_model
from .records import Job, summarise
from .servers import ITL_BIN_S, DecodeServer, Host, PrefillServer


class Arrival(Event):
    __slots__ = ("cluster", "job")

    def __init__(self, cluster, job):
        self.cluster = cluster
        self.job = job

    def fire(self, sim):
        self.cluster._on_arrival(self.job)


class Sample(Event):
    """Periodic snapshot of relay and main queues for the time-series figures."""

    __slots__ = ("cluster",)

    def __init__(self, cluster):
        self.cluster = cluster

    def fire(self, sim):
        self.cluster._sample()


class Cluster:
    def __init__(self, cfg: ClusterConfig):
        self.cfg = cfg
        self.sim = Simulator(cfg.seed)
        self.model = load_model(cfg.model)
        self.kv_bytes_per_token = self.model.kv_bytes_per_token
        wan_profile = load_link(cfg.wan_link)
        if cfg.wan_bandwidth_scale != 1.0:
            wan_profile = wan_profile.scaled(cfg.wan_bandwidth_scale)
        if cfg.wan_window_bytes is not None:
            wan_profile = wan_profile.with_window(cfg.wan_window_bytes)
        if cfg.wan_transfer_fixed_s is not None:
            wan_profile = replace(wan_profile, per_transfer_fixed_s=cfg.wan_transfer_fixed_s)
        self.wan = self._make_wan(wan_profile)
        self.wan_codec = load_codec(cfg.wan_codec).cost if cfg.wan_codec else None
        rdma_profile = load_link(cfg.rdma_link)
        prefill_hardware = load_hardware(cfg.prefill_hardware)
        if cfg.prefill_mfu is not None:
            prefill_hardware = replace(prefill_hardware, prefill_mfu=cfg.prefill_mfu)
        prefill_cost = InstanceCost(prefill_hardware, self.model)
        self.dispatch_latency_s = (prefill_hardware.dispatch_latency_s
                                   if cfg.dispatch_latency_s is None else cfg.dispatch_latency_s)
        self.prefills = [PrefillServer(self.sim, i, prefill_cost,
                                       BlockPrefixCache(cfg.prefill_cache_tokens,
                                                        cfg.block_tokens),
                                       self._on_prefill_done)
                         for i in range(cfg.prefill_instances)]
        # One RDMA NIC per prefill GPU: a request's KV leaves through its lane's NIC.
        self.rdma = [[make_link(self.sim, rdma_profile, f"rdma{i}.{lane}")
                      for lane in range(prefill_cost.prefill_lanes)]
                     for i in range(cfg.prefill_instances)]
        main_cost = InstanceCost(load_hardware(cfg.decode_hardware), self.model)
        behind_wan = cfg.setup.behind_wan
        main_cache = cfg.drc
        self.mains = [DecodeServer(self.sim, "main", i, main_cost, cfg.main_max_running,
                                   BlockPrefixCache(cfg.main_cache_tokens, cfg.block_tokens)
                                   if main_cache else None)
                      for i in range(cfg.main_instances)]
        for main in self.mains:
            main.delivery_delay_s = self.wan.one_way_s if behind_wan else 0.0
        self.relays = []
        if cfg.setup.has_relay:
            relay_cost = InstanceCost(load_hardware(cfg.relay_hardware), self.model)
            self.relays = [DecodeServer(self.sim, "relay", i, relay_cost, cfg.relay_max_running,
                                        None) for i in range(cfg.relay_instances)]
        if cfg.shared_host:
            host = Host()
            for server in self.prefills + self.mains + self.relays:
                server.host = host
        self.handoff = HandoffProtocol(self)
        self.jobs: list = []
        self._next_turn: dict = {}
        self.timeline: list = []
        self.relay_busy_request_s = 0.0
        self.unfinished = 0
        self.last_arrival_s = 0.0
        # The router's view for TTFT-budget placement (router/placement.py): requests it holds
        # at each prefill and on the relay (a request holds its servers until its answer is
        # complete: router/dispatch.py), and its running mean uncached prompt.
        self._at_prefill = [0] * len(self.prefills)
        self._on_relay: set = set()
        self._mean_uncached = 0.0
        # The router's landing copies (router/landing.py): jobs the relay answered alone whose
        # copy to main goes on, until it lands or is dropped; and the turns waiting for one.
        self._landing: list = []
        self._landing_waiters: dict = {}  # id(landing job) -> [start main's leg, ...]

    def _make_wan(self, profile) -> FairShareLink | ClassedLink:
        """The WAN as its profile shares it, or issue 34's classed line, whose slice the
        prefill sizes from the line it is told (window_for_line), as the demo's router is."""
        cfg = self.cfg
        if cfg.wan_line != "classed":
            return make_link(self.sim, profile, "wan")
        rate = cfg.router_wan_bytes_per_s or min(profile.bytes_per_s,
                                                 profile.per_flow_bytes_per_s)
        rtt = cfg.router_wan_rtt_s or profile.rtt_s
        sender = window_for_line(rate * 8 / 1e9, rtt * 1e3)
        slice_bytes = cfg.wan_slice_bytes or sender.slice_bytes
        background = None
        if cfg.wan_background_in_flight_s is not None:
            window = background_window(sender, rate, cfg.wan_background_in_flight_s)
            background = (window.slice_bytes, window.window_bytes)
        return ClassedLink(self.sim, profile, slice_bytes, cfg.wan_cache_only_backlog_s,
                           background_window=background,
                           in_flight_bytes=None if cfg.wan_slice_bytes else sender.window_bytes)

    # --- running -------------------------------------------------------------------------
    def run(self, requests, warmup=(), traced_ids=(), progress=None, follows=None):
        """follows: {request_id: (earlier request_id, gap_s)}: a closed-loop client's next turn,
        sent gap_s after the earlier request's last token reaches the client (its arrival_s is
        then ignored)."""
        self._warm_caches(warmup)
        traced = set(traced_ids)
        follows = follows or {}
        by_id = {}
        for request in requests:
            job = Job(request)
            self.jobs.append(job)
            by_id[request.request_id] = job
            if request.request_id in traced:
                for server in self.mains + self.relays:
                    server.traced.add(job)
            if request.request_id not in follows:
                self.sim.at(request.arrival_s, Arrival(self, job))
            self.last_arrival_s = max(self.last_arrival_s, request.arrival_s)
        self._next_turn = {by_id[earlier].request.request_id: (by_id[later], gap)
                           for later, (earlier, gap) in follows.items()}
        self.unfinished = len(self.jobs)
        self.sim.schedule(0.0, Sample(self))
        self.sim.run(until_s=self.last_arrival_s + self.cfg.drain_limit_s, progress=progress)
        return summarise(self.cfg.setup.value, self.jobs, self._itl_histogram(), ITL_BIN_S,
                         self.wan.bytes_received, self.kv_bytes_per_token,
                         self.relay_busy_request_s, self.timeline)

    def _warm_caches(self, warmup) -> None:
        """Pre-load the caches with the earlier turns of sessions running at time zero, on the
        servers their later turns will pick (the one already holding the session)."""
        for request in warmup:
            session = max(request.conversation_id, 0)
            self.prefills[session % len(self.prefills)].cache.insert(request.prompt_blocks)
            main = self.mains[session % len(self.mains)]
            if main.cache is not None:
                main.cache.insert(request.context_blocks)

    def _itl_histogram(self) -> dict:
        merged: dict = {}
        for server in self.mains + self.relays:
            for key, count in server.itl_histogram.items():
                merged[key] = merged.get(key, 0) + count
        return merged

    def _sample(self) -> None:
        relay_queue = sum(len(r.admission) for r in self.relays)
        relay_running = sum(len(r.reserved) for r in self.relays)
        relay_util = max((r.load().utilisation for r in self.relays), default=0.0)
        main_running = sum(len(m.reserved) for m in self.mains)
        self.timeline.append((self.sim.now, relay_queue, relay_running, relay_util,
                              main_running, sum(len(p.queue) for p in self.prefills)))
        if self.unfinished > 0 or self.sim.now < self.last_arrival_s:
            self.sim.schedule(self.cfg.sample_interval_s, Sample(self))

    # --- request lifecycle ---------------------------------------------------------------
    def _on_arrival(self, job: Job) -> None:
        job.router_to_prefill_s = self.cfg.router_to_prefill_s
        if self.cfg.setup.has_relay and self.cfg.policy.ttft_slo_s is not None:
            self._place_by_budget(job)      # the router places before it posts to prefill
        latency = self.dispatch_latency_s
        if self._placed_through_relay(job) and self.cfg.relay_dispatch_latency_s is not None:
            latency = self.cfg.relay_dispatch_latency_s
        if latency > 0:
            self.schedule(latency, self._dispatch, job)
        else:
            self._dispatch(job)

    @staticmethod
    def _placed_through_relay(job: Job) -> bool:
        """The router placed it through the relay before posting it (a budget placement), so
        prefill waits for the relay's registration only, not main's across the line."""
        return job.budget_pipeline is not None and job.budget_pipeline is not Pipeline.PREFILL_MAIN

    def _dispatch(self, job: Job) -> None:
        if self.cfg.register_at_step_boundary and not job.registered:
            # SGLang's PD bootstrap: the decode side(s) take the request and reserve its KV in
            # their scheduler loop, between forwards; prefill starts it once they have.
            job.registered = True
            sides = [] if self._placed_through_relay(job) else [self._pick_main(job)]
            sides += self.relays[:1] if self.cfg.setup.has_relay else []
            wait = max(side.until_step_boundary() for side in sides)
            if wait > 0:
                self.schedule(wait, self._dispatch, job)
                return
        job.dispatched_s = self.sim.now
        candidates = [p.candidate(job.request) for p in self.prefills]
        index = policy.choose_main(candidates, self.cfg.policy)
        self._at_prefill[index] += 1
        job.at_prefill = index
        self.prefills[index].submit(job)

    def _place_by_budget(self, job: Job) -> None:
        """The router's placement by a TTFT budget (router/placement.py): the TTFT predicted
        through main (queue at the least loaded prefill, the prefill over main's uncached
        prompt, the WAN copy behind the line) against the budget, with the relay's headroom;
        the decision is policy.place_by_ttft_budget's."""
        request, cfg = job.request, self.cfg.policy
        main = self._pick_main(job)
        uncached = request.input_tokens - main.candidate(request).cached_prefix_tokens
        rate, rtt = self.router_line()
        wan_s = policy.predict_wan_seconds_on_line(uncached, self.wan_bytes_per_token(uncached),
                                                   rate, rtt, self.line_state(main))
        queued = min(self._at_prefill) * self._mean_uncached
        main_ttft = policy.MainTtft(policy.prefill_seconds(queued, cfg.prefill_tokens_per_s),
                                    policy.prefill_seconds(uncached, cfg.prefill_tokens_per_s),
                                    wan_s)
        relay_load = (policy.RelayLoad(len(self._on_relay), self.cfg.relay_max_running, 0,
                                       1).utilisation if self.relays else None)
        decision = policy.place_by_ttft_budget(main_ttft, cfg.ttft_slo_s, relay_load, cfg)
        pipeline = decision.pipeline
        if (pipeline is Pipeline.PREFILL_RELAY_MAIN and cfg.singular_predictive
                and uncached >= cfg.singular_min_uncached_tokens
                and request.output_tokens <= cfg.singular_max_new_tokens):
            pipeline = Pipeline.RELAY_SINGULAR
        self._mean_uncached += (uncached - self._mean_uncached) / 16   # the router's EWMA
        job.budget_pipeline, job.budget_verdict = pipeline, decision.verdict
        if pipeline is not Pipeline.PREFILL_MAIN:
            self._on_relay.add(job)

    def _on_prefill_done(self, job: Job) -> None:
        setup = self.cfg.setup
        request = job.request
        main = self._pick_main(job)
        if not setup.has_relay:
            job.pipeline = Pipeline.PREFILL_MAIN
            self._send_to_main(job, main)
            return
        uncached = request.input_tokens - (main.candidate(request).cached_prefix_tokens)
        job.main_uncached_tokens = uncached      # the router's prediction, kept for the filter
        rate, rtt = self.router_line()
        if job.budget_pipeline is not None:
            job.pipeline = job.budget_pipeline
        else:
            job.pipeline = policy.choose_pipeline(
                uncached, request.output_tokens, self.wan_bytes_per_token(uncached), rate, rtt,
                self.cfg.policy, line=self.line_state(main))
        if job.pipeline is Pipeline.PREFILL_MAIN:
            self._send_to_main(job, main)
        elif setup is Setup.RELAY_ONLY or job.pipeline is Pipeline.RELAY_SINGULAR:
            self._send_to_relay(job, relay_only=True)
        else:
            self._send_to_relay(job, relay_only=False)
            self._send_to_main(job, main)

    def router_line(self) -> tuple[float, float]:
        """The line as the router predicts with it (bytes/s, seconds of round trip): what it
        was told (ClusterConfig.router_wan_*), else what it would configure: one copy on an
        idle line moves at the lesser of the line rate and its window / RTT, and pays the RTT
        plus the transfer's fixed cost."""
        rate = self.cfg.router_wan_bytes_per_s
        rtt = self.cfg.router_wan_rtt_s
        if rate is None:
            rate = min(self.wan.rate, self.wan.per_flow_cap)
        if rtt is None:
            rtt = self.wan.profile.rtt_s + self.wan.transfer_fixed_s
        return rate, rtt

    def line_state(self, main: DecodeServer) -> policy.LineState:
        """What the router knows of the line to `main` (policy.IDLE_LINE under idle-line
        placement): bytes of its copies not yet sent, and its recent copies' throughput."""
        if self.cfg.placement == "idle-line":
            return policy.IDLE_LINE
        if isinstance(self.wan, ClassedLink):     # a new copy waits behind its tier only
            ahead = self.wan.first_token_bytes_ahead(main.index)
        else:
            ahead = sum(self.wan.remaining_bytes(flow) for flow in main.copies_in_flight)
        recent = main.recent_copies
        seconds = sum(s for _, s in recent)
        measured = sum(b for b, _ in recent) / seconds if recent and seconds > 0 else None
        return policy.LineState(int(ahead), measured)

    def _pick_main(self, job: Job) -> DecodeServer:
        candidates = [m.candidate(job.request) for m in self.mains]
        return self.mains[policy.choose_main(candidates, self.cfg.policy)]

    def _send_to_main(self, job: Job, main: DecodeServer) -> None:
        job.main = main
        predecessor = self._landing_predecessor(job, main)
        if predecessor is None:
            self._reserve_main(job)
            return
        started = []

        def start() -> None:  # once: the predecessor's copy ended, or the router stopped waiting
            if not started:
                started.append(True)
                self._reserve_main(job)

        self._landing_waiters.setdefault(id(predecessor), []).append(start)
        self.sim.schedule(self.cfg.router_main_wait_for_landing_s, Callback(start))

    def _reserve_main(self, job: Job) -> None:
        request = job.request
        job.main.reserve(job, request.input_tokens + request.output_tokens,
                         lambda: self._main_reserved(job))

    def _landing_predecessor(self, job: Job, main: DecodeServer) -> Job | None:
        """The landing copy to ``main`` of the turn ``job`` extends (its prompt a prefix of
        ``job``'s), which a P->RLD->MD turn waits for (the router's LandingCopies.predecessor)."""
        if (job.pipeline is not Pipeline.PREFILL_RELAY_MAIN
                or self.cfg.router_main_wait_for_landing_s <= 0):
            return None
        blocks = job.request.prompt_blocks
        best = None
        for landing in self._landing:
            prompt = landing.request.prompt_blocks
            if (landing.main is main and len(prompt) <= len(blocks)
                    and blocks[:len(prompt)] == prompt
                    and (best is None or len(prompt) > len(best.request.prompt_blocks))):
                best = landing
        return best

    def _landing_ended(self, job: Job) -> None:
        if job in self._landing:
            self._landing.remove(job)
            for start in self._landing_waiters.pop(id(job), ()):
                start()

    def _main_reserved(self, job: Job) -> None:
        job.main_reserved = True
        job.main_reserved_s = self.sim.now
        if job.cancelled_wan:
            job.main.release(job)
            return
        request = job.request
        main = job.main
        if main.cache is not None:
            job.main_cached_tokens = main.cache.cached_tokens(
                request.prompt_blocks, request.input_tokens, touch=True)
        raw_bytes = (request.input_tokens - job.main_cached_tokens) * self.kv_bytes_per_token
        link = self.wan if self.cfg.setup.behind_wan else self.rdma_of(job)
        if link is not self.wan:
            job.wan_bytes = 0.0
            job.wan_flow = link.start_flow(raw_bytes, lambda: self._main_has_kv(job))
            return
        codec = self.wan_codec_for(raw_bytes)
        job.wan_bytes = raw_bytes / codec.ratio      # the line carries wire bytes
        sent = lambda: self._wan_copy_sent(job, raw_bytes, codec)  # noqa: E731
        if isinstance(link, ClassedLink):
            # A relay answers a P->RLD->MD request while its copy flies: the prefill marks the
            # copy relay-covered (a room with a relay), whether or not the relay has started.
            job.wan_flow = link.start_flow(
                job.wan_bytes, sent, dest=main.index, on_dropped=lambda: self._copy_dropped(job),
                relay_covered=job.pipeline is Pipeline.PREFILL_RELAY_MAIN)
        else:
            job.wan_flow = link.start_flow(job.wan_bytes, sent)
        job.wan_started_s = self.sim.now
        main.copies_in_flight.add(job.wan_flow)

    def wan_codec_for(self, raw_bytes: float) -> CodecCost:
        """The codec of a main-bound copy of raw_bytes: a lossless one where it shortens the
        copy on the line the prefill declares (auto), a lossy one always (forced)."""
        if self.wan_codec is None:
            return RAW
        if not self.wan_codec.lossless:
            return self.wan_codec
        rate, _ = self.router_line()
        return choose_wan_codec(raw_bytes, rate, [self.wan_codec], self.coding_window_bytes())

    def coding_window_bytes(self) -> float:
        """A copy is coded per window of what the sender keeps in flight: the line's per-flow
        window, else the sender's (prefill/wan_engine.window_for_line of the router's line)."""
        rate, rtt = self.router_line()
        return (self.wan.profile.window_bytes
                or window_for_line(rate * 8 / 1e9, rtt * 1e3).window_bytes)

    def wan_bytes_per_token(self, uncached_tokens: int) -> float:
        """What the router predicts a copy with: wire bytes (the prefill's /pdd/line reports
        its codec's ratio)."""
        raw_bytes = uncached_tokens * self.kv_bytes_per_token
        return self.kv_bytes_per_token / self.wan_codec_for(raw_bytes).ratio

    def _wan_copy_sent(self, job: Job, raw_bytes: float, codec: CodecCost) -> None:
        """The copy's last wire byte arrived. Coded per window, it lands once its last window
        is decoded, and no sooner than the codec's own pace allows (the slower of encoding and
        decoding the whole copy, plus the pipeline's fill)."""
        if codec is RAW:
            self._main_has_kv(job)
            return
        window = min(self.coding_window_bytes(), raw_bytes)
        fill_s = window / codec.encode_bytes_per_s + window / codec.decode_bytes_per_s
        ready_s = max(self.sim.now + fill_s,
                      job.wan_started_s + coded_copy_seconds(raw_bytes, math.inf, codec, window))
        self.schedule(ready_s - self.sim.now, self._main_has_kv, job)

    def _main_has_kv(self, job: Job) -> None:
        if job.wan_flow is not None and job.wan_flow in job.main.copies_in_flight:
            job.main.copies_in_flight.discard(job.wan_flow)
            if job.wan_bytes > 0:
                job.main.recent_copies.append((job.wan_bytes, self.sim.now - job.wan_started_s))
        job.wan_flow = None
        job.main_ready = True
        if job.handoff_cancelled:      # the relay answered alone; the copy still landed
            self.main_keeps_prompt(job)
            return
        if job.pipeline is Pipeline.PREFILL_RELAY_MAIN and not job.relay_abandoned:
            self.handoff.main_ready(job)
            return
        self._main_decodes_from_start(job)

    def copy_turns_cache_only(self, job: Job) -> None:
        """The relay answered alone while main's copy is queued or on the line: on the classed
        line it goes behind every needed-now copy (and may be dropped)."""
        self._landing.append(job)  # the router keeps it, for the conversation's next turn
        if isinstance(self.wan, ClassedLink) and job.wan_flow is not None:
            self.wan.set_cache_only(job.wan_flow)

    def _copy_dropped(self, job: Job) -> None:
        """A cache-only copy dropped past the line's backlog: main frees the request's slots
        and never caches its prompt (the router's mirror forgets it)."""
        job.main.copies_in_flight.discard(job.wan_flow)
        job.wan_flow = None
        job.copy_dropped = True
        job.main.release(job)
        self._landing_ended(job)

    def main_keeps_prompt(self, job: Job) -> None:
        """A copy landed without a handoff: main caches the prompt (the relay's output never
        reached it) and frees the request, as SGLang's main does when the relay refuses."""
        if job.main.cache is not None:
            job.main.cache.insert(job.request.prompt_blocks)
        job.main.release(job)
        self._landing_ended(job)

    def _main_decodes_from_start(self, job: Job) -> None:
        """P->MD: main emits the first token (computed by prefill) and decodes the rest."""
        main = job.main
        # SGLang's decode scheduler sees the landed KV (and streams the first token, computed by
        # prefill) only between its forwards.
        boundary = main.until_step_boundary() if self.cfg.register_at_step_boundary else 0.0
        self._first_token(job, self.sim.now + boundary + main.delivery_delay_s)
        steps = job.request.output_tokens - 1
        if steps == 0:
            self.finish_at_main(job)
        else:
            main.start_decoding(job, job.request.input_tokens, steps,
                                lambda: self.finish_at_main(job))

    def _send_to_relay(self, job: Job, relay_only: bool) -> None:
        candidates = [r.candidate(job.request) for r in self.relays]
        relay = self.relays[policy.choose_main(candidates, self.cfg.policy)]
        job.relay = relay
        request = job.request
        relay.reserve(job, request.input_tokens + request.output_tokens,
                      lambda: self._relay_reserved(job))

    def _relay_reserved(self, job: Job) -> None:
        if job.relay_abandoned:
            job.relay.release(job)
            return
        job.relay_hold_since_s = self.sim.now
        size = job.request.input_tokens * self.kv_bytes_per_token
        self.rdma_of(job).start_flow(size, lambda: self._relay_has_kv(job))

    def rdma_of(self, job: Job) -> FairShareLink:
        return self.rdma[job.prefill_index][job.prefill_lane]

    def release_relay(self, job: Job) -> None:
        if job.relay is not None and job in job.relay.reserved:
            self.relay_busy_request_s += self.sim.now - job.relay_hold_since_s
            job.relay.release(job)

    def _relay_has_kv(self, job: Job) -> None:
        if job.relay_abandoned:
            self.release_relay(job)
            return
        job.relay_started = True
        self._first_token(job, self.sim.now)
        steps = job.request.output_tokens - 1
        if steps == 0:
            self.handoff.relay_finished(job)
        else:
            job.relay.start_decoding(job, job.request.input_tokens, steps,
                                     lambda: self.handoff.relay_finished(job))

    # --- completion ----------------------------------------------------------------------
    def _first_token(self, job: Job, time_s: float) -> None:
        if math.isnan(job.first_token_s):
            job.first_token_router_s = time_s
            job.first_token_s = time_s + self.cfg.router_to_client_s

    def finish(self, job: Job, where: str, time_s: float) -> None:
        job.completions += 1
        if job.completions > 1:
            raise AssertionError(f"request {job.request.request_id} finished twice")
        job.finish_s = time_s
        job.finished_at = where
        job.user_done = True
        self.unfinished -= 1
        self._at_prefill[job.at_prefill] -= 1      # the router lets go of its servers
        self._on_relay.discard(job)
        follower = self._next_turn.get(job.request.request_id)
        if follower is not None:           # the closed-loop client sends the next turn
            later, gap = follower
            later.request = replace(later.request, arrival_s=time_s + gap)
            self.last_arrival_s = max(self.last_arrival_s, later.request.arrival_s)
            self.sim.at(later.request.arrival_s, Arrival(self, later))

    def finish_at_main(self, job: Job) -> None:
        main = job.main
        if main.cache is not None:
            main.cache.insert(job.request.context_blocks)
        main.release(job)
        if not job.user_done:
            self.finish(job, "main", self.sim.now + main.delivery_delay_s)

    def schedule(self, delay_s: float, function, *args) -> None:
        self.sim.schedule(delay_s, Callback(function, *args))


def simulate(cfg: ClusterConfig, requests, warmup=(), traced_ids=(), progress=None,
             follows=None):
    """Run one setup over a workload; returns (summary, cluster)."""
    cluster = Cluster(cfg)
    summary = cluster.run(requests, warmup, traced_ids, progress, follows)
    return summary, cluster
