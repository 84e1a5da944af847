"""The fan-out owner's clock: deadlines, SGLang's own end of a room, and probes of mains out.

A mixin of :class:`~pdd_sglang.prefill.fanout.PrefillFanout`, run on its owner thread only (every
``OWNER_TICK_S`` by :class:`~pdd_sglang.prefill.wan_path.WanPath`, and on a ``RoomCleared``
event): what it decides about a room it decides as the owner, with the owner's methods.

Each waiting state has its deadline here:
- a room whose main registered but whose relay did not: ``relay_bootstrap_timeout_s``, then the
  room goes to the main alone;
- a started room whose relay is done (or gone) but whose main never registered:
  ``main_bootstrap_timeout_s``, then the relay answers alone and prefill frees the KV;
- a chunk in a sender that never reports: ``stuck_after_s``, then its destination fails;
- a started room prefill never computes: ``abandon_after_s`` (the decode servers have stopped
  waiting by then), then it fails;
- a main out after a failed WAN copy: probed over the WAN engine every ``PROBE_INTERVAL_S``.
"""

from __future__ import annotations

import logging
from typing import Optional

from pdd_sglang.prefill.events import ProbeAnswered
from pdd_sglang.prefill.room import DestinationState, Room, RoomPhase

logger = logging.getLogger("pdd_sglang.prefill.fanout")

STALE_ROOM_S = 600.0
PROBE_INTERVAL_S = 2.0
# Mooncake's probe reaches a main whose line still stalls the data: a main out again within this
# long of coming back is probed after twice the wait, up to PROBE_INTERVAL_S * 2**MAX_BACKOFF.
FLAPPING_WITHIN_S = 60.0
MAX_BACKOFF = 5


