"""The one PDD policy module: placement, handoff mode and singular-traffic decisions.

The router, the relay decode server and the simulator all import their decisions from here, so a
policy change is tested once and behaves the same in simulation and in production.  Pure Python,
stdlib only, no I/O, no clocks: every function is a deterministic function of its arguments.

The rules for a TTFT budget (``place_by_ttft_budget`` and its types) are in
:mod:`pdd_sglang.policy.ttft_budget`, re-exported here.

Vocabulary (the brief's roles, spelled out):
  prefill  (P)   computes the prompt's KV, in datacenter A.
  relay    (RLD) decodes eagerly next to prefill (RDMA) while the WAN copy is in flight.
  main     (MD)  decodes behind the WAN, in datacenter B, with its own radix cache (DRC).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Sequence


def _require_non_negative(name: str, value: float) -> None:
    if value is None or value < 0 or (isinstance(value, float) and math.isnan(value)):
        raise ValueError(f"{name} must be >= 0, got {value!r}")


def _require_at_least_one(name: str, value: int) -> None:
    if value is None or value < 1:
        raise ValueError(f"{name} must be >= 1, got {value!r}")


class Pipeline(str, enum.Enum):
    """Which servers a request passes through: the one pipeline vocabulary of PDD.

    The value is the name servers read in a request's route (``protocol.route``, the router's
    ``kv_hints``); ``label`` is the brief's notation, used in logs, metrics and figures.

    Only two normal pipelines exist, and both end at main.  A "prefill -> relay only" pipeline
    (the relay finishing every request whose WAN copy would be slow) is deliberately absent: the
    requests it finishes never reach main, so main's radix cache falls behind prefill's; the next
    turn of those conversations then misses at main, its predicted WAN time grows, and it is sent
    to the relay again.  That positive feedback moves whole conversations onto the relay until it
    is overloaded and collapses.  Ending every normal pipeline at main keeps main's cache aligned
    with prefill's, and leaves the relay a single job: hiding WAN latency.

    RELAY_SINGULAR is the narrow exception for singular traffic (very long uncached input, very
    short output): the relay would finish before the WAN copy lands, so the copy is not started.
    """

    PREFILL_MAIN = "prefill_main"
    PREFILL_RELAY_MAIN = "prefill_relay_main"
    RELAY_SINGULAR = "relay_singular"

    @property
    def label(self) -> str:
        return _PIPELINE_LABELS[self]


_PIPELINE_LABELS = {
    Pipeline.PREFILL_MAIN: "P->MD",
    Pipeline.PREFILL_RELAY_MAIN: "P->RLD->MD",
    Pipeline.RELAY_SINGULAR: "P->RLD (singular)",
}


class HandoffMode(enum.Enum):
    """How the relay hands its eagerly generated token IDs to main.

    ONE_SHOT: every held token at once; the relay is freed at once, main runs one larger extend
    (a small visible stall for this request and for main's batch).
    CATCH_UP: a chunk at a time while the relay keeps decoding; each extend is small, the last
    switch is imperceptible, at the price of a little more relay time.
    """

    ONE_SHOT = "one-shot"
    CATCH_UP = "catch-up"


@dataclass(frozen=True)
class PolicyConfig:
    """Tunable knobs of the policy; defaults are the values used by the simulator's figures.

    hide_wan_below_s: predicted WAN time of main's uncached suffix under which P->MD is used
        (the copy is too short to be worth hiding behind relay decoding).
    catch_up_threshold_tokens: at or below this many held tokens a handoff is always ONE_SHOT
        (one extend of this size is as cheap as a decode step, chunking buys nothing).
    catch_up_chunk_tokens: tokens per CATCH_UP chunk (and the size of the final chunk at most).
    relay_load_watermark: relay utilisation (0..1) at or above which the relay prefers ONE_SHOT
        to free its slot at once.
    singular_reactive: when the relay finishes a request before main is ready, complete it at
        the relay and cancel the handoff; main's WAN copy is cancelled too only for singular
        traffic (cancel_wan_copy), any other copy lands so main caches the prompt.
    singular_predictive: decide singular traffic up front in choose_pipeline (off by default:
        max_new_tokens is only an upper bound of the real output length).
    singular_min_uncached_tokens / singular_max_new_tokens: what counts as singular traffic,
        for both filters.
    main_load_penalty_tokens: in choose_main, a fully loaded main is worth this many cached
        prefix tokens less than an idle one.
    ttft_slo_s: the TTFT budget (place_by_ttft_budget); None: no budget, and hide_wan_below_s
        decides (a request may carry its own budget, which wins).
    relay_full_utilisation: relay utilisation (RelayLoad.utilisation, the handoff policy's
        view) at or above which the relay has no headroom for another request.
    prefill_tokens_per_s: prefill's throughput, for the queue and prefill parts of the TTFT
        predicted through main (None: only the WAN copy is predicted).
    """

    hide_wan_below_s: float = 0.5
    catch_up_threshold_tokens: int = 64
    catch_up_chunk_tokens: int = 64
    relay_load_watermark: float = 0.7
    singular_reactive: bool = True
    singular_predictive: bool = False
    singular_min_uncached_tokens: int = 32768
    singular_max_new_tokens: int = 32
    main_load_penalty_tokens: int = 8192
    ttft_slo_s: float | None = None
    relay_full_utilisation: float = 1.0
    prefill_tokens_per_s: float | None = None

    def __post_init__(self) -> None:
        _require_non_negative("hide_wan_below_s", self.hide_wan_below_s)
        _require_non_negative("catch_up_threshold_tokens", self.catch_up_threshold_tokens)
        _require_at_least_one("catch_up_chunk_tokens", self.catch_up_chunk_tokens)
        if not 0.0 <= self.relay_load_watermark:
            raise ValueError(f"relay_load_watermark must be >= 0, got {self.relay_load_watermark}")
        _require_non_negative("singular_min_uncached_tokens", self.singular_min_uncached_tokens)
        _require_non_negative("singular_max_new_tokens", self.singular_max_new_tokens)
        _require_non_negative("main_load_penalty_tokens", self.main_load_penalty_tokens)
        if self.ttft_slo_s is not None and not self.ttft_slo_s > 0:
            raise ValueError(f"ttft_slo_s must be > 0, got {self.ttft_slo_s!r}")
        if self.prefill_tokens_per_s is not None and not self.prefill_tokens_per_s > 0:
            raise ValueError(f"prefill_tokens_per_s must be > 0, got {self.prefill_tokens_per_s!r}")
        if not self.relay_full_utilisation > 0:
            raise ValueError(f"relay_full_utilisation must be > 0, got "
                             f"{self.relay_full_utilisation!r}")


DEFAULT_POLICY = PolicyConfig()


@dataclass(frozen=True)
class RelayLoad:
    """A relay server's load as its scheduler reports it."""

    running_requests: int
    max_running_requests: int
    kv_used_tokens: int
    kv_capacity_tokens: int

    def __post_init__(self) -> None:
        _require_non_negative("running_requests", self.running_requests)
        _require_non_negative("kv_used_tokens", self.kv_used_tokens)
        _require_at_least_one("max_running_requests", self.max_running_requests)
        _require_at_least_one("kv_capacity_tokens", self.kv_capacity_tokens)

    @property
    def utilisation(self) -> float:
        """The tighter of the two limits: request slots or KV memory."""
        return max(self.running_requests / self.max_running_requests,
                   self.kv_used_tokens / self.kv_capacity_tokens)


@dataclass(frozen=True)
class HandoffChunk:
    """Token positions [start, end) of the relay's output to hand to main next."""

    start: int
    end: int
    is_last: bool

    @property
    def tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class MainCandidate:
    """One main decode server as seen when placing a request."""

    cached_prefix_tokens: int
    running_requests: int
    max_running_requests: int

    def __post_init__(self) -> None:
        _require_non_negative("cached_prefix_tokens", self.cached_prefix_tokens)
        _require_non_negative("running_requests", self.running_requests)
        _require_at_least_one("max_running_requests", self.max_running_requests)

    @property
    def utilisation(self) -> float:
        return self.running_requests / self.max_running_requests


def predict_wan_seconds(uncached_tokens: int, kv_bytes_per_token: float,
                        wan_bytes_per_s: float, rtt_s: float) -> float:
    """Time to ship main's uncached suffix over an otherwise idle line: one RTT plus bytes/rate.

    The RTT stands for connection setup and the completion acknowledgement; congestion is not
    predicted here, the threshold hide_wan_below_s leaves room for it.
    """
    _require_non_negative("uncached_tokens", uncached_tokens)
    if not kv_bytes_per_token > 0:
        raise ValueError(f"kv_bytes_per_token must be > 0, got {kv_bytes_per_token}")
    if not wan_bytes_per_s > 0 or math.isinf(wan_bytes_per_s):
        raise ValueError(f"wan_bytes_per_s must be a finite positive rate, got {wan_bytes_per_s}")
    _require_non_negative("rtt_s", rtt_s)
    return rtt_s + uncached_tokens * kv_bytes_per_token / wan_bytes_per_s


@dataclass(frozen=True)
class LineState:
    """What is known of the line to one main right now, for congestion-aware placement.

    bytes_ahead: KV bytes already queued or in flight on prefill's WAN path to that main (a new
        copy lands after them: the line is one FIFO per destination).
    measured_bytes_per_s: throughput over recent copies to that main; None when nothing was
        measured yet (the nominal line rate stands).
    """

    bytes_ahead: int = 0
    measured_bytes_per_s: float | None = None

    def __post_init__(self) -> None:
        _require_non_negative("bytes_ahead", self.bytes_ahead)
        if self.measured_bytes_per_s is not None and not self.measured_bytes_per_s > 0:
            raise ValueError(f"measured_bytes_per_s must be > 0, got {self.measured_bytes_per_s}")


IDLE_LINE = LineState()


def predict_wan_seconds_on_line(uncached_tokens: int, kv_bytes_per_token: float,
                                wan_bytes_per_s: float, rtt_s: float, line: LineState) -> float:
    """Time to ship main's uncached suffix behind what the line already carries.

    The copy waits for ``line.bytes_ahead`` to drain, at the slower of the nominal rate and the
    measured one (a measured rate above nominal is a measurement artefact, not a faster line).
    With IDLE_LINE this is predict_wan_seconds.
    """
    predict_wan_seconds(uncached_tokens, kv_bytes_per_token, wan_bytes_per_s, rtt_s)  # validates
    rate = wan_bytes_per_s
    if line.measured_bytes_per_s is not None:
        rate = min(rate, line.measured_bytes_per_s)
    return rtt_s + (line.bytes_ahead + uncached_tokens * kv_bytes_per_token) / rate


def choose_pipeline(uncached_tokens: int, max_new_tokens: int, kv_bytes_per_token: float,
                    wan_bytes_per_s: float, rtt_s: float,
                    cfg: PolicyConfig = DEFAULT_POLICY, line: LineState = IDLE_LINE) -> Pipeline:
    """Place a request from the size of main's uncached suffix.

    P->MD when the predicted WAN time is under cfg.hide_wan_below_s (nothing worth hiding);
    otherwise P->RLD->MD.  ``line`` is the live state of the line to main (congestion-aware
    placement); the default, IDLE_LINE, predicts an idle line.  With cfg.singular_predictive, a long uncached input with a very short
    max_new_tokens goes to the relay alone (RELAY_SINGULAR), saving the WAN copy altogether.
    """
    _require_at_least_one("max_new_tokens", max_new_tokens)
    wan_s = predict_wan_seconds_on_line(uncached_tokens, kv_bytes_per_token, wan_bytes_per_s, rtt_s,
                                        line)
    if wan_s < cfg.hide_wan_below_s:
        return Pipeline.PREFILL_MAIN
    if (cfg.singular_predictive
            and uncached_tokens >= cfg.singular_min_uncached_tokens
            and max_new_tokens <= cfg.singular_max_new_tokens):
        return Pipeline.RELAY_SINGULAR
    return Pipeline.PREFILL_RELAY_MAIN


def choose_handoff_mode(tokens_held: int, relay_load: RelayLoad,
                        cfg: PolicyConfig = DEFAULT_POLICY) -> HandoffMode:
    """Pick the handoff mode when main reports it holds the prompt's KV.

    Rule: ONE_SHOT if tokens_held <= cfg.catch_up_threshold_tokens (a small extend is as cheap
    as a decode step) or if the relay's utilisation is at/above cfg.relay_load_watermark (free
    the relay slot now, accept main's one larger extend).  CATCH_UP otherwise.
    """
    _require_non_negative("tokens_held", tokens_held)
    if tokens_held <= cfg.catch_up_threshold_tokens:
        return HandoffMode.ONE_SHOT
    if relay_load.utilisation >= cfg.relay_load_watermark:
        return HandoffMode.ONE_SHOT
    return HandoffMode.CATCH_UP


def next_handoff_chunk(tokens_held: int, tokens_already_handed: int, mode: HandoffMode,
                       cfg: PolicyConfig = DEFAULT_POLICY) -> HandoffChunk:
    """The next slice of relay output to hand over.

    ONE_SHOT hands everything still unhanded and is last.  CATCH_UP hands one chunk of
    cfg.catch_up_chunk_tokens while the relay keeps decoding; once the unhanded tail fits in a
    chunk, that tail is the last chunk and the relay stops decoding.  Catch-up converges because
    main absorbs a chunk in about one extend step while the relay adds about one token per step.
    """
    _require_non_negative("tokens_held", tokens_held)
    _require_non_negative("tokens_already_handed", tokens_already_handed)
    if tokens_already_handed > tokens_held:
        raise ValueError(f"tokens_already_handed ({tokens_already_handed}) exceeds tokens_held "
                         f"({tokens_held})")
    if not isinstance(mode, HandoffMode):
        raise ValueError(f"mode must be a HandoffMode, got {mode!r}")
    remaining = tokens_held - tokens_already_handed
    if mode is HandoffMode.ONE_SHOT or remaining <= cfg.catch_up_chunk_tokens:
        return HandoffChunk(tokens_already_handed, tokens_held, True)
    return HandoffChunk(tokens_already_handed,
                        tokens_already_handed + cfg.catch_up_chunk_tokens, False)


def relay_finishes_locally(relay_finished: bool, main_ready: bool,
                           cfg: PolicyConfig = DEFAULT_POLICY) -> bool:
    """Reactive singular filter: complete at the relay and cancel the WAN copy and handoff?

    True only when the relay has produced the whole output before main holds the prompt's KV.
    Once main is ready the handoff proceeds even if the relay finishes meanwhile, so main's
    cache still receives the conversation (the pipeline still ends at main).
    """
    return bool(cfg.singular_reactive and relay_finished and not main_ready)


def cancel_wan_copy(uncached_tokens: int, output_tokens: int,
                    cfg: PolicyConfig = DEFAULT_POLICY) -> bool:
    """After the relay finished a request alone: also cancel main's WAN copy of the prompt?

    Only for singular traffic: an uncached input of at least cfg.singular_min_uncached_tokens
    with an output of at most cfg.singular_max_new_tokens, the brief's "very long input, very
    short output" that is unlikely to be continued.  Any other request's copy completes and main
    caches the prompt (the handoff is still cancelled): cancelling every copy whose relay was
    faster keeps main's cache from ever receiving a long turn, so the conversation's next turns
    miss at main, take the relay again and are cut short again, the P->RLD-only collapse.
    """
    _require_non_negative("uncached_tokens", uncached_tokens)
    _require_non_negative("output_tokens", output_tokens)
    return bool(cfg.singular_reactive
                and uncached_tokens >= cfg.singular_min_uncached_tokens
                and output_tokens <= cfg.singular_max_new_tokens)


def choose_main(candidates: Sequence[MainCandidate],
                cfg: PolicyConfig = DEFAULT_POLICY) -> int:
    """Index of the main server for a request: longest cached prefix weighed against load.

    score = cached_prefix_tokens - cfg.main_load_penalty_tokens * utilisation; servers at or
    above full utilisation are only used when all are.  Ties go to the lowest index, so the
    choice is deterministic.  (The simulator reuses it to pick a prefill server, the same
    trade-off between cache affinity and queueing.)
    """
    if not candidates:
        raise ValueError("choose_main needs at least one candidate")
    any_free = any(c.utilisation < 1.0 for c in candidates)
    best_index, best_score = -1, -math.inf
    for index, candidate in enumerate(candidates):
        if any_free and candidate.utilisation >= 1.0:
            continue
        score = (candidate.cached_prefix_tokens
                 - cfg.main_load_penalty_tokens * candidate.utilisation)
        if score > best_score:
            best_index, best_score = index, score
    return best_index


# At the end: ttft_budget builds on Pipeline and PolicyConfig above.
from pdd_sglang.policy.ttft_budget import (  # noqa: E402
    BudgetPlacement, BudgetVerdict, MainTtft, place_by_ttft_budget, prefill_seconds)

