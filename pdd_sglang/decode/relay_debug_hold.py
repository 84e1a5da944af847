"""The relay's test-only handoff hold (``--pdd-debug-handoff-hold`` and a route's
``debug_handoff_after_tokens``): a request at its forced handoff point waits for main out of the
relay's batch, so a test hands off after exactly that many tokens however late main is ready.

Under the hold a Catch-Up request one token short of its length limit also leaves the batch until
main has every token, so the test's outcome does not hang on how fast main absorbs chunks next to
how fast the relay decodes (a CI run where servers started beside the test starved main, and the
relay finished the request alone mid Catch-Up)."""

from __future__ import annotations

from typing import Any

from pdd_sglang import policy
from pdd_sglang.decode.relay_state import Handing
from pdd_sglang.decode.route_cache import route_for

# A HandoffReady may beat the relay's own copy of the request into its running batch (the
# relay's prebuilt step lags a little); past this, the room is unknown. Also how long a held or
# handed request waits for main.
READY_WAIT_S = 30.0


class DebugHold:
    """Mixed into :class:`pdd_sglang.decode.relay.RelayHandoff` (its state lives there)."""

    def _hold_out(self, running_batch: Any, now: float) -> Any:
        """Take the requests at their forced handoff point out of the batch."""
        for room, (req, since) in list(self.held_out.items()):
            if now - since > READY_WAIT_S and room not in self.active:
                del self.held_out[room]
                self._abort(req, "PDD debug handoff hold: main never became ready")
        moved = []
        for req in running_batch.reqs:
            room = req.bootstrap_room
            route = route_for(req)
            if (route is None or route.debug_handoff_after_tokens is None or req.finished()
                    or getattr(req, "_pdd_resumed", False)
                    or room in self.pending or room in self.active or room in self.held_out):
                continue
            if self._hold_satisfied(req):
                moved.append(req)
                self.held_out[room] = (req, now)
        return self._leave_batch(running_batch, moved)

    def _hold_catch_up_tail(self, running_batch: Any, now: float) -> Any:
        """Take out of the batch each held-route Catch-Up request that its next token would
        finish: it stays out until main acknowledges its last chunk (or refuses, or the ack times
        out, and the relay resumes it)."""
        moved = []
        for req in running_batch.reqs:
            room = req.bootstrap_room
            active = self.active.get(room)
            route = route_for(req)
            if (active is None or active.mode is not policy.HandoffMode.CATCH_UP
                    or active.state is Handing.AWAITING_FINAL_ACK or room in self.held_out
                    or route is None or route.debug_handoff_after_tokens is None
                    or len(req.output_ids) < req.sampling_params.max_new_tokens - 1):
                continue
            moved.append(req)
            self.held_out[room] = (req, now)
        return self._leave_batch(running_batch, moved)

    def _hold_satisfied(self, req: Any) -> bool:
        route = route_for(req)
        hold = route.debug_handoff_after_tokens if route is not None else None
        if hold is None or not self.args.pdd_debug_handoff_hold:
            return True
        # A request that can no longer reach the hold point hands off at its last token.
        reachable = min(hold, req.sampling_params.max_new_tokens - 1)
        return len(req.output_ids) >= reachable
