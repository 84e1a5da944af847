"""A destination that aborts its request: the owner acks the abort once no sender still writes
its pages.

A mixin of :class:`~pdd_sglang.prefill.fanout.PrefillFanout`, on its owner thread (the claim runs on
SGLang's bootstrap thread and only posts).

SGLang's decode sends the prefill an ABORT when it aborts a request whose KV may still be coming,
and frees the request's pages only when the prefill acks (or after
``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT``). SGLang's prefill acks once its
transfer worker has no chunk of the room outstanding; a PDD room's chunks are never in that
worker, so SGLang would ack at once, and the decode would reuse pages a PDD sender is still
writing. It would also mark the whole room Failed, failing the relay for the main's abort. So
the abort of a PDD room is the fan-out's (patch 0006, ``_handle_abort_notification``):

1. The bootstrap thread claims the ABORT of a room whose registration it handed to the fan-out
   (:attr:`_claimed_rooms`, written by that thread only; a decode's ABORT follows its
   registration on the same socket) and posts :class:`~pdd_sglang.prefill.events.AbortNotified`.
2. The owner takes that destination out of the room (``ABORTED``: sent nothing more, told
   nothing) and cancels its queued work; the other destination goes on.
3. The ack goes out (on the peer thread) when no work of that destination is left in a sender:
   at once if none is, else on the report of the last one.
4. A room whose every destination is done, failed or aborted concludes, as on a failure.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any, Optional

from pdd_sglang.prefill.events import AbortNotified
from pdd_sglang.prefill.room import DestinationState, Room

logger = logging.getLogger("pdd_sglang.prefill.fanout")

CLAIMED_ROOMS_KEPT = 65536


class FanoutAborts:
    def _init_aborts(self) -> None:
        self._claimed_rooms: OrderedDict[int, None] = OrderedDict()  # bootstrap thread only

    def _note_claimed(self, room: int) -> None:
        """Bootstrap thread, for each registration it hands the fan-out."""
        self._claimed_rooms[room] = None
        self._claimed_rooms.move_to_end(room)
        while len(self._claimed_rooms) > CLAIMED_ROOMS_KEPT:
            self._claimed_rooms.popitem(last=False)

    def claim_abort(self, notification: Any) -> bool:
        """Bootstrap thread: True when the aborted room is PDD's (SGLang then neither marks it
        Failed nor acks it)."""
        if notification.room not in self._claimed_rooms:
            return False
        self.events.put(AbortNotified(notification.room, notification.decode_ip,
                                      notification.decode_port,
                                      notification.deferred_ack_target()))
        return True

    def _on_abort(self, ev: AbortNotified) -> None:
        room = self._rooms.get(ev.room)
        dest = None
        if room is not None:
            dest = next((d for d in room.destinations.values()
                         if d.target == (ev.decode_ip, ev.decode_port)), None)
        if dest is None:  # it never registered here, or the room is forgotten: nothing to wait
            self._send_abort_ack(ev.room, ev.ack_target)
            return
        if ev.ack_target is not None:
            dest.abort_acks.append(ev.ack_target)
        if dest.state is DestinationState.REGISTERED:
            self.counters["destinations_aborted"] += 1
            logger.info("PDD room %s: the %s aborted its request", room.room, dest.role)
            dest.state = DestinationState.ABORTED
            dest.told = "Failed"  # it let the request go itself: nothing to tell it
            for work in room.in_flight:
                if work.session == dest.info.mooncake_session_id:
                    work.cancelled = True
            if not room.active() and not room.awaits_main() and not room.awaits_relay():
                self._conclude(room, "Success" if room.any_done() else "Failed",
                               "PDD: every destination of the room aborted or failed")
        self._ack_if_drained(room, dest)

    def _ack_if_drained(self, room: Room, dest: Any) -> None:
        """Ack ``dest``'s aborts once no work of it is in a sender (it may still write)."""
        if not dest.abort_acks:
            return
        session = dest.info.mooncake_session_id
        if any(w.session == session for w in room.in_flight):
            return
        targets, dest.abort_acks = dest.abort_acks, []
        for target in targets:
            self._send_abort_ack(room.room, target)

    def _send_abort_ack(self, room: int, target: Optional[Any]) -> None:
        if target is None:  # a decode that did not arm its release waits for no ack
            return
        send = self.kv_mgr._send_abort_ack
        self.peer_jobs(lambda: send(room, target))
