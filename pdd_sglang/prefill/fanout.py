"""Prefill fans one request's KV out to two destinations, each past its own prefix: one owner.

Life cycle of a request on a PDD prefill (P->RLD->MD):

1. The relay and the main each register for the room: SGLang's bootstrap thread hands the
   registration, with its :class:`~pdd_sglang.protocol.messages.DestinationHello` frame, to
   :meth:`PrefillFanout.claim_registration` (patch 0006) instead of writing SGLang's
   ``transfer_infos``: a PDD room never appears in that table.
2. Prefill computes as soon as the relay is in (the main's registration crosses the WAN and must
   not hold the relay's first token): the owner sets where sending starts
   (``req_to_decode_prefix_len``, the smallest prefix) and the room's WaitingForInput.
3. Each chunk prefill computes comes to :meth:`PrefillFanout.take_chunk` (patch 0006, in
   ``add_transfer_request``) and from there to the owner, which cuts it to each destination's own
   pages and puts it on that destination's sender: a local sender for the relay, a WAN sender for
   the main (:mod:`pdd_sglang.prefill.senders`). A room's chunks for one destination go to one
   sender queue, in prefill's order. Chunks made before the main registered are replayed to it,
   in order, when it does.
4. Each sender reports every chunk back. A destination whose last chunk and every chunk before it
   landed is told Success at once (the relay decodes while the WAN copy is in flight); the room is
   concluded when every destination is done, and only then may SGLang free prefill's KV.

Rooms without a hello (plain SGLang PD on this server) take SGLang's own path unchanged.

Ownership (the one rule): every :class:`~pdd_sglang.prefill.room.Room`, and every change PDD
makes to SGLang's per-room tables (``request_status`` through ``update_status`` /
``conclude_transfer``, ``req_to_decode_prefix_len``), happens on the owner thread
(``pdd-fanout``). Other threads only post events to it: the bootstrap thread (registrations),
the scheduler (chunks, and every request's end: SGLang's sender cleared), the senders (chunk
reports), the peer thread (probe answers), and the bootstrap thread again with a destination's
ABORT (:mod:`pdd_sglang.prefill.aborts`: acked only once no sender still writes that
destination's pages). The owner never blocks on a peer: status messages and WAN probes go to the ``pdd-peer-io`` thread, which
touches no table. The senders read SGLang's ``request_status`` (to skip a room that ended) and
``decode_kv_args_table`` (the destination's buffers), and write nothing of SGLang's. The owner
publishes :attr:`PrefillFanout.published` (an immutable dict it replaces whole) for
``/server_info``; ``pdd_rooms`` and ``main_sessions`` are sets only the owner writes and the
scheduler / senders only test.

Faults: a relay that has not registered ``--pdd-relay-bootstrap-timeout`` seconds after the main
did is dropped, and the room proceeds to the main alone; a main that has not registered
``--pdd-main-bootstrap-timeout`` seconds after the room's first hello, once the relay has its KV,
is dropped and the relay answers alone. A late registration is refused (told Failed, so it frees
its slots). A chunk that fails to a relay drops the relay and the room goes on to main; one that
fails to a main fails the room and takes that main *out* until a probe over the WAN engine
answers. A room whose chunk has been in a sender for ``stuck_after_s`` fails, so its KV is freed.
A prefix claim beyond the prompt fails the room; malformed and repeated hellos are refused, and
so is a hello from a destination whose TP size this prefill's cannot pair with
(:func:`~pdd_sglang.protocol.messages.tp_refusal`: neither divides the other).

TP (issue 37): each prefill rank runs its own fan-out. A decode at the prefill's TP size, or a
smaller one, has one session per room here (a smaller decode's rank registers with several
prefill ranks, each writing its own heads); a decode at a larger TP has ``decode TP // prefill
TP`` ranks here, each its own session and destination, each sent its own heads
(:mod:`~pdd_sglang.prefill.tp_slices`). A role is in once every rank of it is
(:meth:`~pdd_sglang.prefill.room.Room.role_in`).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import time
from collections import OrderedDict
from typing import Any, Callable, Optional

from pdd_sglang.prefill.aborts import FanoutAborts
from pdd_sglang.prefill.deadlines import FanoutDeadlines
from pdd_sglang.prefill.destination_chunks import skip_prefix_pages
from pdd_sglang.prefill.events import (AbortNotified, CacheOnly, ChunkReady, ChunkSent, RelayLost,
                                       ProbeAnswered, Registered, RoomCleared)
from pdd_sglang.prefill.ledger import LEDGER
from pdd_sglang.prefill.room import Destination, DestinationState, Room, RoomPhase, Work
from pdd_sglang.prefill.tp_slices import page_bytes_to
from pdd_sglang.kv_codec.wire import RingLayout
from pdd_sglang.prefill.wan_coded import StagedCopy
from pdd_sglang.prefill.wan_line import WanLine
from pdd_sglang.prefill.wan_lines import CopyClass, WanLines, remaining_bytes
from pdd_sglang.protocol.messages import (DestinationHello, MessageError, decode,
                                          sessions_per_prefill_rank, tp_refusal)

logger = logging.getLogger(__name__)

# Mooncake's metadata message has 10 positional frames; a PDD destination appends its hello.
HELLO_FRAME_INDEX = 10
CONCLUDED_ROOMS_KEPT = 65536  # to refuse a registration that comes after its room ended


class PrefillFanout(FanoutDeadlines, FanoutAborts):
    """The owner of every PDD room of one prefill KV manager (see the module docstring)."""

    def __init__(self, kv_mgr: Any, wan_line_bytes_per_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self.kv_mgr = kv_mgr
        # Mooncake's status message leaves out its reason frame (NIXL's and Mori's carry it), so
        # a decode told Failed reported SGLang's "it might be dead" whatever PDD said. SGLang's
        # decode reads the frame when it is there: with it, the reason PDD tells a destination
        # (a refused hello, a dropped main) is the client's error. This prefill's only.
        kv_mgr.kv_status_msg_carries_reason = True
        self.clock = clock
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        # Set by WanPath: where work and peer jobs go. Tests plug lists in.
        self.local_queues: list = []
        # Main-bound work, per main session (the WAN senders'); its copies' deadlines are scaled
        # by the declared line (--pdd-wan-bandwidth-gbps).
        self.wan_lines = WanLines(wan_line_bytes_per_s)
        self.peer_jobs: Callable[[Callable[[], None]], None] = lambda job: job()
        self.wan_engine = None  # WanTransferEngine, set at start
        # SGLang's engine for the relays, waited on without spinning (wan_engine.
        # polled_local_engine), set at start; None: SGLang's engine as it is.
        self.local_engine = None
        self.wan_line = WanLine()
        self.wan_line.queue_view = self.wan_lines.queued_by_class
        # --pdd-wan-cache-only-backlog-s: past this much of a line ahead, its queued cache-only
        # copies are dropped (None: never).
        self.cache_only_backlog_s: Optional[float] = None
        self.relay_bootstrap_timeout_s = 5.0
        self.main_bootstrap_timeout_s = 30.0
        self.stuck_after_s = 150.0
        self.abandon_after_s = 330.0  # SGLang's decode waiting timeout (300 s) and a margin
        # Owner-only state.
        self._rooms: dict[int, Room] = {}
        self._concluded: OrderedDict[int, float] = OrderedDict()
        self._concluded_tracked = 0  # rooms in self._rooms that are CONCLUDED
        self.mains_out: dict[str, float] = {}  # main session -> when it is next probed
        self._outs: dict[str, tuple] = {}  # main session -> (times out in a row, last back in)
        self.counters = dict.fromkeys((
            "refused_hellos", "refused_late", "relays_dropped", "mains_dropped", "relays_failed",
            "mains_failed", "rooms_stuck", "rooms_abandoned", "rooms_succeeded", "rooms_failed",
            "destinations_aborted", "cache_only_copies", "cache_only_dropped", "relays_lost"), 0)
        # Written by the owner only; tested by other threads.
        self.pdd_rooms: set[int] = set()
        self.main_sessions: set[str] = set()
        self._init_aborts()
        self.published: dict = self._snapshot()

    # ---- entry points on other threads: they post, and never touch a Room ---------------------
    def claim_registration(self, room: int, session: str, frames: list) -> bool:
        """Bootstrap thread: True when the registration is PDD's (SGLang then skips it)."""
        if len(frames) <= HELLO_FRAME_INDEX:
            return False
        from sglang.srt.disaggregation.mooncake.conn import TransferInfo

        info = TransferInfo.from_zmq(frames)
        hello, refusal = None, None
        try:
            hello = decode(frames[HELLO_FRAME_INDEX], expect=DestinationHello)
            if hello.room != room:
                raise MessageError("room_mismatch", f"hello for {hello.room} on room {room}")
            if (info.decode_prefix_len or 0) != hello.prefix_tokens:
                raise MessageError("prefix_mismatch", f"hello claims {hello.prefix_tokens}, "
                                   f"metadata {info.decode_prefix_len}")
            refusal = tp_refusal(hello.role, hello.tp_size, self._own_tp())
            if refusal is not None:
                raise MessageError("tp_size_incompatible", refusal)
        except MessageError as err:
            refusal = str(err)
        self._note_claimed(room)  # its ABORT, on this thread later, is the fan-out's too
        self.events.put(Registered(room, session, info, hello, refusal))
        return True

    def take_chunk(self, chunk: Any) -> bool:
        """Scheduler thread (``add_transfer_request``): True when the chunk is a PDD room's."""
        if chunk.room not in self.pdd_rooms:
            return False
        self.events.put(ChunkReady(chunk))
        return True

    def sender_cleared(self, room: int) -> None:
        """Scheduler thread (SGLang's ``CommonKVSender.clear``): the request is over at SGLang.

        Posted for every room, PDD's or not: whether the owner knows the room is the owner's to
        answer, and a registration still in the queue behind this clear is known to nobody yet."""
        self.events.put(RoomCleared(room))

    def engine_for(self, session: str) -> Any:
        """Sender threads: the engine that carries batches to ``session``."""
        if self.wan_engine is not None and session in self.main_sessions:
            return self.wan_engine
        return self.local_engine if self.local_engine is not None else self.kv_mgr.engine

    # ---- the owner thread ---------------------------------------------------------------------
    def handle(self, event: Any) -> None:
        """Apply one event; the owner thread's loop (:class:`~pdd_sglang.prefill.wan_path.
        WanPath`) calls this and :meth:`tick`, nothing else does outside tests."""
        if isinstance(event, Registered):
            self._on_registered(event)
        elif isinstance(event, ChunkReady):
            self._on_chunk(event.chunk)
        elif isinstance(event, ChunkSent):
            self._on_sent(event)
        elif isinstance(event, ProbeAnswered):
            self._on_probe(event)
        elif isinstance(event, RoomCleared):
            self._on_cleared(event.room)
        elif isinstance(event, AbortNotified):
            self._on_abort(event)
        elif isinstance(event, CacheOnly):
            self._on_cache_only(event.room)
        elif isinstance(event, RelayLost):
            self._on_relay_lost(event.room)
        else:
            raise TypeError(f"unknown fan-out event {event!r}")
        self.published = self._snapshot()

    def _on_registered(self, ev: Registered) -> None:
        if ev.refusal is not None:
            self.counters["refused_hellos"] += 1
            logger.warning("PDD: refused destination hello from %s for room %s: %s",
                           ev.session, ev.room, ev.refusal)
            self._tell([ev.info], ev.room, "Failed", f"PDD: hello refused: {ev.refusal}")
            return
        role = ev.hello.role
        room = self._rooms.get(ev.room)
        if (room.is_late(role) if room is not None else ev.room in self._concluded):
            self.counters["refused_late"] += 1
            logger.warning("PDD: %s %s registered for room %s after prefill went on without it; "
                           "refused", role, ev.session, ev.room)
            self._tell([ev.info], ev.room, "Failed",
                       f"PDD: the {role} registered after the bootstrap deadline")
            return
        if room is None:
            room = self._rooms[ev.room] = Room(ev.room, ev.hello.destinations, self.clock())
        # A decode at a larger TP registers several ranks here, each its own session.
        ranks = room.ranks.setdefault(role, sessions_per_prefill_rank(ev.hello.tp_size,
                                                                      self._own_tp()))
        if ev.session in room.destinations or room.role_in(role):
            logger.warning("PDD: a %s (%s) registered for room %s beyond its %d rank(s) here; "
                           "refused", role, ev.session, ev.room, ranks)
            self._tell([ev.info], ev.room, "Failed", "PDD: a second destination of one role")
            return
        dest = room.destinations[ev.session] = Destination(role, ev.info, ev.hello.prefix_tokens)
        if role == "main":  # its copy's mode decided once, packed into its ring if it named one
            dest.staged = StagedCopy(RingLayout(ev.hello.staging_addr, ev.hello.staging_bytes,
                                                ev.hello.staging_slot_bytes)
                                     if ev.hello.staging_bytes else None)
            self.main_sessions.add(ev.session)  # before any chunk picks its engine
        LEDGER.set_role(ev.session, role)  # labels the figures only
        logger.debug("PDD room %s: %s %s registered (%s)", ev.room, role, ev.session, room.phase)
        if room.ready_to_start():
            self._start(room)
        elif room.phase is RoomPhase.SENDING:
            if dest.prefix_tokens < room.send_start:
                self._fail_destination(room, dest, f"PDD: {role} holds {dest.prefix_tokens} "
                                       f"tokens, prefill already sends from {room.send_start}")
                return
            for chunk in room.chunks:  # the late main: every chunk so far, in order
                self._route(room, dest, chunk)
            self._conclude_if_finished(room)  # a late dummy (MLA) takes no chunk

    def _start(self, room: Room) -> None:
        from sglang.srt.disaggregation.base.conn import KVPoll

        room.phase = RoomPhase.SENDING
        room.started_at = self.clock()
        room.send_start = room.start_tokens()
        self.pdd_rooms.add(room.room)  # before WaitingForInput: no chunk can come earlier
        self.kv_mgr.req_to_decode_prefix_len[room.room] = room.send_start
        self.kv_mgr.update_status(room.room, KVPoll.WaitingForInput)

    def _on_chunk(self, chunk: Any) -> None:
        room = self._rooms.get(chunk.room)
        if room is None or room.phase is not RoomPhase.SENDING:
            logger.debug("PDD: chunk of room %s after it ended; dropped", chunk.room)
            return
        room.chunk_seen = True
        if room.awaits_main():
            room.chunks.append(chunk)
        for dest in room.active():
            self._route(room, dest, chunk)
        self._conclude_if_finished(room)  # only dummies (MLA) left: nothing was sent

    def _tell_done(self, room: Room, role: str) -> None:
        """Success to each rank of ``role`` that has all its KV, once every rank of it has
        registered (a decode at a larger TP than prefill's: its server goes on only when every
        rank has its KV; a rank told early could not be told Failed if its sibling never
        came)."""
        if room.role_in(role):
            for dest in room.of_role(role):
                if dest.state is DestinationState.DONE:
                    self._tell_destination(room, dest, "Success")

    def _conclude_if_finished(self, room: Room) -> None:
        if room.phase is RoomPhase.SENDING and room.finished():
            self._conclude(room, "Success")

    def _own_tp(self) -> int:
        return int(getattr(self.kv_mgr, "attn_tp_size", 1) or 1)

    def _route(self, room: Room, dest, chunk: Any) -> None:
        if dest.dummy:  # SGLang's dummy (MLA): no KV, done with the room's last chunk
            dest.state = DestinationState.DONE if chunk.is_last_chunk else dest.state
            return
        page_size = self.kv_mgr.kv_args.page_size
        skip = dest.prefix_tokens - room.send_start
        if chunk.is_last_chunk and skip > chunk.index_slice.stop * page_size:
            reason = (f"PDD: destination {dest.info.mooncake_session_id} claims a "
                      f"{dest.prefix_tokens}-token prefix, beyond the "
                      f"{room.send_start + chunk.index_slice.stop * page_size} tokens of room "
                      f"{room.room}'s prompt")
            logger.error(reason)
            self._conclude(room, "Failed", reason)
            return
        # Each destination its own copy: a sender converts and waits on its chunk's fields.
        view = dataclasses.replace(skip_prefix_pages(chunk, skip, page_size))
        if len(view.prefill_kv_indices) == 0 and not chunk.is_last_chunk:
            return  # all of it under this destination's prefix
        dest.routed += 1
        dest.last_routed = dest.last_routed or chunk.is_last_chunk
        if dest.staged is not None and chunk.is_last_chunk:
            dest.staged.total = dest.routed  # before its work is queued: senders read it
        work = Work(room.room, dest.info.mooncake_session_id, dest.role, dest.info, view,
                    staged=dest.staged)
        room.in_flight.append(work)
        if dest.role == "main":
            pages = len(view.prefill_kv_indices)  # charged by the heads this main rank gets
            peer = self.kv_mgr.decode_kv_args_table.get(work.session)
            work.relay_covered = room.relay_serving()
            self.wan_lines.put(work, pages * page_bytes_to(self.kv_mgr, peer), pages,
                               CopyClass.CACHE_ONLY if room.cache_only else CopyClass.NEEDED_NOW)
        else:
            self.local_queues[room.room % len(self.local_queues)].put(work)

    def _on_sent(self, ev: ChunkSent) -> None:
        work = ev.work
        room = self._rooms.get(work.room)
        if room is None:
            return
        if work in room.in_flight:
            room.in_flight.remove(work)
        dest = room.destinations.get(work.session)
        if ev.ok is None and not work.cancelled:  # skipped: SGLang had ended the request
            self._conclude(room, "Failed", "PDD: prefill ended the request")
        if dest is not None and dest.state is DestinationState.REGISTERED and ev.ok is not None:
            dest.completed += 1
            if not ev.ok:
                self._fail_destination(room, dest, ev.reason or "PDD: a KV transfer failed",
                                       wan=dest.role == "main")
            elif dest.all_landed():
                dest.state = DestinationState.DONE
                # It starts decoding now (the relay eagerly) while the other copy flies.
                self._tell_done(room, dest.role)
        if dest is not None:
            self._ack_if_drained(room, dest)
        if room.phase is RoomPhase.CONCLUDED:
            if room.forget_when_drained and not room.in_flight:
                self._forget(room)
            return
        if room.pending is not None and not room.in_flight:
            self._conclude(room, *room.pending)
        elif room.finished():
            self._conclude(room, "Success")

    def _on_cache_only(self, room_id: int) -> None:
        """The relay answered alone: main's copy of the room goes behind every needed-now one."""
        room = self._rooms.get(room_id)
        if room is None or room.phase is RoomPhase.CONCLUDED or room.cache_only:
            return
        room.cache_only = True
        self.counters["cache_only_copies"] += 1
        self.wan_lines.reclassify(room_id, CopyClass.CACHE_ONLY)

    def _on_relay_lost(self, room_id: int) -> None:
        """The relay died while it answered (the router saw its stream break): main's copy of the
        room is the request's only way on, no longer relay-covered."""
        room = self._rooms.get(room_id)
        if room is None or room.phase is RoomPhase.CONCLUDED or room.relay_lost:
            return
        room.relay_lost = True
        self.counters["relays_lost"] += 1
        self.wan_lines.uncover(room_id)

    def drop_cache_only_backlog(self) -> None:
        """Owner, each tick: a line whose bytes ahead take longer than the backlog bound at its
        measured rate drops its queued cache-only copies, newest first, down to the bound. Main
        is told the copy failed (it frees its slots) but is not taken out: its line is slow,
        not broken."""
        if self.cache_only_backlog_s is None:
            return
        for session, line in self.wan_line.snapshot().items():
            rate = line["recent_bytes_per_s"]
            if not line["cache_only_bytes_ahead"] or not rate:
                continue
            if line["bytes_ahead"] <= self.cache_only_backlog_s * rate:
                continue
            # The bound and the rate are wire bytes; queued work counts KV bytes, which a coded
            # line sends kv_codec_ratio to one.
            ratio = line.get("kv_codec_ratio") or 1.0
            keep_kv_bytes = int(self.cache_only_backlog_s * rate * ratio)
            for work in self.wan_lines.drop_cache_only(session, keep_kv_bytes):
                room = self._rooms.get(work.room)
                dest = room.destinations.get(work.session) if room is not None else None
                self.wan_line.dropped(session, int(remaining_bytes(work) / ratio))
                if dest is None or dest.state is not DestinationState.REGISTERED:
                    work.cancelled = True
                    continue
                self.counters["cache_only_dropped"] += 1
                self._fail_destination(room, dest, (
                    f"PDD: main's cache-only copy of room {room.room} was dropped: the WAN line "
                    f"to {session} had over {self.cache_only_backlog_s:g} s of bytes ahead "
                    "(--pdd-wan-cache-only-backlog-s)"))

    def _fail_destination(self, room: Room, dest, reason: str, wan: bool = False) -> None:
        """One destination out of the room: the room goes on to the other if it can."""
        dest.state = DestinationState.FAILED
        for work in room.in_flight:
            if work.session == dest.info.mooncake_session_id:
                work.cancelled = True
        logger.warning("PDD room %s: %s", room.room, reason)
        self.counters["relays_failed" if dest.role == "relay" else "mains_failed"] += 1
        if dest.role == "relay":  # main's copy is the request's only way on now
            self.wan_lines.uncover(room.room)
        if dest.role == "main" and wan:
            self._take_main_out(dest.info.mooncake_session_id)
        self._tell_destination(room, dest, "Failed", reason)
        if not room.active() and not room.awaits_main() and not room.awaits_relay():
            # The relay answers alone if it has all its KV; _conclude waits for chunks in flight.
            self._conclude(room, "Success" if room.any_done() else "Failed", reason)

    def _conclude(self, room: Room, status_name: str, reason: Optional[str] = None,
                  force: bool = False) -> None:
        """The room is over: SGLang's status (prefill frees the KV), and every destination told.

        Not while a chunk of it is still in a sender (it reads prefill's KV): the queued ones are
        cancelled and the conclusion waits for the last report, unless ``force`` (stuck)."""
        from sglang.srt.disaggregation.base.conn import KVPoll

        if room.phase is RoomPhase.CONCLUDED:
            return
        for work in room.in_flight:
            work.cancelled = True
        if room.in_flight and not force:
            room.pending = room.pending or (status_name, reason)
            return
        room.phase = RoomPhase.CONCLUDED
        self._concluded_tracked += 1
        room.chunks = []
        status = KVPoll.Success if status_name == "Success" else KVPoll.Failed
        emitted = self.kv_mgr.conclude_transfer(bootstrap_room=room.room, status=status,
                                                targets=[], failure_reason=reason)
        # None: SGLang had already cleared the room (aborted): its destinations must let go.
        final = "Success" if emitted == KVPoll.Success else "Failed"
        self.counters["rooms_succeeded" if final == "Success" else "rooms_failed"] += 1
        for dest in room.destinations.values():
            if dest.state is not DestinationState.FAILED:
                self._tell_destination(room, dest, final,
                                       reason or f"PDD fan-out of room {room.room} failed")
        self._mark_concluded(room.room)
        if final == "Success":
            logger.info("PDD room %s sent: %s", room.room, LEDGER.request_summary(room.room))
        else:
            logger.info("PDD room %s failed (%s): %s", room.room, reason,
                        LEDGER.request_summary(room.room))

    def _mark_concluded(self, room_id: int) -> None:
        """A registration for ``room_id`` from now on is late (the newest rooms are kept)."""
        self._concluded[room_id] = self.clock()
        self._concluded.move_to_end(room_id)
        while len(self._concluded) > CONCLUDED_ROOMS_KEPT:
            self._concluded.popitem(last=False)

    def _tell_destination(self, room: Room, dest, status_name: str, reason: Optional[str] = None) -> None:
        if dest.told is not None and (dest.told == status_name or dest.told == "Failed"):
            return
        if dest.dummy:  # SGLang's worker tells a dummy nothing: its rank hears another prefill
            return
        dest.told = status_name
        self._tell([dest.info], room.room, status_name, reason)

    def _tell(self, infos: list, room: int, status_name: str, reason: Optional[str]) -> None:
        from sglang.srt.disaggregation.base.conn import KVPoll

        targets = [(info.endpoint, info.dst_port) for info in infos]
        status = KVPoll.Success if status_name == "Success" else KVPoll.Failed
        send = self.kv_mgr.send_kv_status_message
        self.peer_jobs(lambda: send(targets=targets, bootstrap_room=room, status=status,
                                    failure_reason=None if status_name == "Success" else reason))

    def _snapshot(self) -> dict:
        """O(1) in rooms: it runs after every event."""
        return {
            **self.counters,
            "rooms_open": len(self._rooms) - self._concluded_tracked,
            "rooms_tracked": len(self._rooms),
            "mains_out": sorted(self.mains_out),
        }
