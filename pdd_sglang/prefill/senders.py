"""The prefill's PDD senders: threads that write one destination's part of one chunk.

Each sender takes :class:`~pdd_sglang.prefill.room.Work` from its own queue (the owner puts a
room's chunks for one destination on one queue, so they go out in prefill's order), writes it with
SGLang's own primitives (``send_kvcache`` or, between different TP sizes, ``send_kvcache_slice``,
then ``send_aux`` with the last chunk), and reports every item back to the owner, sent, failed or
skipped. A local sender serves relays over SGLang's engine; a WAN sender serves mains, and
``_transfer_data`` picks the WAN engine for a main's session (patch 0007; head slices: patch
0019, :mod:`pdd_sglang.prefill.tp_slices`).

A sender writes nothing of SGLang's: it reads ``request_status`` (a room SGLang ended is skipped)
and ``decode_kv_args_table`` (the destination's buffers, registered by SGLang's bootstrap thread
before the room's hello). An exception is a failed item, never a dead thread.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional

from pdd_sglang import seam
from pdd_sglang.prefill.ledger import LEDGER
from pdd_sglang.prefill.room import Work
from pdd_sglang.prefill.tp_slices import SAME_THREAD, LedgerScoped, is_sliced, page_bytes_to
from pdd_sglang.prefill.wan_coded import codec_for, finish_staged, send_coded
from pdd_sglang.prefill.wan_lines import CopyClass

logger = logging.getLogger(__name__)

YIELDED = "yielded"  # a copy put back on its line for a needed-now one that ranks ahead



def run_sender(kv_mgr: Any, work_queue: Any, executor: Any, report: Callable[[Any], None]) -> None:
    """A local sender's loop (relays) until the ``None`` sentinel."""
    while True:
        work = work_queue.get()
        if work is None:
            return
        work.started_at = time.monotonic()
        seam.aids.before_send(work)
        report(_send_and_judge(kv_mgr, work, executor, None))


def _send_and_judge(kv_mgr: Any, work: Work, executor: Any, lines: Any) -> Any:
    """The work's report (a ChunkSent), or YIELDED; an exception is a failed item."""
    from pdd_sglang.prefill.events import ChunkSent

    try:
        ok, reason = send_work(kv_mgr, work, executor, lines)
    except Exception as err:  # a bad chunk fails its destination, not the sender
        logger.exception("PDD: sending room %s to %s raised", work.room, work.session)
        ok, reason = False, f"PDD: sending to {work.session} raised {err!r}"
    return YIELDED if ok is YIELDED else ChunkSent(work, ok, reason)


def run_wan_sender(kv_mgr: Any, lines: Any, executor: Any, report: Callable[[Any], None]) -> None:
    """A WAN sender's loop until the lines stop: the best work of a free line
    (:class:`~pdd_sglang.prefill.wan_lines.WanLines`); a copy a needed-now one overtakes goes
    back to its line between two slices, unreported."""
    while True:
        work = lines.take()
        if work is None:
            return
        work.started_at = time.monotonic()  # the owner's stuck check: in a sender since
        if not work.pages_done:  # not a copy resumed after a yield
            seam.aids.before_send(work)
        outcome = _send_and_judge(kv_mgr, work, executor, lines)
        if outcome is YIELDED:
            lines.put_back(work)
            continue
        lines.release(work)
        report(outcome)


