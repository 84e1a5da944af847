"""State that PDD adds to SGLang's ``/server_info`` (``internal_states[i]["pdd"]``).

Tests and benchmarks read it from outside the server process: KV pool occupancy and radix-tree
locks (to assert that nothing leaks), and each role's own figures (the prefill's transfer ledger,
WAN line and fan-out; a decode server's handoff).

This module reads no role: each role registers what it adds (:func:`register_state`), on import
of its package (``pdd_sglang/prefill/__init__.py``, ``pdd_sglang/decode/__init__.py``), and
``hooks.add_internal_state`` imports both before it asks for the state. Owner of
:data:`_PROVIDERS`: this module; the roles write it only through :func:`register_state`.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from pdd_sglang.diagnostics import kv_digest
from pdd_sglang.lifecycle import kv_manager_of

# (scheduler, its KV manager or None) -> a JSON-able value for the key, or OMIT to leave it out.
StateProvider = Callable[[Any, Any], Any]
OMIT = object()
# Key of state["pdd"] -> the role's provider, in registration order.
_PROVIDERS: dict[str, StateProvider] = {}


def register_state(key: str, provider: StateProvider) -> None:
    """A role's part of ``state["pdd"]``: ``provider(scheduler, kv_mgr)`` answers ``key``.

    Registering a key again replaces its provider (a role module imported twice in tests)."""
    if key in ("pool", "kv_digests", "mooncake_session", "kv_bytes_per_token", "context_length"):
        raise ValueError(f"{key!r} is diagnostics' own part of the PDD state")
    _PROVIDERS[key] = provider


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


def kv_bytes_per_token(scheduler: Any) -> Optional[float]:
    """KV bytes one token of the whole model costs (every layer, every KV head, all TP ranks
    together): what a WAN copy carries per token, which the router's placement predicts with.
    From SGLang's model config and the dtype its KV pool stores; None for a layout this does not
    size (the router then asks its operator for ``--kv-bytes-per-token``)."""
    config = scheduler.model_config
    itemsize = getattr(getattr(scheduler.token_to_kv_pool_allocator.get_kvcache(), "dtype", None),
                       "itemsize", None)
    layers = getattr(config, "num_attention_layers", None) or config.num_hidden_layers
    if not itemsize or not layers:
        return None
    if getattr(config, "kv_lora_rank", None):  # MLA: one latent vector and its rope part
        return float(layers * (config.kv_lora_rank + config.qk_rope_head_dim) * itemsize)
    head_dim = config.head_dim
    v_head_dim = getattr(config, "v_head_dim", None) or head_dim
    return float(layers * config.get_total_num_kv_heads() * (head_dim + v_head_dim) * itemsize)


def add_pdd_state(scheduler: Any, state: dict) -> None:
    kv_mgr = kv_manager_of(scheduler)
    engine = getattr(kv_mgr, "engine", None)
    pdd = state["pdd"] = {
        "pool": pool_state(scheduler),
        "kv_bytes_per_token": kv_bytes_per_token(scheduler),
        "context_length": int(scheduler.model_config.context_len),
        "kv_digests": kv_digest.snapshot(),
        # This server's Mooncake session: a main's is the key of prefill's wan_line entry for it.
        "mooncake_session": engine.get_session_id() if engine is not None else None,
    }
    for key, provider in _PROVIDERS.items():
        value = provider(scheduler, kv_mgr)
        if value is not OMIT:
            pdd[key] = value
