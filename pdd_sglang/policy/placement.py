"""Where a request goes: its WAN copy's predicted time (on an idle line or behind the bytes
ahead), P->MD or P->RLD->MD, which main, and whether main's copy goes on once the relay
answered alone."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from pdd_sglang.policy.config import (DEFAULT_POLICY, Pipeline, PolicyConfig,
                                      _require_at_least_one, _require_non_negative)


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
    wire_ratio: KV bytes per wire byte on that line (its prefill's WAN codec, issue 36): a new
        copy of N KV bytes takes N / wire_ratio on the wire. ``bytes_ahead`` and the rates are
        wire bytes already.
    """

    bytes_ahead: int = 0
    measured_bytes_per_s: float | None = None
    wire_ratio: float = 1.0

    def __post_init__(self) -> None:
        _require_non_negative("bytes_ahead", self.bytes_ahead)
        if not self.wire_ratio > 0:
            raise ValueError(f"wire_ratio must be > 0, got {self.wire_ratio}")
        if self.measured_bytes_per_s is not None and not self.measured_bytes_per_s > 0:
            raise ValueError(f"measured_bytes_per_s must be > 0, got {self.measured_bytes_per_s}")


IDLE_LINE = LineState()


def predict_wan_seconds_on_line(uncached_tokens: int, kv_bytes_per_token: float,
                                wan_bytes_per_s: float, rtt_s: float, line: LineState) -> float:
    """Time to ship main's uncached suffix behind what the line already carries.

    The copy waits for ``line.bytes_ahead`` to drain, at the slower of the nominal rate and the
    measured one (a measured rate above nominal is a measurement artefact, not a faster line);
    its own KV counts in wire bytes (``line.wire_ratio``).
    With IDLE_LINE this is predict_wan_seconds.
    """
    predict_wan_seconds(uncached_tokens, kv_bytes_per_token, wan_bytes_per_s, rtt_s)  # validates
    rate = wan_bytes_per_s
    if line.measured_bytes_per_s is not None:
        rate = min(rate, line.measured_bytes_per_s)
    wire_bytes = uncached_tokens * kv_bytes_per_token / line.wire_ratio
    return rtt_s + (line.bytes_ahead + wire_bytes) / rate




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
