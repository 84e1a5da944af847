"""State that PDD adds to SGLang's ``/server_info`` (``internal_states[i]["pdd"]``).

Tests and benchmarks read it from outside the server process: KV pool occupancy and radix-tree
locks (to assert that nothing leaks), and the sender-side transfer ledger.
"""

from __future__ import annotations

from typing import Any

from pdd_sglang.diagnostics import kv_digest
from pdd_sglang.lifecycle import kv_manager_of
from pdd_sglang.prefill.ledger import LEDGER


def pool_state(scheduler: Any) -> dict:
    tree = scheduler.tree_cache
    allocator = scheduler.token_to_kv_pool_allocator
    available = int(allocator.available_size())
    evictable = int(tree.evictable_size())
    total = int(scheduler.max_total_num_tokens)
    return {
        "max_total_num_tokens": total,
        "available_tokens": available,
        # Held by the radix tree but free to evict: a cache, not a leak.
        "evictable_tokens": evictable,
        # Held by a lock_ref > 0 on a tree node: must be 0 when the server is idle.
        "locked_tokens": int(tree.protected_size()),
        # Neither free nor cached: held by live requests. Must be 0 when idle.
        "in_use_tokens": total - available - evictable,
        "free_request_slots": int(scheduler.req_to_token_pool.available_size()),
    }


def wan_line_state(kv_mgr: Any) -> dict | None:
    """Prefill's WAN line per main Mooncake session (congestion-aware placement reads it)."""
    fanout = getattr(kv_mgr, "pdd_fanout", None)
    return None if fanout is None else fanout.wan_line.snapshot()


def fanout_state(kv_mgr: Any) -> dict | None:
    """The prefill fan-out's counters, open rooms and mains out (its owner's published view)."""
    fanout = getattr(kv_mgr, "pdd_fanout", None)
    return None if fanout is None else fanout.published


def add_pdd_state(scheduler: Any, state: dict) -> None:
    kv_mgr = kv_manager_of(scheduler)
    engine = getattr(kv_mgr, "engine", None)
    state["pdd"] = {
        "pool": pool_state(scheduler),
        "transfers": LEDGER.snapshot(),
        "kv_digests": kv_digest.snapshot(),
        # This server's Mooncake session: a main's is the key of prefill's wan_line entry for it.
        "mooncake_session": engine.get_session_id() if engine is not None else None,
        "wan_line": wan_line_state(kv_mgr),
        "fanout": fanout_state(kv_mgr),
    }
    from pdd_sglang.decode import handoff_for

    handoff = handoff_for(scheduler)
    if handoff is not None:
        state["pdd"]["handoff"] = handoff.state()