class FanoutDeadlines:
    def tick(self, now: Optional[float] = None) -> None:
        """Deadlines, SGLang's own ending of a room, forgetting, and probes of mains out."""
        from sglang.srt.disaggregation.base.conn import KVPoll

        now = self.clock() if now is None else now
        status_table = self.kv_mgr.request_status
        for room in list(self._rooms.values()):
            status = status_table.get(room.room)
            age = now - room.first_hello_at
            if room.phase is RoomPhase.CONCLUDED:
                if age > STALE_ROOM_S:
                    self._forget(room)
                continue
            if status == KVPoll.Failed:
                # SGLang ended it (abort, its bootstrap timeout): free every destination too.
                self._conclude(room, "Failed", "PDD: prefill ended the request")
                continue
            if (room.phase is RoomPhase.SENDING and not room.chunk_seen
                    and now - room.started_at > self.abandon_after_s):
                # Its request never reached prefill's forward; the decode servers have given up
                # waiting (SGLANG_DISAGGREGATION_WAITING_TIMEOUT) and freed their slots.
                self.counters["rooms_abandoned"] += 1
                logger.warning("PDD: room %s got no KV within %.0f s of its start; failing it",
                               room.room, self.abandon_after_s)
                self._conclude(room, "Failed", "PDD: prefill never computed the request")
                continue
            if room.phase is RoomPhase.WAITING:
                if room.awaits_relay() and age > self.relay_bootstrap_timeout_s:
                    room.relay_dropped = True
                    self.counters["relays_dropped"] += 1
                    self._fail_partial_ranks(room, "relay")
                    if not room.active():  # main let the request go while the relay was awaited
                        self._conclude(room, "Failed", "PDD: no relay registered, and the main "
                                       "aborted its request")
                        continue
                    logger.warning("PDD: no relay registered for room %s within %.1f s of its "
                                   "main; sending to the main alone", room.room,
                                   self.relay_bootstrap_timeout_s)
                    self._start(room)
                elif age > STALE_ROOM_S:
                    self._forget(room)
                continue
            if (room.awaits_main() and room.relay_finished_or_gone()
                    and age > self.main_bootstrap_timeout_s):
                room.main_dropped = True
                room.chunks = []
                self.counters["mains_dropped"] += 1
                self._fail_partial_ranks(room, "main")
                if room.phase is RoomPhase.CONCLUDED:
                    continue
                logger.warning("PDD: no main registered for room %s within %.1f s; the relay "
                               "answers alone and prefill frees the room's KV", room.room,
                               self.main_bootstrap_timeout_s)
                if room.any_done():
                    self._conclude(room, "Success")
                else:
                    self._conclude(room, "Failed", "PDD: the relay is gone and no main registered")
                continue
            oldest = room.oldest_in_flight()
            if oldest is not None and now - oldest > self.stuck_after_s:
                self.counters["rooms_stuck"] += 1
                stuck = next(w for w in room.in_flight if w.started_at == oldest)
                logger.error("PDD: a KV transfer of room %s to %s has made no progress for %.0f s",
                             room.room, stuck.session, now - oldest)
                dest = room.destinations[stuck.session]
                if dest.state is DestinationState.REGISTERED:
                    self._fail_destination(room, dest, "PDD: the KV transfer stopped making "
                                           "progress", wan=dest.role == "main")
                room.in_flight.remove(stuck)  # its sender may never report: not waited for
                self._ack_if_drained(room, dest)
                if room.pending is not None and not room.in_flight:
                    self._conclude(room, *room.pending)
        self._probe_mains_out(now)
        self.drop_cache_only_backlog()
        self.published = self._snapshot()

    def _fail_partial_ranks(self, room: Room, role: str) -> None:
        """``role`` was dropped with some of its ranks registered here (a decode at a larger TP
        than prefill's; the others never came): those ranks must not wait for KV, nor be told
        Success for part of a server."""
        for dest in room.of_role(role):
            if dest.state is DestinationState.REGISTERED or dest.told is None:
                self._fail_destination(room, dest, f"PDD: not every rank of the {role} "
                                       "registered in time")

    def _on_cleared(self, room_id: int) -> None:
        room = self._rooms.get(room_id)
        if room is None:  # a plain room, or one whose registration is still to come: ended
            self._mark_concluded(room_id)  # a hello for it now is late, and refused
            return
        if room.phase is not RoomPhase.CONCLUDED:  # aborted, or failed at SGLang: let go too
            self._conclude(room, "Failed", "PDD: prefill ended the request", force=True)
        if room.in_flight and any(d.abort_acks for d in room.destinations.values()):
            room.forget_when_drained = True  # an aborted destination's ack waits on a sender
            return
        self._forget(room)

    def _forget(self, room: Room) -> None:
        if self._rooms.pop(room.room, None) is not None and room.phase is RoomPhase.CONCLUDED:
            self._concluded_tracked -= 1
        self.pdd_rooms.discard(room.room)

    def _take_main_out(self, session: str) -> None:
        """A WAN copy to ``session`` failed: out of placement (published) until a probe answers."""
        if session in self.mains_out:
            return
        now = self.clock()
        times, back_at = self._outs.get(session, (0, float("-inf")))
        times = times + 1 if now - back_at < FLAPPING_WITHIN_S else 1
        self._outs[session] = (times, back_at)
        wait = PROBE_INTERVAL_S * 2 ** min(times - 1, MAX_BACKOFF)
        self.mains_out[session] = now + wait
        logger.warning("PDD: main %s is out after a failed WAN transfer (%d time(s) in a row); "
                       "first WAN probe in %.0f s", session, times, wait)

    def _probe_mains_out(self, now: float) -> None:
        engine = self.wan_engine
        for session, due in list(self.mains_out.items()):
            if due > now or engine is None:
                continue
            self.mains_out[session] = now + PROBE_INTERVAL_S * 10  # one probe at a time

            def probe(session=session) -> None:
                self.events.put(ProbeAnswered(session, engine.probe(session)))

            self.peer_jobs(probe)

    def _on_probe(self, ev: ProbeAnswered) -> None:
        if ev.session not in self.mains_out:
            return
        if ev.ok:
            del self.mains_out[ev.session]
            self._outs[ev.session] = (self._outs.get(ev.session, (1, 0.0))[0], self.clock())
            logger.warning("PDD: main %s answers a WAN probe again; back in", ev.session)
        else:
            self.mains_out[ev.session] = self.clock() + PROBE_INTERVAL_S
