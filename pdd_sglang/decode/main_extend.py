"""Main's handoff EXTEND: the state of a held request, and the steps that turn handed tokens into
an EXTEND batch and merge it into the running decode batch (life cycle steps 4-5 of
:mod:`pdd_sglang.decode.main`)."""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field
from typing import Any, Optional

from pdd_sglang.decode.handoff_grammar import advance_over_output
from pdd_sglang.protocol.messages import HandoffAck, HandoffRefused

logger = logging.getLogger(__name__)


def ended_by_abort(req: Any) -> bool:
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    return isinstance(req.finished_reason, FINISH_ABORT) or bool(getattr(req, "to_abort", False))


def finish_type(req: Any) -> str:
    """``length``, ``stop``, ...: SGLang's own name for how a request ended."""
    reason = req.finished_reason
    return (reason.to_json().get("type") if reason is not None else None) or "unknown"


class Held(enum.Enum):
    DIGESTING = "digesting"  # --pdd-enable-kv-digest: hashing the KV that crossed, off-thread
    AWAITING_TOKENS = "awaiting_tokens"  # HandoffReady sent, or a middle chunk acknowledged
    TOKENS_QUEUED = "tokens_queued"  # a chunk's tokens appended; its extend not yet scheduled
    EXTENDING = "extending"  # its extend batch is running (SGLang owns the request meanwhile)


@dataclass
class _Parked:
    req: Any
    relay: str  # the relay's control address
    ready_at: float
    deadline: float  # restarted by every absorbed chunk: it measures the relay's silence
    state: Held = Held.AWAITING_TOKENS
    seq: int = 0  # next chunk expected
    handed: int = 0  # positions [0, handed) of the relay's output received
    own_tokens: int = 1  # output tokens main had before the handoff (prefill's first token)
    digest: Any = None  # kv_digest.PendingHashes while DIGESTING
    digest_start: int = 0
    chunks_absorbed: int = 0  # extends run; after the first, main cannot decode alone
    grammar_at: int = 0  # output positions its grammar has accepted (held before any: see hold)
    is_last: bool = False
    chunk_seq: int = -1


@dataclass
class _RunningExtend:
    batch: Any
    parked: list = field(default_factory=list)


def extend_candidates(ready: list, room_for: int) -> list:
    """The queued chunks one extend batch takes: at most ONE middle Catch-Up chunk, and last
    chunks while the running batch has room (a last chunk joins it; a middle one does not).

    SGLang streams nothing of a request whose extend is a middle chunk only for one request a
    batch (``batch_result_processor``: "at most one request being currently chunked", its
    ``skip_stream_req``). A second middle chunk in the same batch streamed its output ids from
    position 0, the relay's handed tokens, and the router, counting main's start as
    completion_tokens less the ids it got, placed main's stream 64 or 128 positions early and
    refused the splice ("servers disagree on positions 42..170"): one request a PDD setup at
    the demo's load point, every run, each re-placed after a 10 s stall."""
    middle = [p for p in ready if not p.is_last][:1]
    return middle + [p for p in ready if p.is_last][:max(0, room_for)]


