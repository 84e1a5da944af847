"""The one PDD policy: placement, handoff mode and singular-traffic decisions.

The router, the relay decode server and the simulator all import their decisions from here, so a
policy change is tested once and behaves the same in simulation and in production.  Pure Python,
stdlib only, no I/O, no clocks: every function is a deterministic function of its arguments.

Its parts, each re-exported here: :mod:`~pdd_sglang.policy.config` (the pipelines, handoff modes
and ``PolicyConfig``), :mod:`~pdd_sglang.policy.placement` (the WAN copy's predicted time, the
pipeline, the main, whether main's copy goes on), :mod:`~pdd_sglang.policy.handoff` (the handoff's
mode and chunks), :mod:`~pdd_sglang.policy.ttft_budget` (placement by a TTFT budget),
:mod:`~pdd_sglang.policy.wan_codec` (a WAN copy's codec) and :mod:`~pdd_sglang.policy.wan_order`
(which copy a WAN line serves next).

Vocabulary (the brief's roles, spelled out):
  prefill  (P)   computes the prompt's KV, in datacenter A.
  relay    (RLD) decodes eagerly next to prefill (RDMA) while the WAN copy is in flight.
  main     (MD)  decodes behind the WAN, in datacenter B, with its own radix cache (DRC).
"""


from pdd_sglang.policy.config import (DEFAULT_POLICY, HandoffMode, Pipeline,  # noqa: F401
                                      PolicyConfig, _require_at_least_one, _require_non_negative)
from pdd_sglang.policy.handoff import (HandoffChunk, RelayLoad, choose_handoff_mode,  # noqa: F401
                                       next_handoff_chunk, relay_finishes_locally)
from pdd_sglang.policy.placement import (IDLE_LINE, LineState, MainCandidate,  # noqa: F401
                                         cancel_wan_copy, choose_main, choose_pipeline,
                                         predict_wan_seconds, predict_wan_seconds_on_line)
from pdd_sglang.policy.ttft_budget import (BudgetPlacement, BudgetVerdict,  # noqa: F401
                                           MainTtft, place_by_ttft_budget, prefill_seconds)
from pdd_sglang.policy.wan_order import (BACKGROUND_IN_FLIGHT_S,  # noqa: F401
                                         CACHE_ONLY_BACKLOG_S, DEADLINE_STRETCH,
                                         background_in_flight_bytes, copy_deadline, copy_tier)
