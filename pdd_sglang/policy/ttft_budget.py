"""The policy's rules for a TTFT budget (``--ttft-slo-ms``): P->MD while main alone is predicted
within the budget, P->RLD->MD while the relay has headroom, P->MD over budget otherwise. Pure and
deterministic, as the rest of :mod:`pdd_sglang.policy`, which re-exports every name here."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

from pdd_sglang.policy.config import DEFAULT_POLICY, Pipeline, PolicyConfig, _require_non_negative


@dataclass(frozen=True)
class MainTtft:
    """The TTFT predicted through main alone (P->MD): queue at prefill, prefill's forward over
    the uncached prompt, and main's copy behind the line (predict_wan_seconds_on_line)."""

    queue_s: float
    prefill_s: float
    wan_s: float

    def __post_init__(self) -> None:
        for name in ("queue_s", "prefill_s", "wan_s"):
            _require_non_negative(name, getattr(self, name))

    @property
    def total_s(self) -> float:
        return self.queue_s + self.prefill_s + self.wan_s


class BudgetVerdict(str, enum.Enum):
    """How a placement stands against the request's TTFT budget (the router counts them)."""
    WITHIN = "within"  # P->MD predicted within it, or the relay hides the WAN
    OVER = "over"  # neither: the relay had no headroom (or none is there), P->MD over budget
    NO_BUDGET = "no_budget"  # no budget given: hide_wan_below_s decided


class BudgetPlacement(NamedTuple):
    pipeline: Pipeline
    verdict: BudgetVerdict


def prefill_seconds(tokens: float, tokens_per_s: float | None) -> float:
    """Prefill time of ``tokens`` at a measured or configured rate; 0 when no rate is known."""
    _require_non_negative("tokens", tokens)
    return tokens / tokens_per_s if tokens_per_s and tokens_per_s > 0 else 0.0


def place_by_ttft_budget(main: MainTtft, budget_s: float | None, relay_utilisation: float | None,
                         cfg: PolicyConfig = DEFAULT_POLICY) -> BudgetPlacement:
    """P->MD or P->RLD->MD for a TTFT budget, trading relay capacity for TTFT only when needed.

    - no budget (``budget_s`` None): hide_wan_below_s decides, as choose_pipeline does;
    - P->MD when the predicted TTFT through main (queue + prefill + WAN copy) fits the budget:
      the relay, whose GPUs sit in the expensive datacenter, is kept for requests that need it;
    - otherwise P->RLD->MD while the relay has headroom (``relay_utilisation`` below
      cfg.relay_full_utilisation; None: no usable relay): its first token comes after queue and
      prefill alone, no WAN (over budget only if those alone miss it);
    - a full relay (or none): P->MD anyway, counted over budget.
    """
    if budget_s is None:
        pipeline = (Pipeline.PREFILL_MAIN if main.wan_s < cfg.hide_wan_below_s
                    else Pipeline.PREFILL_RELAY_MAIN)
        return BudgetPlacement(pipeline, BudgetVerdict.NO_BUDGET)
    if not budget_s > 0:
        raise ValueError(f"budget_s must be > 0, got {budget_s!r}")
    if main.total_s <= budget_s:
        return BudgetPlacement(Pipeline.PREFILL_MAIN, BudgetVerdict.WITHIN)
    if relay_utilisation is not None and relay_utilisation < cfg.relay_full_utilisation:
        fits = main.queue_s + main.prefill_s <= budget_s
        return BudgetPlacement(Pipeline.PREFILL_RELAY_MAIN,
                               BudgetVerdict.WITHIN if fits else BudgetVerdict.OVER)
    return BudgetPlacement(Pipeline.PREFILL_MAIN, BudgetVerdict.OVER)