class ExtendSteps:
    """The EXTEND half of :class:`pdd_sglang.decode.main.MainHandoff` (its state lives there)."""

    def _next_extend(self, running_batch: Any) -> Optional[Any]:
        ready = [p for p in self.parked.values() if p.state is Held.TOKENS_QUEUED]
        if not ready or self._running is not None:
            return None
        scheduler = self.scheduler
        room_for = min(scheduler.req_to_token_pool.size, scheduler.max_running_requests)
        room_for -= running_batch.batch_size()
        ready = self._fit_memory(extend_candidates(ready, room_for))
        ready = [parked for parked in ready if self._advance_grammar(parked)]
        if not ready:
            return None
        from sglang.srt.managers.schedule_batch import ScheduleBatch

        for parked in ready:
            self._prepare_req(parked)
            parked.state = Held.EXTENDING
        batch = ScheduleBatch.init_new(
            [p.req for p in ready], scheduler.req_to_token_pool,
            scheduler.token_to_kv_pool_allocator, scheduler.tree_cache, scheduler.model_config,
            scheduler.enable_overlap, scheduler.spec_algorithm)
        batch.prepare_for_extend()
        self._running = _RunningExtend(batch, ready)
        self.stats.event("extend_batches")
        return batch

    def _advance_grammar(self, parked: _Parked) -> bool:
        """Advance a constrained request's grammar over the tokens this extend absorbs
        (:mod:`pdd_sglang.decode.handoff_grammar`); one it refuses is not extended: main drops
        its copy with the reason and tells the relay, which answers the request itself."""
        req = parked.req
        before = parked.grammar_at
        parked.grammar_at, refusal = advance_over_output(req, before)
        if req.grammar is not None:
            self.stats.event("grammar_tokens_accepted", parked.grammar_at - before)
        if refusal is None:
            return True
        self.stats.refuse("grammar_refused")
        logger.warning("PDD main: refused the handoff of room %s: %s", req.bootstrap_room, refusal)
        self._abort(parked, f"PDD handoff refused: {refusal}", notify_relay="grammar_refused")
        return False

    def _fit_memory(self, ready: list) -> list:
        """Those that fit in free (or evictable) KV now; the others wait a step."""
        scheduler = self.scheduler
        page = max(1, int(scheduler.token_to_kv_pool_allocator.page_size))
        budget = (int(scheduler.token_to_kv_pool_allocator.available_size())
                  + int(scheduler.tree_cache.evictable_size()))
        fits = []
        for parked in ready:
            need = len(parked.req.output_ids) + len(parked.req.origin_input_ids)
            need = need - parked.req.kv.kv_committed_len + page
            if need <= budget:
                budget -= need
                fits.append(parked)
        return fits

    def _prepare_req(self, parked: _Parked) -> None:
        req = parked.req
        if parked.chunks_absorbed == 0:
            # What SGLang's prebuilt step would have counted: main's own radix hit beyond what
            # prefill reported; the transferred prompt is not a cache hit.
            delta = max(0, req.prefix_len - req.already_computed)
            req.cached_tokens += delta
            req.cached_tokens_device += delta
            req._cache_breakdown_computed = True
            req.time_stats.set_wait_queue_entry_time()
        # Everything in the row is the prefix; the extend is every output token without KV.
        req.prefix_len = req.kv.kv_committed_len
        req.already_computed = req.prefix_len
        req.refresh_fill_ids()
        req.extend_end = len(req.full_untruncated_fill_ids)
        if parked.is_last:
            # The client has the handed tokens from the relay: main's stream starts after them.
            req.send_token_offset = len(req.output_ids)
        else:
            # A middle Catch-Up chunk samples nothing: SGLang's middle-chunk path.
            req.inflight_middle_chunks = 1

    def _merge_finished_extend(self, running_batch: Any) -> Any:
        running, self._running = self._running, None
        if running is None:
            return running_batch
        batch = running.batch
        keep = []
        now = self._clock()
        for index, parked in enumerate(running.parked):
            room = parked.req.bootstrap_room
            parked.chunks_absorbed += 1
            if parked.is_last:
                self.parked.pop(room, None)
                if ended_by_abort(parked.req):  # aborted meanwhile: the relay answers it
                    self.loop.send(parked.relay, HandoffRefused(room=room,
                                                                reason="aborted_at_main"))
                    continue
                if parked.req.finished():
                    # Its first token after the handoff ended it (a stop token, its length):
                    # SGLang streamed and freed it with the extend; main has every handed token.
                    self.stats.event(f"finished_at_extend_{finish_type(parked.req)}")
                # The relay keeps the request until this ack: main has every handed token.
                self.loop.send(parked.relay, HandoffAck(room=room, seq=parked.chunk_seq))
                self.stats.event("handoffs_absorbed")
                self.stats.duration(now - parked.ready_at)
                if not parked.req.finished():
                    keep.append(index)
            elif parked.req.finished():  # aborted meanwhile, or ended at a middle chunk
                self.parked.pop(room, None)
            else:
                # Progress: the relay has until a full timeout from now for the next chunk.
                parked.state = Held.AWAITING_TOKENS
                parked.deadline = now + self.args.pdd_handoff_timeout
                self.loop.send(parked.relay, HandoffAck(room=room, seq=parked.chunk_seq))
        batch.filter_batch(keep_indices=keep)
        if batch.is_empty():
            return running_batch
        if running_batch.is_empty():
            return batch
        running_batch.merge_batch(batch)
        return running_batch
