"""The relay decode server's side of the handoff: decode eagerly, then hand token IDs to main.

Life cycle of a P->RLD->MD request on a relay:

1. Prefill sends the prompt KV over the local RDMA path; SGLang's decode scheduler admits the
   request and the relay decodes and streams tokens at once: the "eager output tokens".
2. Main, once its own copy of the prompt KV has crossed the WAN, sends ``HandoffReady(room)``
   on the control channel (:mod:`pdd_sglang.protocol.control_channel`); the control thread queues it.
3. Between two decode steps, :meth:`RelayHandoff.step` picks the mode from the relay's live load
   (:func:`pdd_sglang.policy.choose_handoff_mode`) and sends ``HandoffTokens`` with the output
   IDs so far, 4 bytes per token.
   - One-Shot: one message with every token (the last chunk).
   - Catch-Up: a chunk of ``--pdd-catch-up-chunk`` tokens, and the relay keeps decoding; each
     ``HandoffAck`` from main releases the next chunk, and once the rest fits in one chunk that
     chunk is the last.
   With the last chunk sent, the relay stops decoding the request (it leaves the batch, keeping
   its KV) until main acknowledges that chunk too: main has absorbed every handed token and
   streams from there. Only then does the relay finish it with the ``pdd_handoff`` finish reason
   (its last stream chunk says how many tokens it handed) and free its KV.
4. Singular filter: if the relay finishes the request itself (EOS, stop, length) before main is
   ready, its answer is the whole answer; a later ``HandoffReady`` is answered with
   ``HandoffRefused("finished_at_relay")`` so main frees its slots, and the router aborts main's
   and prefill's copies (cancelling a WAN transfer still running).
5. If main refuses a chunk (bad input, disagreeing tokens, timeout, shutdown), or does not
   acknowledge a chunk within ``FINAL_ACK_WAIT_S`` (a middle one or the last), the relay decodes
   on to the end; a request
   that left the batch for the handoff goes back through SGLang's waiting queue (as a retracted
   request does) and resumes from its last token. A handoff gone wrong never costs the client
   its answer while the relay has the request.
6. With ``--pdd-enable-kv-digest`` the relay hashes each request's prompt KV as it lands, and
   checks the digest in main's ``HandoffReady`` against its own copy before handing anything
   over; on a mismatch it answers ``HandoffRefused("kv_digest_mismatch")`` and decodes the
   request to the end itself (:mod:`pdd_sglang.diagnostics.kv_digest`).
7. At ``--tp-size`` > 1 only TP rank 0 binds the control channel; each step's messages and clock
   are rank 0's, broadcast to every rank (:mod:`pdd_sglang.decode.tp_sync`), so every rank takes
   the same decisions on the same batch, and only rank 0's messages reach main.

Owner: the scheduler thread (each TP rank's own); the control loop's thread only queues messages.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Any, Optional

from pdd_sglang import policy, seam
from pdd_sglang.diagnostics import kv_digest
from pdd_sglang.decode.handoff_channel import HandoffStats, policy_config, relay_loop
from pdd_sglang.decode.finish import HandedOff
from pdd_sglang.decode.relay_state import Handing, Active, Pending
from pdd_sglang.decode.route_cache import is_relay_main, route_for
from pdd_sglang.decode.tp_sync import FollowerLoop, RankInputs
from pdd_sglang.protocol.messages import (FINISHED_AT_RELAY, HandoffAck, HandoffReady,
                                          HandoffRefused, HandoffTokens, encode, pack_tokens)

logger = logging.getLogger(__name__)

FINISHED_ROOMS_KEPT = 8192
REFUSED_ROOMS_KEPT = 1024  # rooms refused lately: a HandoffAck that crossed the refusal
# A HandoffReady may beat the relay's own copy of the request into its running batch (the
# relay's prebuilt step lags a little); past this, the room is unknown.
READY_WAIT_S = 30.0
# Main acknowledges the last chunk once its extend ran (a step and a round trip); past this the
# relay takes the request back (main died, or is far behind) and answers it itself. The client
# waits at most this long for the rest of a handed request whose main died at that moment.
FINAL_ACK_WAIT_S = 10.0
# Rooms whose prompt-KV hashes the relay keeps for main's digest (8 bytes per prompt token each);
# a room's go once main's HandoffReady is answered.
KV_HASHED_ROOMS_KEPT = 1024


class RelayHandoff:
    def __init__(self, scheduler: Any, args: Any):
        self.scheduler = scheduler
        self.args = args
        self.cfg = policy_config(args)
        self.ranks = RankInputs.for_scheduler()
        self.loop = relay_loop(args) if self.ranks.leader else FollowerLoop()
        self._now = time.monotonic()  # at TP > 1: rank 0's clock at the latest step
        self.stats = HandoffStats("relay")
        self.pending: dict[int, Pending] = {}
        self.active: dict[int, Active] = {}
        self.finished_rooms: OrderedDict[int, str] = OrderedDict()
        self.refused_rooms: OrderedDict[int, str] = OrderedDict()  # the latest, with the reason
        # Requests this relay took out of SGLang's batch, their row and KV kept (a last chunk
        # waiting for main's ack; or an aid's, pdd_sglang.seam): out of SGLang's reach, so the
        # relay resumes, finishes or aborts each itself.
        self.out_of_batch: dict[int, Any] = {}
        # --pdd-enable-kv-digest: each room's prompt-KV hashes, computed off the scheduler thread.
        self.kv_hashes: OrderedDict[int, kv_digest.PendingHashes] = OrderedDict()
        self._hashed: dict[int, bytes] = {}  # this step's whole-KV hashes of awaited rooms
        self._closed = False
        logger.info("PDD relay control channel at %s", self.loop.address)

    # ---- hooks -----------------------------------------------------------------------------
    def hold(self, transferred: list) -> list:
        if self.args.pdd_enable_kv_digest:
            for req in transferred:
                if is_relay_main(req) and not req.finished():
                    self.kv_hashes[req.bootstrap_room] = kv_digest.PendingHashes.start(
                        self.scheduler, req, background=True)
            while len(self.kv_hashes) > KV_HASHED_ROOMS_KEPT:
                self.kv_hashes.popitem(last=False)
        return transferred  # the relay decodes every request at once

    def step(self, running_batch: Any) -> tuple[Any, None]:
        """Between two decode steps: act on main's messages, send tokens, finish handed requests."""
        if self._closed:
            return running_batch, None
        self._note_finished({req.bootstrap_room: req for req in running_batch.reqs
                             if is_relay_main(req)})
        messages, now, _ = self.ranks.share(self.loop)
        self._now = now
        for peer, message in messages:
            self._on_message(peer, message)
        if self.ranks.size == 1:
            now = time.monotonic()
        return seam.aids.relay_hand_off(self, running_batch, now, self._hand_off), None

    def _hand_off(self, running_batch: Any, now: float) -> Any:
        """Answer main's pending requests, send the next chunks, give up on what timed out, and
        take a request whose last chunk is out of the batch; the batch left to decode."""
        reqs = {req.bootstrap_room: req for req in running_batch.reqs if is_relay_main(req)}
        reqs.update(self.out_of_batch)
        awaited = {room: self.kv_hashes[room] for room, pending in self.pending.items()
                   if pending.ready.kv_digest and room in self.kv_hashes}
        self._hashed = self.ranks.whole_kv_hashes(awaited)  # every rank's heads, combined
        for room, pending in list(self.pending.items()):
            if room in awaited and room not in self._hashed:
                continue  # the relay's own hashes are not done yet: answer at a later step
            if room in self.finished_rooms:
                del self.pending[room]
                self.stats.event("singular_finished_at_relay")
                self._refuse(pending.peer, room, self._kv_verdict(pending.ready)
                             or self.finished_rooms[room])
                continue
            req = reqs.get(room)
            if req is None or req.finished():
                if req is None and not self._room_queued(room):
                    # Finished before it reached the running batch, aborted, or never here.
                    del self.pending[room]
                    self._refuse(pending.peer, room, "unknown_room")
                elif now - pending.since > READY_WAIT_S:
                    del self.pending[room]
                    self._refuse(pending.peer, room, "relay_not_ready")
                continue
            del self.pending[room]
            refusal = self._kv_verdict(pending.ready)
            if refusal is not None:  # main's copy is damaged: the relay decodes on to the end
                self._refuse(pending.peer, room, refusal)
                continue
            self._start(room, req, pending.peer)
        for room, active in list(self.active.items()):
            if active.state is Handing.SENDING:
                self._send_next_chunk(room, active)
            elif (active.state is Handing.AWAITING_FINAL_ACK
                  and now - active.last_sent_at > FINAL_ACK_WAIT_S):
                del self.active[room]
                self._refuse(active.peer, room, "final_ack_timeout", chunks_out=True)
                self._resume(active.req, "main did not acknowledge the last chunk")
            elif active.state is Handing.AWAITING_ACK and (
                    active.req.finished() or now - active.last_sent_at > FINAL_ACK_WAIT_S):
                # Mid Catch-Up the request is in the batch: it just stops being handed.
                del self.active[room]
                why = FINISHED_AT_RELAY if active.req.finished() else "ack_timeout"
                self._refuse(active.peer, room, why, chunks_out=True)
                logger.warning("PDD relay: room %s left mid Catch-Up (%s); decoded here", room, why)
        # A request whose last chunk is out stops decoding here until main says it has it.
        leaving = [a.req for a in self.active.values() if a.state is Handing.AWAITING_FINAL_ACK]
        leaving = [req for req in leaving if any(req is r for r in running_batch.reqs)]
        return self._leave_batch(running_batch, leaving)

    def idle(self) -> bool:
        return not self.pending and not self.active and not self.out_of_batch

    def abort(self, abort_req: Any) -> None:
        """Requests out of the batch are not in SGLang's reach: abort them here."""
        for room, req in list(self.out_of_batch.items()):
            if abort_req.abort_all or req.rid.startswith(abort_req.rid):
                active = self.active.pop(room, None)
                if active is not None:
                    self._refuse(active.peer, room, "aborted_at_relay", chunks_out=True)
                self._abort(req, "aborted by the client")

    def _abort(self, req: Any, message: str) -> None:
        from http import HTTPStatus

        from sglang.srt.disaggregation.utils import prepare_abort
        from sglang.srt.mem_cache.common import release_kv_cache

        self.out_of_batch.pop(req.bootstrap_room, None)
        prepare_abort(req, message, status_code=HTTPStatus.SERVICE_UNAVAILABLE)
        self.scheduler.output_streamer.stream_output([req], req.return_logprob)
        release_kv_cache(req, self.scheduler.tree_cache, checkpoint=False)
        self.stats.event("aborted")

    def state(self) -> dict:
        return {**self.stats.snapshot(self.loop), "pending": len(self.pending),
                "active": len(self.active), "out_of_batch": len(self.out_of_batch)}

    # ---- messages --------------------------------------------------------------------------
    def _on_message(self, peer: bytes, message: Any) -> None:
        if isinstance(message, HandoffReady):
            room = message.room
            if room in self.pending or room in self.active:
                self.stats.refuse("duplicate_ready")
                logger.warning("PDD relay: duplicate HandoffReady for room %s", room)
            else:
                self.pending[room] = Pending(peer, self._clock(), message)
        elif isinstance(message, HandoffAck):
            active = self.active.get(message.room)
            if active is None and message.room in self.refused_rooms:
                self.stats.event("ack_after_refusal")  # crossed our HandoffRefused on the line
                logger.debug("PDD relay: %s after room %s was refused (%s)", message,
                             message.room, self.refused_rooms[message.room])
                return
            if (active is None or message.seq != active.seq - 1
                    or active.state not in (Handing.AWAITING_ACK, Handing.AWAITING_FINAL_ACK)):
                self.stats.refuse("unexpected_ack")
                logger.warning("PDD relay: unexpected HandoffAck %s", message)
                return
            if active.state is Handing.AWAITING_ACK:
                active.state = Handing.SENDING
                return
            del self.active[message.room]  # main has every handed token: the relay is done
            self._finish_handed(active.req, active.handed, active.mode)
        elif isinstance(message, HandoffRefused):
            # Main gave up on this request; the relay keeps decoding it to the end.
            self.stats.event(f"main_refused_{message.reason}")
            self.pending.pop(message.room, None)
            active = self.active.pop(message.room, None)
            out = self.out_of_batch.get(message.room)
            if out is not None:  # back in through SGLang's waiting queue
                self._resume(out, f"main refused the handoff ({message.reason})")
            elif active is not None:
                logger.warning("PDD relay: main refused room %s (%s); finishing it here",
                               message.room, message.reason)
        else:
            self.stats.refuse("unexpected_type")
            logger.warning("PDD relay: unexpected %s from a main", type(message).__name__)

    def _room_queued(self, room: int) -> bool:
        """Is the request still on its way into the running batch (KV in flight, waiting)?"""
        scheduler = self.scheduler
        queued = [req.bootstrap_room for req in scheduler.waiting_queue]
        queued += [d.req.bootstrap_room for d in scheduler.disagg_decode_transfer_queue.queue]
        queued += [d.req.bootstrap_room for d in scheduler.disagg_decode_prealloc_queue.queue]
        return room in queued

    def _kv_verdict(self, ready: HandoffReady) -> Optional[str]:
        """``"kv_digest_mismatch"`` if main's digest of its WAN copy differs from this relay's
        copy over the same positions; None if they match or main sent no digest."""
        if not ready.kv_digest:
            return None
        if self.kv_hashes.pop(ready.room, None) is None:  # off here, or its hashes aged out
            self.stats.event("kv_digest_unverified")
            return None
        hashes = self._hashed[ready.room]  # this step's, of every rank's heads (step())
        if kv_digest.range_digest(hashes, ready.kv_digest_start) == ready.kv_digest:
            self.stats.event("kv_digest_verified")
            return None
        logger.error("PDD relay: room %s: main's KV from position %d does not match the relay's "
                     "copy; the relay finishes the request", ready.room, ready.kv_digest_start)
        return "kv_digest_mismatch"

    def _refuse(self, peer: bytes, room: int, reason: str, chunks_out: bool = False) -> None:
        self.stats.refuse(reason)
        self.loop.send(peer, HandoffRefused(room=room, reason=reason))
        if not chunks_out:
            return
        # a room given up mid handoff: main may have acknowledged a chunk before it reads this,
        # and that ack is no fault
        self.refused_rooms[room] = reason
        while len(self.refused_rooms) > REFUSED_ROOMS_KEPT:
            self.refused_rooms.popitem(last=False)

    # ---- handing off -----------------------------------------------------------------------
    def _choose_mode(self, req: Any) -> policy.HandoffMode:
        # The request's route may name a mode (a study's), else --pdd-handoff-mode may.
        forced = getattr(route_for(req), "handoff_mode", None)
        if forced is None and self.args.pdd_handoff_mode != "auto":
            forced = self.args.pdd_handoff_mode
        if forced is not None:
            return policy.HandoffMode(forced)
        return policy.choose_handoff_mode(len(req.output_ids), self._load(), self.cfg)

    def _load(self) -> policy.RelayLoad:
        scheduler = self.scheduler
        capacity = int(scheduler.max_total_num_tokens)
        available = int(scheduler.token_to_kv_pool_allocator.available_size())
        return policy.RelayLoad(
            running_requests=scheduler.running_batch.batch_size(),
            max_running_requests=max(1, int(scheduler.max_running_requests)),
            kv_used_tokens=max(0, capacity - available),
            kv_capacity_tokens=max(1, capacity),
        )

    def _start(self, room: int, req: Any, peer: bytes) -> None:
        active = Active(req=req, peer=peer, mode=self._choose_mode(req))
        self.active[room] = active
        self.stats.event(f"mode_{active.mode.value}")
        self._send_next_chunk(room, active)

    def _send_next_chunk(self, room: int, active: Active) -> None:
        req = active.req
        if req.finished():
            # Finished on its own mid Catch-Up (EOS, stop, length, abort): its answer is whole,
            # and main drops the chunks it absorbed.
            self.active.pop(room, None)
            self._refuse(active.peer, room, "aborted_at_relay" if _is_abort(req)
                         else FINISHED_AT_RELAY, chunks_out=True)
            return
        chunk = policy.next_handoff_chunk(len(req.output_ids), active.handed, active.mode, self.cfg)
        if chunk.tokens == 0 and chunk.start > 0:
            return  # nothing new since the last chunk: main would have nothing to extend
        tokens = list(req.output_ids[chunk.start:chunk.end])
        message = HandoffTokens(room=room, seq=active.seq, start=chunk.start,
                                token_ids=pack_tokens(tokens), is_last=chunk.is_last)
        self.loop.send(active.peer, message)
        self.stats.chunk_sent(active.mode.value, len(tokens), len(encode(message)))
        active.handed, active.seq = chunk.end, active.seq + 1
        active.last_sent_at = self._clock()
        active.state = Handing.AWAITING_FINAL_ACK if chunk.is_last else Handing.AWAITING_ACK

    def _finish_handed(self, req: Any, handed: int, mode: policy.HandoffMode) -> None:
        """Finish a request between two steps, exactly as a normal finish would."""
        from sglang.srt.mem_cache.common import release_kv_cache

        self.out_of_batch.pop(req.bootstrap_room, None)
        req.finished_reason = HandedOff(handed, mode.value)
        req.is_retracted = False  # finished now: the overlap scheduler skips it on that ground
        req.time_stats.set_completion_time()
        self.scheduler.output_streamer.stream_output([req], req.return_logprob)
        release_kv_cache(req, self.scheduler.tree_cache, checkpoint=True)
        self.stats.event("handed_off")

    def _leave_batch(self, running_batch: Any, reqs: list) -> Any:
        """Take ``reqs`` out of the decode batch, their row and KV kept, into ``out_of_batch``.
        Under the overlap scheduler a decode step for them is already in flight: marked as
        SGLang marks a retracted request, its token is dropped (and its over-allocated slot
        freed with the request), so the client never gets a token past what was handed."""
        if not reqs:
            return running_batch
        if getattr(self.scheduler, "enable_overlap", False):
            for req in reqs:
                req.is_retracted = True  # cleared by SGLang when the request is resumed
        self.out_of_batch.update((req.bootstrap_room, req) for req in reqs)
        running_batch.filter_batch(reqs_to_exclude=reqs)
        return running_batch

    def _resume(self, req: Any, why: str) -> None:
        """A request out of the batch for a handoff that will not happen: the relay decodes it
        on from its last token, through SGLang's waiting queue (the path a retracted request
        takes back: its row and KV are kept)."""
        self.out_of_batch.pop(req.bootstrap_room, None)
        if req.finished():
            return
        self.scheduler.waiting_queue.append(req)
        self.stats.event("resumed")
        logger.warning("PDD relay: room %s: %s; the relay decodes it to the end",
                       req.bootstrap_room, why)

    def _clock(self) -> float:
        """Now: at TP > 1 rank 0's clock of this step, so every rank decides alike."""
        return time.monotonic() if self.ranks.size == 1 else self._now

    def _note_finished(self, reqs: dict) -> None:
        for room, req in reqs.items():
            if req.finished() and not isinstance(req.finished_reason, HandedOff):
                reason = "aborted_at_relay" if _is_abort(req) else FINISHED_AT_RELAY
                self.finished_rooms[room] = reason
                self.finished_rooms.move_to_end(room)
        while len(self.finished_rooms) > FINISHED_ROOMS_KEPT:
            self.finished_rooms.popitem(last=False)

    def close(self) -> None:
        """Server shutdown, on the scheduler thread (or once it stopped stepping); idempotent.

        Every main waiting on this relay is told (``relay_shutting_down``): one that has absorbed
        nothing decodes the request itself, one mid Catch-Up drops its copy with that reason.
        Requests out of the batch are aborted here, their KV freed; the rest are SGLang's. Then
        the control loop flushes and stops."""
        if self._closed:
            return
        self._closed = True
        for room, pending in self.pending.items():
            self._refuse(pending.peer, room, "relay_shutting_down")
        for room, active in self.active.items():
            self._refuse(active.peer, room, "relay_shutting_down", chunks_out=True)
        for req in list(self.out_of_batch.values()):
            self._abort(req, "PDD relay is shutting down")
        self.pending.clear()
        self.active.clear()
        self.out_of_batch.clear()
        self.loop.close()
        kv_digest.PendingHashes.shutdown()


def _is_abort(req: Any) -> bool:
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    return isinstance(req.finished_reason, FINISH_ABORT)
