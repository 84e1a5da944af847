"""Prefill fans one request's KV out to two destinations, each past its own prefix.

Life cycle of a request on a PDD prefill (P->RLD->MD):

1. The relay and the main each register for the room with their transfer metadata, plus one
   :class:`~pdd_sglang.protocol.messages.DestinationHello` frame: role, how many destinations the room has,
   and the prefix that destination already holds (0 on the relay; on the main, what its decode
   radix cache matched).
2. Prefill starts computing as soon as the relay has registered (:meth:`PrefillFanout.
   _start_on_relay`): the relay's time to first token must not wait for the main, whose
   registration crosses the WAN. SGLang sends from the smallest prefix
   (:meth:`PrefillFanout.room_send_start`: the relay's 0), chunk by chunk, as prefill computes
   them. Chunks sent before the main registered are kept and replayed to it when it does.
3. A local transfer worker takes each chunk. It sends the relay's part itself and hands the same
   chunk to the WAN path (:meth:`PrefillFanout.destinations_on_this_path`), whose own workers
   send the main's part, so a multi-second WAN copy never holds up a relay transfer behind it.
4. Each destination gets only the pages past its own prefix (:meth:`chunk_for_destination`).
5. Each destination is told "transfer done" as soon as its own last chunk lands
   (:meth:`destination_sent`): the relay starts decoding while the WAN copy is in flight. The room
   concludes (and prefill frees its KV) when every destination is done.

Rooms without hellos (plain SGLang PD, or P->MD) take SGLang's own path unchanged.

Faults: a relay that has not registered ``--pdd-relay-bootstrap-timeout`` seconds after the main
did is dropped, and the room proceeds to the main alone (a late relay is refused with a Failed
status, so it frees its slots). A main that has not registered ``--pdd-main-bootstrap-timeout``
seconds after its relay, once the relay has all its KV, is dropped the same way. A prefix claim
beyond the prompt fails the room; malformed, mismatched and repeated hellos are refused.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import OrderedDict
from typing import Any, Optional

from pdd_sglang.prefill.destination_chunks import (bytes_past_prefixes, skip_prefix_pages,
                                                   uncounted_copy)
from pdd_sglang.protocol.messages import DestinationHello, MessageError, decode
from pdd_sglang.prefill.ledger import LEDGER
from pdd_sglang.prefill.wan_line import WanLine

logger = logging.getLogger(__name__)

# Mooncake's metadata message has 10 positional frames; a PDD destination appends its hello.
HELLO_FRAME_INDEX = 10
MAX_TRACKED_ROOMS = 65536
STALE_ROOM_S = 600.0


@dataclasses.dataclass
class RoomFanout:
    hellos: dict = dataclasses.field(default_factory=dict)  # session -> DestinationHello
    done: dict = dataclasses.field(default_factory=dict)  # session -> ok
    first_hello_at: float = dataclasses.field(default_factory=time.monotonic)
    relay_dropped: bool = False
    main_dropped: bool = False
    started_on_relay: bool = False
    # Chunks sent while the room's main had not registered yet: replayed to it when it does.
    unsent_to_main: list = dataclasses.field(default_factory=list)

    @property
    def expected(self) -> int:
        declared = max((h.destinations for h in self.hellos.values()), default=1)
        return declared - (1 if self.relay_dropped else 0) - (1 if self.main_dropped else 0)

    def has(self, role: str) -> bool:
        return any(h.role == role for h in self.hellos.values())

    def awaits_main(self) -> bool:
        """A P->RLD->MD room that started on its relay's registration, main not yet here."""
        return self.started_on_relay and not self.has("main") and not self.main_dropped


