"""Prefill and decode at different TP sizes: how PDD's senders use SGLang's head slicing.

SGLang pairs a prefill rank with the ranks of a decode at another TP size by whole ratios, and
writes each decode rank the KV heads it holds with ``send_kvcache_slice``: per layer, K and V, one
Mooncake transfer per token slot (its heads are a strided part of each slot), following SGLang's
own rule where KV heads are fewer than ranks (replicated heads: ``compute_head_slice_params``).
PDD's senders call it as SGLang's transfer worker does (:func:`~pdd_sglang.prefill.senders.
_send_pages`), and patch 0019 sends its batches through PDD's engine choice and ledger. What this
module adds:

- **The executor.** ``send_kvcache_slice`` submits each layer to the executor it is handed and
  waits for them all. For a main the layers must run on the sender thread itself: the WAN engine's
  windowed copy (:meth:`~pdd_sglang.prefill.wan_engine.WanTransferEngine.copy`) belongs to the
  thread that opened it, and a batch from any other thread is a copy of its own, waited for before
  it returns (one synchronous round trip per layer instead of a window in flight).
  :data:`SAME_THREAD` runs each layer inline and hands back a completed future. A relay's layers
  keep the executor's threads (next door, in parallel), each in the sender's ledger scope
  (:class:`LedgerScoped`), so their bytes count to the request as well as to the destination.
- **The bytes.** A sliced page carries only the destination rank's heads (:func:`page_bytes_to`):
  the size of a WAN slice and the bytes a main's line is charged with.

Threads: whichever sender thread calls; nothing here holds state.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Callable

from pdd_sglang.prefill.ledger import LEDGER


class SameThreadExecutor:
    """The part of ``concurrent.futures.Executor`` that ``send_kvcache_slice`` uses: ``submit``
    runs the call now, on the calling thread, and returns its completed future."""

    def submit(self, fn: Callable, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as err:  # as a pool's future carries it to result()
            future.set_exception(err)
        return future


SAME_THREAD = SameThreadExecutor()


class LedgerScoped:
    """An executor whose calls run in the submitting thread's ledger scope (the room and
    destination its sender opened), so batches a worker thread writes are charged to the
    request, not only to the destination."""

    def __init__(self, executor: Any):
        self.executor = executor

    def submit(self, fn: Callable, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        return self.executor.submit(LEDGER.run_in_scope, LEDGER.scope(), fn, *args, **kwargs)


def is_sliced(kv_mgr: Any, peer: Any) -> bool:
    """Whether SGLang writes this destination rank head slices rather than whole pages: an
    MHA/GQA model at another attention TP size (MLA's latent KV is whole on every rank)."""
    mla = kv_mgr.is_mla_backend or getattr(kv_mgr, "is_hybrid_mla_backend", False)
    return not mla and kv_mgr.attn_tp_size != peer.dst_attn_tp_size


def page_bytes_to(kv_mgr: Any, peer: Any) -> int:
    """KV bytes one page of this prefill rank carries to the destination rank ``peer`` (SGLang's
    registration of it, ``decode_kv_args_table``; None before it registered: a whole page)."""
    whole = sum(kv_mgr.kv_args.kv_item_lens)
    if peer is None or not is_sliced(kv_mgr, peer):
        return whole
    from sglang.srt.disaggregation.common.staging_buffer import (compute_head_slice_params,
                                                                 resolve_total_kv_heads)

    total_heads = resolve_total_kv_heads(kv_mgr.kv_args, kv_mgr.attn_tp_size)
    _, heads_sent, _, _ = compute_head_slice_params(
        kv_mgr.attn_tp_size, peer.dst_attn_tp_size, kv_mgr.kv_args.engine_rank,
        peer.dst_tp_rank, total_heads)
    own_heads = max(1, total_heads // kv_mgr.attn_tp_size)
    return whole * heads_sent // own_heads
