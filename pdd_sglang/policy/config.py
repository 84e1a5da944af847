"""The policy's vocabulary and knobs: the pipelines, the handoff modes and PolicyConfig (every
decision's thresholds, their ranges checked at construction)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass


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
