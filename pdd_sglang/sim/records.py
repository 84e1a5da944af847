"""Per-request records and the run summary (percentiles, byte totals, time series)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..policy import HandoffMode, Pipeline

# The demo's TTFT stages (pdd_sglang.dev.demo.report.STAGES; serving code never imports dev).
STAGES = ("router_to_prefill", "registration_wait", "prefill_queue", "prefill_forward",
          "kv_and_first_token", "router_to_client")


class Job:
    """Everything the simulator tracks about one request as it moves through the cluster."""

    __slots__ = ("request", "pipeline", "prefill_cached_tokens", "prefill_start_s",
                 "prefill_done_s", "main", "relay", "main_cached_tokens", "wan_flow",
                 "wan_bytes", "first_token_s", "finish_s", "finished_at", "completions",
                 "main_ready", "main_ready_at_relay", "relay_started", "user_done",
                 "handoff_mode", "handed_tokens", "handoff_rounds", "handoff_gap_s",
                 "relay_last_token_s", "token_times", "cancelled_wan", "handoff_cancelled",
                 "main_uncached_tokens", "relay_abandoned",
                 "main_reserved", "prefill_index", "prefill_lane", "relay_hold_since_s",
                 "wan_started_s", "main_reserved_s", "dispatched_s", "router_to_prefill_s",
                 "first_token_router_s", "registered", "at_prefill", "budget_pipeline",
                 "budget_verdict", "copy_dropped")

    def __init__(self, request):
        self.request = request
        self.pipeline = None
        self.prefill_cached_tokens = 0
        self.prefill_start_s = self.prefill_done_s = math.nan
        self.main = None
        self.relay = None
        self.main_cached_tokens = 0
        self.wan_flow = None
        self.wan_bytes = 0.0
        self.first_token_s = math.nan
        self.finish_s = math.nan
        self.finished_at = None
        self.completions = 0
        self.main_ready = False
        self.main_ready_at_relay = False
        self.relay_started = False
        self.user_done = False
        self.handoff_mode = None
        self.handed_tokens = 0
        self.handoff_rounds = 0
        self.handoff_gap_s = math.nan
        self.relay_last_token_s = math.nan
        self.token_times = []
        self.cancelled_wan = False          # main's WAN copy was cut (singular traffic)
        self.handoff_cancelled = False      # the relay answered alone; no handoff
        self.main_uncached_tokens = 0
        self.relay_abandoned = False
        self.at_prefill = 0                 # the prefill it was sent to (router's count)
        self.budget_pipeline = None         # placed by the TTFT budget at arrival (or None)
        self.budget_verdict = None
        self.copy_dropped = False           # main's cache-only copy was dropped (classed line)
        self.main_reserved = False
        self.prefill_index = 0
        self.prefill_lane = 0
        self.relay_hold_since_s = math.nan
        self.wan_started_s = math.nan
        self.main_reserved_s = math.nan
        self.dispatched_s = math.nan        # handed to prefill (after the dispatch latency)
        self.router_to_prefill_s = 0.0      # the first part of the dispatch latency
        self.first_token_router_s = math.nan  # first token at the router (then the client)
        self.registered = False             # the decode side(s) took it (register_at_step_boundary)

    def stages(self) -> dict:
        """The TTFT split the demo measures (pdd_sglang.dev.demo.report.STAGES), in seconds."""
        arrival = self.request.arrival_s
        dispatched = self.dispatched_s
        at_router = (self.first_token_s if math.isnan(self.first_token_router_s)
                     else self.first_token_router_s)
        to_prefill = min(self.router_to_prefill_s, dispatched - arrival)
        # SGLang's scheduler takes a request into its waiting queue only between forwards, and
        # batches the whole queue into the next one: the wait for a prefill that is busy falls
        # in the demo's registration_wait, its prefill_queue (SGLang's queue_time) stays ~0.
        return {"router_to_prefill": to_prefill,
                "registration_wait": self.prefill_start_s - arrival - to_prefill,
                "prefill_queue": 0.0,
                "prefill_forward": self.prefill_done_s - self.prefill_start_s,
                "kv_and_first_token": at_router - self.prefill_done_s,
                "router_to_client": self.first_token_s - at_router}

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.request.arrival_s


def percentile(values, q: float) -> float:
    """Linear-interpolated percentile (q in 0..100) of a list; NaN when empty."""
    data = sorted(values)
    if not data:
        return math.nan
    position = (len(data) - 1) * q / 100.0
    low = int(position)
    high = min(low + 1, len(data) - 1)
    return data[low] + (data[high] - data[low]) * (position - low)


def histogram_percentile(histogram: dict, bin_width: float, q: float) -> float:
    total = sum(histogram.values())
    if not total:
        return math.nan
    target = total * q / 100.0
    running = 0
    for key in sorted(histogram):
        running += histogram[key]
        if running >= target:
            return (key + 0.5) * bin_width
    return (max(histogram) + 0.5) * bin_width


@dataclass
class RunSummary:
    setup: str
    requests: int
    finished: int
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    ttft_mean_s: float
    itl_p50_ms: float
    itl_p90_ms: float
    itl_p99_ms: float
    handoff_gap_p50_ms: float
    handoff_gap_p99_ms: float
    wan_bytes: float
    wan_bytes_without_drc: float
    prefill_hit: float            # token-weighted prefix hit at prefill
    main_hit: float               # token-weighted DRC hit of requests whose KV went to main
    by_pipeline: dict
    by_handoff_mode: dict
    finished_at: dict
    relay_busy_request_s: float   # sum over requests of seconds holding a relay slot
    duration_s: float
    goodput_rps: float = 0.0
    # Where TTFT goes, per request then percentiles {p50, p90, p99} in seconds: waiting for a
    # prefill lane, computing the prefill, and everything after it until the first token
    # (waiting for decode admission, the KV copy, delivery).
    ttft_parts_s: dict = field(default_factory=dict)
    decode_admission_wait_p99_s: float = 0.0
    # The demo's six TTFT stages (STAGES), per request then {p50, p90, p99} in seconds.
    stages_s: dict = field(default_factory=dict)
    timeline: list = field(default_factory=list)

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "timeline"}


def summarise(setup: str, jobs: list, itl_histogram: dict, bin_width: float,
              wan_bytes: float, kv_bytes_per_token: float, relay_busy_request_s: float,
              timeline: list) -> RunSummary:
    done = [j for j in jobs if j.completions]
    ttfts = [j.ttft_s for j in done]
    gaps = [j.handoff_gap_s for j in done if not math.isnan(j.handoff_gap_s)]
    inputs = sum(j.request.input_tokens for j in jobs) or 1
    to_main = [j for j in jobs if j.main is not None and not j.relay_abandoned
               and j.pipeline is not Pipeline.RELAY_SINGULAR]
    main_inputs = sum(j.request.input_tokens for j in to_main) or 1
    by_pipeline, by_mode, finished_at = {}, {}, {}
    for j in jobs:
        key = j.pipeline.label if j.pipeline else "none"
        by_pipeline[key] = by_pipeline.get(key, 0) + 1
        if isinstance(j.handoff_mode, HandoffMode):
            by_mode[j.handoff_mode.value] = by_mode.get(j.handoff_mode.value, 0) + 1
        if j.finished_at:
            finished_at[j.finished_at] = finished_at.get(j.finished_at, 0) + 1
    parts = {
        "prefill_queue": [j.prefill_start_s - j.request.arrival_s for j in done],
        "prefill_compute": [j.prefill_done_s - j.prefill_start_s for j in done],
        "after_prefill": [j.first_token_s - j.prefill_done_s for j in done],
    }
    ttft_parts = {name: {f"p{q}": percentile(values, q) for q in (50, 90, 99)}
                  for name, values in parts.items()}
    split = [j.stages() for j in done]
    stages = {name: {f"p{q}": percentile([s[name] for s in split], q) for q in (50, 90, 99)}
              for name in STAGES}
    admission = [j.main_reserved_s - j.prefill_done_s for j in done
                 if not math.isnan(j.main_reserved_s)]
    start = min((j.request.arrival_s for j in jobs), default=0.0)
    end = max((j.finish_s for j in done), default=start)
    return RunSummary(
        setup=setup, requests=len(jobs), finished=len(done),
        ttft_p50_s=percentile(ttfts, 50), ttft_p90_s=percentile(ttfts, 90),
        ttft_p99_s=percentile(ttfts, 99),
        ttft_mean_s=sum(ttfts) / len(ttfts) if ttfts else math.nan,
        itl_p50_ms=1000 * histogram_percentile(itl_histogram, bin_width, 50),
        itl_p90_ms=1000 * histogram_percentile(itl_histogram, bin_width, 90),
        itl_p99_ms=1000 * histogram_percentile(itl_histogram, bin_width, 99),
        handoff_gap_p50_ms=1000 * percentile(gaps, 50),
        handoff_gap_p99_ms=1000 * percentile(gaps, 99),
        wan_bytes=wan_bytes,
        wan_bytes_without_drc=sum(j.request.input_tokens for j in to_main) * kv_bytes_per_token,
        prefill_hit=sum(j.prefill_cached_tokens for j in jobs) / inputs,
        main_hit=sum(j.main_cached_tokens for j in to_main) / main_inputs,
        by_pipeline=by_pipeline, by_handoff_mode=by_mode, finished_at=finished_at,
        relay_busy_request_s=relay_busy_request_s, duration_s=end - start,
        ttft_parts_s=ttft_parts, stages_s=stages,
        decode_admission_wait_p99_s=percentile(admission, 99) if admission else 0.0,
        timeline=timeline)
