"""What the router records when a request finishes: its meta_info["pdd"] summary, the outcome
metrics, the WAN bytes, and what main now caches (the prefix mirror), when main answered."""

from __future__ import annotations

from pdd_sglang import policy
from pdd_sglang.router.metrics import RouterMetrics, TokenClock
from pdd_sglang.router.placement import Placement
from pdd_sglang.router.prompt import TokenEstimate
from pdd_sglang.router.shared_state import SharedState
from pdd_sglang.router.request_parsing import GenerateJob
from pdd_sglang.router.splice import SplicedUpdate, StreamSplicer


class FinishRecorder:
    def __init__(self, metrics: RouterMetrics, shared: SharedState,
                 kv_bytes_per_token: float, cfg: policy.PolicyConfig, estimate: TokenEstimate):
        self.metrics = metrics
        self.shared = shared  # the prefix mirrors, kept alike across workers
        self.estimate = estimate  # of text prompts' tokens: each answer's exact count teaches it
        self.kv_bytes_per_token = kv_bytes_per_token
        self.cfg = cfg

    def cancels_wan_copy(self, job: GenerateJob, placement: Placement,
                         splicer: StreamSplicer) -> bool:
        """Whether main's WAN copy goes too when the relay answered alone (policy's call)."""
        uncached = max(job.prompt.tokens - placement.main_cached_tokens, 0)
        return policy.cancel_wan_copy(uncached, len(splicer.emitted), self.cfg)

    def summary(self, job: GenerateJob, placement: Placement, splicer: StreamSplicer,
                clock: TokenClock, marks: dict) -> dict:
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
            # A text prompt's token count as placement estimated it (None: exact ids); the
            # answer's prompt_tokens is the servers' exact count.
            "estimated_prompt_tokens": None if job.prompt.exact else job.prompt.tokens,
            "marks": dict(marks),
            "router_worker": self.shared.worker,  # which of --workers answered
        }

    def record(self, job: GenerateJob, placement: Placement, splicer: StreamSplicer,
                       update: SplicedUpdate) -> None:
        outcome = splicer.outcome
        mode = "none"
        if outcome == "handoff":
            mode = str((splicer.handoff_info or {}).get("mode", "unknown"))
        label = "main_only" if outcome == "main" else outcome
        self.metrics.child(self.metrics.outcomes, label, mode).inc()
        prompt, exact_tokens = job.prompt, update.meta.get("prompt_tokens")
        if not prompt.exact and isinstance(exact_tokens, int):
            self.estimate.observe(prompt.text, exact_tokens)
        main = placement.main
        if main is None:
            return
        if outcome == "relay_finished":
            # Main caches the prompt only once its copy has landed: the attempt records it then
            # (attempt.py, main's copy after the relay answered alone).
            return
        actual = splicer.main_cached_tokens
        tokens = exact_tokens if isinstance(exact_tokens, int) else prompt.tokens
        self.metrics.child(self.metrics.wan_bytes_predicted, main.url).inc(
            max(prompt.tokens - placement.main_cached_tokens, 0) * self.kv_bytes_per_token)
        if isinstance(actual, int):
            self.metrics.child(self.metrics.wan_bytes, main.url).inc(
                max(tokens - actual, 0) * self.kv_bytes_per_token)
            self.metrics.mirror_error_tokens.observe(placement.main_cached_tokens - actual)
            self.shared.mirror_hit(main.url, prompt.key, prompt.key_length_of(actual))
        # Main keeps the prompt and the output's KV, all but the last token (never computed):
        # of a text prompt, the prompt's text and the answer's.
        self.shared.mirror_insert(main.url, prompt.key + (
            update.text if isinstance(prompt.key, str) else tuple(update.output_ids[:-1])))