class PrefillFanout:
    """Per-KV-manager state of the fan-out; created by :func:`start_prefill_fanout`."""

    def __init__(self, kv_mgr: Any):
        self.kv_mgr = kv_mgr
        self._lock = threading.Lock()
        self._rooms: OrderedDict[int, RoomFanout] = OrderedDict()
        self.refused_hellos = 0
        self.relays_dropped = 0
        self.relay_bootstrap_timeout_s = 5.0
        self.main_bootstrap_timeout_s = 30.0
        self.mains_dropped = 0
        self.wan_queues: list = []  # pdd_sglang.prefill.wan_line.ChargedQueue, one per WAN worker
        self.wan_engine = None  # pdd_sglang.prefill.wan_engine.WanTransferEngine, set at start
        self.wan_line = WanLine()  # bytes queued and in flight per main, recent throughput
        self._main_sessions: set[str] = set()  # Mooncake sessions of mains: the WAN engine's
        self.defer = None  # runs a job off SGLang's locks (WanPath's housekeeping); None: inline

    def engine_for(self, session: str) -> Any:
        """The engine that carries batches to ``session``: the WAN engine for mains."""
        if self.wan_engine is not None and session in self._main_sessions:
            return self.wan_engine
        return self.kv_mgr.engine

    # ---- 1. registration (bootstrap thread) --------------------------------------------
    def on_destination_registered(self, room: int, session: str, frames: list) -> None:
        if len(frames) <= HELLO_FRAME_INDEX:
            return
        info = self.kv_mgr.transfer_infos.get(room, {}).get(session)
        try:
            hello = decode(frames[HELLO_FRAME_INDEX], expect=DestinationHello)
            if hello.room != room:
                raise MessageError("room_mismatch", f"hello for {hello.room} on room {room}")
            if info is not None and (info.decode_prefix_len or 0) != hello.prefix_tokens:
                raise MessageError(
                    "prefix_mismatch",
                    f"hello claims {hello.prefix_tokens}, metadata {info.decode_prefix_len}",
                )
        except MessageError as err:
            self.refused_hellos += 1
            logger.warning("PDD: refused destination hello from %s for room %s: %s", session, room, err)
            return
        replay: list = []
        with self._lock:
            fanout = self._room(room)
            late = (fanout.relay_dropped and hello.role == "relay") or (
                fanout.main_dropped and hello.role == "main")
            if not late and session in fanout.hellos:
                logger.warning("PDD: %s registered twice for room %s; keeping the first", session, room)
                return
            if not late:
                # The role first: the engine for a replayed chunk is chosen by it.
                if hello.role == "main":
                    self._main_sessions.add(session)
                LEDGER.set_role(session, hello.role)  # labels the figures only
                fanout.hellos[session] = hello
                start_now = hello.role == "relay" and fanout.expected == 2 and not fanout.has("main")
                if hello.role == "main":
                    replay, fanout.unsent_to_main = fanout.unsent_to_main, []
        if late:
            self._refuse_late(room, session, info, hello.role)
            return
        logger.debug("PDD room %s: %s %s registered (prefill starts now: %s)", room, hello.role,
                     session, hello.role == "relay" and start_now)
        if hello.role == "relay" and start_now:
            with self._lock:
                fanout.started_on_relay = True
            self._start_on_relay(room)
        for chunk in replay:
            self._to_wan_path(chunk)

    def _start_on_relay(self, room: int) -> None:
        """Let prefill compute now; SGLang itself would wait for every destination."""
        from sglang.srt.disaggregation.base.conn import KVPoll

        infos = self.kv_mgr.transfer_infos.get(room)
        if not infos:
            return
        self.kv_mgr.req_to_decode_prefix_len[room] = self.room_send_start(room, infos)
        self.kv_mgr.update_status(room, KVPoll.WaitingForInput)

    def _refuse_late(self, room: int, session: str, info: Any, role: str) -> None:
        from sglang.srt.disaggregation.base.conn import KVPoll

        # Out of SGLang's table before its bootstrap thread counts destinations again.
        self.kv_mgr.transfer_infos.get(room, {}).pop(session, None)
        logger.warning(
            "PDD: %s %s registered for room %s after prefill went on without it; refused",
            role, session, room,
        )
        if info is not None:
            self.kv_mgr.send_kv_status_message(
                targets=[(info.endpoint, info.dst_port)], bootstrap_room=room,
                status=KVPoll.Failed,
                failure_reason=f"PDD: the {role} registered after the bootstrap deadline",
            )

    def drop_silent_relays(self, now: float | None = None) -> list[int]:
        """Rooms whose main registered but whose relay did not, in time: go on without it."""
        from sglang.srt.disaggregation.base.conn import KVPoll

        now = time.monotonic() if now is None else now
        dropped = []
        with self._lock:
            # Rooms SGLang has forgotten (failed or aborted before completing) go too.
            for room in [
                room for room, fanout in self._rooms.items()
                if room not in self.kv_mgr.transfer_infos and now - fanout.first_hello_at > STALE_ROOM_S
            ]:
                self._rooms.pop(room)
            for room, fanout in self._rooms.items():
                roles = {h.role for h in fanout.hellos.values()}
                if (
                    not fanout.relay_dropped
                    and roles == {"main"}
                    and fanout.expected == 2
                    and now - fanout.first_hello_at > self.relay_bootstrap_timeout_s
                ):
                    fanout.relay_dropped = True
                    dropped.append(room)
        for room in dropped:
            infos = self.kv_mgr.transfer_infos.get(room)
            if not infos:
                continue
            self.relays_dropped += 1
            logger.warning(
                "PDD: no relay registered for room %s within %.1f s of its main; sending to the "
                "main alone", room, self.relay_bootstrap_timeout_s,
            )
            self.kv_mgr.req_to_decode_prefix_len[room] = self.room_send_start(room, infos)
            self.kv_mgr.update_status(room, KVPoll.WaitingForInput)
        return dropped

    def drop_silent_mains(self, now: float | None = None) -> list[int]:
        """Rooms whose relay has all its KV but whose main never registered: conclude them.

        Prefill holds a room's KV until every destination has its part; a main that never comes
        (dead, or its request never reached it) must not pin that KV. The relay answers alone.
        """
        from sglang.srt.disaggregation.base.conn import KVPoll

        now = time.monotonic() if now is None else now
        dropped = []
        with self._lock:
            for room, fanout in self._rooms.items():
                relay_done = any(
                    ok and fanout.hellos.get(session) is not None
                    and fanout.hellos[session].role == "relay"
                    for session, ok in fanout.done.items()
                )
                if ((relay_done or fanout.relay_dropped) and fanout.awaits_main()
                        and now - fanout.first_hello_at > self.main_bootstrap_timeout_s):
                    fanout.main_dropped = True
                    fanout.unsent_to_main = []
                    dropped.append((room, fanout.relay_dropped))
        for room, relay_lost in dropped:
            self.mains_dropped += 1
            logger.warning(
                "PDD: no main registered for room %s within %.1f s of its relay; the relay "
                "answers alone and prefill frees the room's KV", room, self.main_bootstrap_timeout_s,
            )
            # The relay has had its Success (or is gone); nobody else is waiting on this room.
            self.kv_mgr.conclude_transfer(
                bootstrap_room=room, status=KVPoll.Failed if relay_lost else KVPoll.Success,
                targets=[], failure_reason="PDD: the relay died and no main registered" if relay_lost else None)
            if self.kv_mgr._staging_outstanding.get(room, 0) <= 0:
                self.kv_mgr.transfer_infos.pop(room, None)
                self.kv_mgr.req_to_decode_prefix_len.pop(room, None)
        return [room for room, _ in dropped]

    def destination_failed(self, req: Any) -> bool:
        """A transfer to ``req``'s destination failed: a relay drops out and its room goes on to
        main (which decodes from the first token); any other failure is SGLang's (the room fails)."""
        from sglang.srt.disaggregation.base.conn import KVPoll

        room, session = req.room, req.mooncake_session_id
        with self._lock:
            fanout = self._rooms.get(room)
            hello = fanout.hellos.get(session) if fanout is not None else None
            if (hello is None or hello.role != "relay" or fanout.main_dropped
                    or fanout.relay_dropped or session in fanout.done):
                return False
            # The hello stays (the room's shape); SGLang's table loses the relay, so no later
            # chunk is sent to it.
            fanout.relay_dropped = True
            complete = fanout.has("main") and len(fanout.done) >= fanout.expected
            all_ok = complete and all(fanout.done.values())
            if complete:
                self._rooms.pop(room, None)
        self.relays_dropped += 1
        relay = self.kv_mgr.transfer_infos.get(room, {}).pop(session, None)
        logger.warning("PDD: the transfer to relay %s of room %s failed; the room goes on to its "
                       "main alone", session, room)
        main = next(iter(self.kv_mgr.transfer_infos.get(room, {}).values()), None)

        def tell() -> None:
            if relay is not None:
                # A relay that is still up frees the request's slots now rather than at its
                # waiting timeout (a dead one never reads this; the send gives up after 1 s).
                self.kv_mgr.send_kv_status_message(
                    targets=[(relay.endpoint, relay.dst_port)], bootstrap_room=room,
                    status=KVPoll.Failed, failure_reason="PDD: the KV transfer to this relay failed")
            if complete:  # main had all its KV already: the room is done
                self.kv_mgr.conclude_transfer(
                    bootstrap_room=room, status=KVPoll.Success if all_ok else KVPoll.Failed,
                    targets=[] if main is None else [(main.endpoint, main.dst_port)])

        # SGLang calls this holding its session_lock: the sends (up to 1 s to a dead relay) go
        # out on the WAN path's housekeeping thread, never under that lock.
        (self.defer or (lambda job: job()))(tell)
        return True

    def is_pdd_room(self, room: int) -> bool:
        with self._lock:
            return room in self._rooms and bool(self._rooms[room].hellos)

    # ---- 2. where sending starts -------------------------------------------------------
    def room_send_start(self, room: int, transfer_infos: dict) -> int:
        prefixes = [info.decode_prefix_len for info in transfer_infos.values()]
        if not self.is_pdd_room(room):
            # SGLang's own rule: every destination of a room holds the same prefix.
            return next((p for p in prefixes if p is not None), 0)
        return min(p or 0 for p in prefixes)

    # ---- 3. which destinations this worker sends to -------------------------------------
    def destinations_on_this_path(self, kv_chunk: Any, reqs: Any, queue: Any) -> list:
        """``queue`` is the one the chunk came from: a WAN queue's chunk goes to mains only."""
        reqs = list(reqs)  # a live view of SGLang's table, which registrations change
        wan_worker = any(queue is q for q in self.wan_queues)
        with self._lock:
            fanout = self._rooms.get(kv_chunk.room)
            hellos = dict(fanout.hellos) if fanout else {}
            if hellos and not wan_worker and fanout.awaits_main():
                # Decided under the same lock as the main's registration: each chunk reaches
                # main exactly once, either replayed at registration or forwarded below.
                fanout.unsent_to_main.append(uncounted_copy(kv_chunk))
        if not hellos or not self.wan_queues:
            return reqs
        # Only destinations whose hello this chunk's decision saw: a main registering meanwhile
        # gets the chunk from its replay, not from here as well.
        known = [r for r in reqs if r.mooncake_session_id in hellos]
        wan = [r for r in known if _is_wan(hellos[r.mooncake_session_id])]
        if wan_worker:
            return wan
        if wan:
            self._to_wan_path(kv_chunk)
        return [r for r in known if r not in wan]

    def _to_wan_path(self, kv_chunk: Any) -> None:
        if self.wan_queues:
            self.wan_queues[kv_chunk.room % len(self.wan_queues)].put(
                uncounted_copy(kv_chunk), self._wan_charges(kv_chunk))

    def _wan_charges(self, kv_chunk: Any) -> list:
        """``(main session, bytes)`` this chunk will put on the line: pages past main's prefix."""
        with self._lock:
            fanout = self._rooms.get(kv_chunk.room)
            mains = [s for s, h in (fanout.hellos.items() if fanout else ()) if _is_wan(h)]
        return bytes_past_prefixes(self.kv_mgr, kv_chunk, mains)

    # ---- 4. pages past each destination's own prefix -----------------------------------
    def chunk_for_destination(self, room_chunk: Any, req: Any) -> Any:
        infos = self.kv_mgr.transfer_infos.get(room_chunk.room)
        if not infos or not self.is_pdd_room(room_chunk.room):
            return room_chunk
        page_size = self.kv_mgr.kv_args.page_size
        start = min(info.decode_prefix_len or 0 for info in infos.values())
        skip = (req.decode_prefix_len or 0) - start
        if room_chunk.is_last_chunk and skip > room_chunk.index_slice.stop * page_size:
            # Raising here would kill SGLang's transfer thread: fail the room instead.
            reason = (
                f"PDD: destination {req.mooncake_session_id} claims a {req.decode_prefix_len}-token "
                f"prefix, beyond the {start + room_chunk.index_slice.stop * page_size} tokens of "
                f"room {room_chunk.room}'s prompt"
            )
            logger.error(reason)
            self.kv_mgr.conclude_failure(bootstrap_room=room_chunk.room, failure_reason=reason)
            return dataclasses.replace(room_chunk, prefill_kv_indices=room_chunk.prefill_kv_indices[:0])
        return skip_prefix_pages(room_chunk, skip, page_size)

    # ---- 5. per-destination completion --------------------------------------------------
    def destination_sent(self, req: Any, ok: bool) -> None:
        from sglang.srt.disaggregation.base.conn import KVPoll

        room = req.room
        with self._lock:
            fanout = self._room(room)
            fanout.done[req.mooncake_session_id] = ok
            complete = len(fanout.done) >= fanout.expected
            all_ok = all(fanout.done.values())
            if complete:
                self._rooms.pop(room, None)
        if not ok:
            return  # SGLang's failure path has already concluded the room as Failed
        if not complete:
            # This destination has all its KV: let it start (the relay decodes eagerly) while
            # the others' copies are still in flight. Prefill keeps its KV until all are done.
            self.kv_mgr.send_kv_status_message(
                targets=[(req.endpoint, req.dst_port)], bootstrap_room=room, status=KVPoll.Success
            )
            return
        logger.info("PDD room %s sent: %s", room, LEDGER.request_summary(room))
        self.kv_mgr.conclude_transfer(
            bootstrap_room=room,
            status=KVPoll.Success if all_ok else KVPoll.Failed,
            targets=[(req.endpoint, req.dst_port)],
            failure_reason=None if all_ok else f"PDD fan-out of room {room} failed",
        )

    def _room(self, room: int) -> RoomFanout:
        fanout = self._rooms.get(room)
        if fanout is None:
            fanout = self._rooms[room] = RoomFanout()
            while len(self._rooms) > MAX_TRACKED_ROOMS:
                self._rooms.popitem(last=False)
        return fanout


def _is_wan(hello: Optional[DestinationHello]) -> bool:
    return hello is not None and hello.role == "main"
