"""Where a request goes: the main by cache affinity and load, the pipeline by predicted WAN time.

Every decision is pdd_sglang.policy's (the simulator makes the same ones); this module only feeds
it the router's view: each main's prefix match from its mirror, outstanding requests per server,
and (congestion-aware placement) the line to each main as router/line_state.py accounts it.
Token counts of a text prompt are estimates (:mod:`pdd_sglang.router.prompt`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pdd_sglang import policy
from pdd_sglang.router.config import RouterConfig
from pdd_sglang.router.landing import LandingCopies
from pdd_sglang.router.line_state import LineAccounting
from pdd_sglang.router.prefix_mirror import PrefixMirror
from pdd_sglang.router.prompt import Prompt
from pdd_sglang.router.servers import MAIN, PREFILL, RELAY, NoHealthyServer, ServerPool, Upstream

@dataclass(frozen=True)
class Placement:
    pipeline: policy.Pipeline
    prefill: Upstream
    relay: Optional[Upstream]
    main: Optional[Upstream]  # None only for RELAY_SINGULAR
    main_cached_tokens: int  # the mirror's estimate for the chosen main
    predicted_wan_s: float
    line_bytes_ahead: int = 0  # what the line to main carried when placed (congestion-aware)
    relay_fallback: bool = False  # P->RLD->MD wanted, no healthy relay: P->MD instead
    main_fallback: bool = False  # no healthy main (dead, or the WAN cut): the relay alone
    # Against the request's TTFT budget (policy.BudgetVerdict's value; "no_budget" without one),
    # and the TTFT predicted through main that decided it (None without a budget).
    ttft_budget: str = policy.BudgetVerdict.NO_BUDGET.value
    predicted_main_ttft_s: Optional[float] = None

    @property
    def route_name(self) -> str:
        return self.pipeline.value

    @property
    def route_fields(self) -> dict:
        """What servers need beyond the pipeline: on P->RLD->MD, where main reaches the relay."""
        if self.pipeline is policy.Pipeline.PREFILL_RELAY_MAIN:
            return {"relay_control": self.relay.control_address}
        return {}

    @property
    def decoders(self) -> list[Upstream]:
        return [u for u in (self.relay, self.main) if u is not None]

    @property
    def upstreams(self) -> list[Upstream]:
        return [self.prefill, *self.decoders]


class Placer:
    def __init__(self, pool: ServerPool, mirrors: dict[str, PrefixMirror], config: RouterConfig,
                 kv_bytes_per_token: float, landing: Optional[LandingCopies] = None,
                 lines: Optional[LineAccounting] = None):
        self.pool = pool
        # For the TTFT budget: the mean uncached prompt of recent requests (what each request
        # queued at a prefill stands for).
        self._mean_uncached = 0.0
        self.lines = lines if lines is not None else LineAccounting()
        self.congestion_aware = config.placement == "congestion-aware"
        self.mirrors = mirrors  # by main URL
        self.landing = landing if landing is not None else LandingCopies()
        self.link = config.link
        self.kv_bytes_per_token = kv_bytes_per_token
        self.cfg = config.policy

    def choose_main(self, prompt: Prompt) -> tuple[Upstream, int]:
        """The main for ``prompt`` by the prefix it will hold (a copy still landing there
        counts: the turn waits for it) against load; and the tokens it holds *now* (a copy
        still crossing the WAN is not there yet), which the WAN prediction uses."""
        mains = self.pool.healthy(MAIN)
        if not mains:
            raise NoHealthyServer(MAIN)
        key = prompt.key
        held, now = [], []
        for m in mains:
            match = self.mirrors[m.url].match_length(key)
            landing = self.landing.predecessor(m.url, key)
            held.append(prompt.tokens_of(max(match, len(landing.prompt) if landing else 0)))
            now.append(prompt.tokens_of(match) if landing is None
                       else min(prompt.tokens_of(match), landing.cached_before))
        candidates = [policy.MainCandidate(cached_prefix_tokens=match,
                                           running_requests=min(m.outstanding,
                                                                m.max_running_requests),
                                           max_running_requests=m.max_running_requests)
                      for m, match in zip(mains, held)]
        index = policy.choose_main(candidates, self.cfg)
        return mains[index], now[index]

    def place(self, prompt: Prompt, max_new_tokens: int,
              avoid: frozenset = frozenset(), ttft_slo_s: Optional[float] = None) -> Placement:
        """``avoid``: relays this request must not use (one that just failed it, before the
        health monitor has its verdict). ``ttft_slo_s``: the request's own TTFT budget (default:
        the router's, ``--ttft-slo-ms``; none: ``hide_wan_below_s`` decides)."""
        try:
            main, cached = self.choose_main(prompt)
        except NoHealthyServer:
            # Main is unreachable: the relay, beside prefill, answers alone (P->RLD, as for
            # singular traffic) instead of the client getting an error.
            try:
                relay = self._relay(avoid)
            except NoHealthyServer:
                # No relay either: a main that a prefill took out after a failed WAN copy (a
                # copy past --pdd-wan-transfer-timeout on a congested line looks the same) is
                # the last chance of an answer, where a 503 is a certain failure.
                main = self._main_out_of_wan()
                return Placement(policy.Pipeline.PREFILL_MAIN, self.pool.least_loaded(PREFILL),
                                 None, main, 0, 0.0, 0, relay_fallback=True)
            return Placement(policy.Pipeline.RELAY_SINGULAR, self.pool.least_loaded(PREFILL),
                             relay, None, 0, 0.0, main_fallback=True)
        # SGLang never reuses the KV of the prompt's last token (it recomputes it to sample).
        uncached = prompt.tokens - min(cached, max(prompt.tokens - 1, 0))
        line = self.lines.state(main.url) if self.congestion_aware else policy.IDLE_LINE
        wan_s = policy.predict_wan_seconds_on_line(uncached, self.kv_bytes_per_token,
                                                   self.link.wan_bytes_per_s, self.link.rtt_s,
                                                   line)
        prefill = self.pool.least_loaded(PREFILL)
        budget_s = ttft_slo_s if ttft_slo_s is not None else self.cfg.ttft_slo_s
        verdict, main_ttft_s = policy.BudgetVerdict.NO_BUDGET, None
        if budget_s is None:
            pipeline = policy.choose_pipeline(uncached, max(1, max_new_tokens),
                                              self.kv_bytes_per_token, self.link.wan_bytes_per_s,
                                              self.link.rtt_s, self.cfg, line=line)
        else:
            main_ttft = self.main_ttft(prefill, uncached, wan_s)
            decision = policy.place_by_ttft_budget(main_ttft, budget_s,
                                                   self._relay_utilisation(avoid), self.cfg)
            pipeline, verdict, main_ttft_s = decision.pipeline, decision.verdict, main_ttft.total_s
            if (pipeline is policy.Pipeline.PREFILL_RELAY_MAIN and self.cfg.singular_predictive
                    and uncached >= self.cfg.singular_min_uncached_tokens
                    and max(1, max_new_tokens) <= self.cfg.singular_max_new_tokens):
                pipeline = policy.Pipeline.RELAY_SINGULAR
        self._mean_uncached += (uncached - self._mean_uncached) / 16  # an EWMA over ~16 requests
        budget = {"ttft_budget": verdict.value, "predicted_main_ttft_s": main_ttft_s}
        if pipeline is policy.Pipeline.PREFILL_MAIN:
            return Placement(pipeline, prefill, None, main, cached, wan_s, line.bytes_ahead,
                             **budget)
        try:
            relay = self._relay(avoid)
        except NoHealthyServer:
            if pipeline is policy.Pipeline.RELAY_SINGULAR:
                raise
            # Nothing to hide the WAN behind: still correct, only slower to the first token.
            if verdict is policy.BudgetVerdict.WITHIN:
                budget["ttft_budget"] = policy.BudgetVerdict.OVER.value
            return Placement(policy.Pipeline.PREFILL_MAIN, prefill, None, main, cached, wan_s,
                             line.bytes_ahead, relay_fallback=True, **budget)
        if pipeline is policy.Pipeline.RELAY_SINGULAR:
            return Placement(pipeline, prefill, relay, None, cached, wan_s, line.bytes_ahead,
                             **budget)
        return Placement(pipeline, prefill, relay, main, cached, wan_s, line.bytes_ahead,
                         **budget)

    def main_ttft(self, prefill: Upstream, uncached: int, wan_s: float) -> policy.MainTtft:
        """Queue (the requests the prefill holds, each worth the recent mean uncached prompt),
        prefill and WAN time of this request through main alone."""
        rate = self.cfg.prefill_tokens_per_s
        return policy.MainTtft(
            queue_s=policy.prefill_seconds(prefill.outstanding * self._mean_uncached, rate),
            prefill_s=policy.prefill_seconds(uncached, rate), wan_s=wan_s)

    def _relay_utilisation(self, avoid: frozenset) -> Optional[float]:
        """The least loaded usable relay's load as the handoff policy sees it (policy.RelayLoad:
        the requests the router has on it over its slots); None when no relay is usable."""
        try:
            relay = self._relay(avoid)
        except NoHealthyServer:
            return None
        return policy.RelayLoad(relay.outstanding, relay.max_running_requests, 0, 1).utilisation

    def _relay(self, avoid: frozenset = frozenset()) -> Upstream:
        return self.pool.least_loaded(
            RELAY, usable=lambda u: u.control_address is not None and u not in avoid)

    def _main_out_of_wan(self) -> Upstream:
        mains = [u for u in self.pool.by_role[MAIN] if u.healthy and u.wan_out]
        if not mains:
            raise NoHealthyServer(MAIN)
        return min(mains, key=lambda u: u.outstanding / u.max_running_requests)
