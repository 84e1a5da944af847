"""The relay's handoff hold (``--pdd-debug-handoff-hold``): a request whose test controls name a
handoff point (``handoff_after_tokens``) waits for main out of the relay's batch once it has that
many tokens, so a test hands off after exactly that many however late main is ready. (A test
that forces the mode too names it in the request's route, ``handoff_mode``, which the relay reads
with or without the hold.)

Under the hold a Catch-Up request one token short of its length limit also leaves the batch until
main has every token, so the test's outcome does not hang on how fast main absorbs chunks next to
how fast the relay decodes (a CI run where servers started beside the test starved main, and the
relay finished the request alone mid Catch-Up).

It works around the relay's own step (the seam's one relay point, ``relay_hand_off``): before it,
it takes requests at their handoff point out of the batch, and keeps main's request for a room
short of its point out of ``relay.pending`` for the step (put back after it, so main's request
waits); after it, the Catch-Up requests one token short. The hold takes requests out only
through the relay's own ``_leave_batch``, so they sit in the relay's ``out_of_batch`` and the
relay resumes, finishes or aborts them as any request out of its batch; the hold keeps only when
it took each (``held_since``). It holds a request once: not again after main asked for it, after
it was handed or after the relay resumed it.
"""

from __future__ import annotations

from typing import Any

from pdd_sglang import policy
from pdd_sglang.decode.relay import READY_WAIT_S
from pdd_sglang.decode.relay_state import Handing
from pdd_sglang.dev.debug_aids.controls import controls_for

# Set on a request the hold is done with (held once, or main asked for it).
_SPENT = "_pdd_debug_hold_spent"


class HandoffHold:
    """One relay's hold: at most one relay per scheduler process."""

    def __init__(self) -> None:
        self.held_since: dict[int, float] = {}  # room -> when the hold took it out

    def around_hand_off(self, relay: Any, running_batch: Any, now: float, hand_off) -> Any:
        """The relay's step, with requests short of their handoff point kept from it."""
        running_batch = self.before_handoffs(relay, running_batch, now)
        waiting = self.not_yet(relay, running_batch)
        for room in waiting:
            del relay.pending[room]
        asked = {room for room in self.held_since if room in relay.pending or room in relay.active}
        try:
            running_batch = hand_off(running_batch, now)
        finally:
            relay.pending.update(waiting)
        self.resume_given_up(relay, asked)
        return self.after_handoffs(relay, running_batch, now)

    def resume_given_up(self, relay: Any, asked: set) -> None:
        """A held request the relay's step stopped handing (main's copy damaged, a Catch-Up ack
        late) is out of the batch only because the hold took it: back in through the relay's
        own resume, as any request it takes back."""
        for room in asked:
            req = relay.out_of_batch.get(room)
            if req is not None and room not in relay.pending and room not in relay.active:
                relay._resume(req, "PDD debug handoff hold: the relay stopped handing it")

    def not_yet(self, relay: Any, running_batch: Any) -> dict:
        """main's pending requests for rooms the relay would hand off now but for the hold: the
        request is here, unfinished, and short of its point."""
        reqs = {req.bootstrap_room: req for req in running_batch.reqs}
        reqs.update(relay.out_of_batch)
        waiting = {}
        for room, pending in relay.pending.items():
            req = reqs.get(room)
            if (req is not None and not req.finished() and room not in relay.finished_rooms
                    and not self.may_hand_off(req)):
                waiting[room] = pending
        return waiting

    def before_handoffs(self, relay: Any, running_batch: Any, now: float) -> Any:
        """Take the requests at their handoff point out of the batch; abort one main never asked
        for within the relay's READY_WAIT_S."""
        for room, since in list(self.held_since.items()):
            req = relay.out_of_batch.get(room)
            if req is None:  # the relay resumed, finished or aborted it
                del self.held_since[room]
            elif now - since > READY_WAIT_S and room not in relay.active:
                del self.held_since[room]
                relay._abort(req, "PDD debug handoff hold: main never became ready")
        moved = []
        for req in running_batch.reqs:
            room = req.bootstrap_room
            if (controls_for(req).handoff_after_tokens is None or req.finished()
                    or getattr(req, _SPENT, False)):
                continue
            if room in relay.pending or room in relay.active or room in relay.out_of_batch:
                setattr(req, _SPENT, True)  # main asked for it: the relay takes it from here
            elif self.may_hand_off(req):
                setattr(req, _SPENT, True)
                moved.append(req)
                self.held_since[room] = now
        return relay._leave_batch(running_batch, moved)

    def after_handoffs(self, relay: Any, running_batch: Any, now: float) -> Any:
        """Take out of the batch each held-route Catch-Up request that its next token would
        finish: it stays out until main acknowledges its last chunk (or refuses, or the ack times
        out, and the relay resumes it)."""
        moved = []
        for req in running_batch.reqs:
            room = req.bootstrap_room
            active = relay.active.get(room)
            if (active is None or active.mode is not policy.HandoffMode.CATCH_UP
                    or active.state is Handing.AWAITING_FINAL_ACK or room in relay.out_of_batch
                    or controls_for(req).handoff_after_tokens is None
                    or len(req.output_ids) < req.sampling_params.max_new_tokens - 1):
                continue
            moved.append(req)
            self.held_since[room] = now
        return relay._leave_batch(running_batch, moved)

    @staticmethod
    def may_hand_off(req: Any) -> bool:
        """At its handoff point; a request that can no longer reach it hands off at its last
        token."""
        point = controls_for(req).handoff_after_tokens
        if point is None:
            return True
        return len(req.output_ids) >= min(point, req.sampling_params.max_new_tokens - 1)