def _let_go(kv_mgr: Any, work: Work) -> bool:
    """The owner cancelled this work, or SGLang ended its room: skip what is left of it."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    status = kv_mgr.request_status.get(work.room)
    return work.cancelled or status is None or status == KVPoll.Failed


def _send_pages(kv_mgr: Any, work: Work, peer: Any, src: Any, dst: Any, executor: Any) -> int:
    """SGLang's own write of ``src`` pages to ``dst`` pages of the destination; 0 when sent.
    Between different TP sizes, its head slices: a main's layers on this thread (its windowed
    WAN copy), a relay's on the executor in this thread's ledger scope (:mod:`~pdd_sglang.
    prefill.tp_slices`)."""
    if not is_sliced(kv_mgr, peer):
        return kv_mgr.send_kvcache(
            work.session, src, peer.dst_kv_ptrs, dst, executor,
            dst_layer_ids=peer.dst_kv_layer_ids, dst_kv_item_len=peer.dst_kv_item_len,
            dst_attn_tp_size=peer.dst_attn_tp_size)
    layers = SAME_THREAD if work.role == "main" else LedgerScoped(executor)
    return kv_mgr.send_kvcache_slice(
        work.session, src, peer.dst_kv_ptrs, dst, peer.dst_tp_rank, peer.dst_attn_tp_size,
        peer.dst_kv_item_len, layers, peer.dst_kv_layer_ids)


def _send_to_main(kv_mgr: Any, work: Work, peer: Any, src: Any, dst: Any, executor: Any,
                  lines: Any) -> Any:
    """A chunk to main across the WAN: slices of the engine's ``slice_bytes`` inside one windowed
    copy of the WAN engine (:meth:`~pdd_sglang.prefill.wan_engine.WanTransferEngine.copy`), so the line
    stays full while the window holds, from ``work.pages_done`` on. True once every block
    landed, False if one failed, None when the owner cancelled it, YIELDED when a needed-now
    copy that ranks ahead of this one waits behind it (:meth:`WanLines.should_yield`). A cancel or a yield
    stops it within one window: what is in flight is waited out. The slices exist for those
    two: a whole chunk (up to --chunked-prefill-size tokens) handed to Mooncake at once could
    not be called back."""
    wan = kv_mgr.pdd_fanout.wan_engine
    page_bytes = page_bytes_to(kv_mgr, peer) or 1  # a head slice's, between TP sizes
    codec = codec_for(kv_mgr, work, is_sliced(kv_mgr, peer), len(src) * page_bytes)
    if codec is not None:  # records into main's staging ring, landed there (prefill/wan_coded.py)
        return send_coded(kv_mgr, work, src, dst, codec, lines, _let_go, YIELDED)
    with wan.copy(work.session) as copy:
        start = work.pages_done
        while start < len(src):
            if start:
                if _let_go(kv_mgr, work):  # free the line now, not after the chunk
                    return None
                if lines is not None and lines.should_yield(work):
                    lines.hand_over(work)  # the other copy starts beside this window
                    return YIELDED if copy.finish() else False
            window = copy.window_for_next_slice(
                work.copy_class is CopyClass.CACHE_ONLY or work.relay_covered)
            step = max(window.slice_bytes // page_bytes, 1)
            if _send_pages(kv_mgr, work, peer, src[start:start + step], dst[start:start + step],
                           executor) != 0:
                return False
            if work.copy_class is not None:  # the line report's bytes by class
                kv_mgr.pdd_fanout.wan_line.handed(
                    work.session, work.copy_class.value,
                    (min(start + step, len(src)) - start) * page_bytes)
            start = work.pages_done = min(start + step, len(src))
        return copy.finish()


def send_work(kv_mgr: Any, work: Work, executor: Any, lines: Any = None) -> tuple[Any, Optional[str]]:
    """``(True, None)`` sent, ``(False, reason)`` failed, ``(None, None)`` skipped, ``(YIELDED,
    None)`` put back for a needed-now copy (main-bound work from ``lines`` only)."""
    if _let_go(kv_mgr, work):
        return None, None
    chunk, info = work.chunk, work.destination
    if chunk.wait_event is not None:  # overlap scheduling: the forward that wrote this KV
        chunk.wait_event.synchronize()
        chunk.wait_event = None
    if chunk.indices_event is not None:
        chunk.indices_event.synchronize()
        chunk.indices_event = None
    src = chunk.prefill_kv_indices
    if hasattr(src, "numpy"):
        src = src.numpy()
    peer = kv_mgr.decode_kv_args_table.get(work.session)
    if peer is None:
        return False, f"PDD: {work.session} never registered its KV buffers"
    dst = info.dst_kv_indices[chunk.index_slice]
    src = src[: len(dst)]
    if not work.pages_done:
        LEDGER.begin(work.room, work.session, len(src))
    if len(src) and kv_mgr.kv_args.kv_data_ptrs:
        if work.role == "main":
            sent = _send_to_main(kv_mgr, work, peer, src, dst, executor, lines)
            if sent is YIELDED:
                return YIELDED, None
        else:
            sent = _send_pages(kv_mgr, work, peer, src, dst, executor) == 0
        if sent is None:
            return None, None
        if not sent:
            return False, (f"PDD: a KV chunk of room {work.room} to {work.role} "
                           f"{work.session} failed")
    if work.role == "main" and not finish_staged(kv_mgr, work):
        return False, f"PDD: the end record of room {work.room}'s coded copy to {work.session} failed"
    if chunk.is_last_chunk:
        if kv_mgr.send_aux(info, chunk.prefill_aux_index, peer.dst_aux_ptrs) != 0:
            return False, f"PDD: the aux data of room {work.room} to {work.role} {work.session} failed"
    return True, None
