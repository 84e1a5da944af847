"""When a relay dies: its loss must cost a request time to its first token, never the answer.

What the router does, in the order a relay's death shows:

1. A relay that refuses a connection is out of rotation at once (nothing listens on its port);
   one whose stream breaks is probed at once (``HealthMonitor.probe``), not at its next poll.
2. A request whose relay refused its connection (it never saw the request) is placed again at
   once, from scratch, without that relay (P->MD unless another relay is up): left on its
   placement, prefill would wait ``--pdd-relay-bootstrap-timeout`` for a relay that never
   registers. A relay that had the request and died before its first token is step 3 with no
   token emitted: prefill goes on to main, whose copy is already on the line, partly sent; a
   fresh placement would put a second full copy behind it (the first one's batch in flight
   cannot be called back), and the line is what a relay's loss makes scarce.
3. A request whose relay is gone mid-answer goes on with main's stream: main decodes it from the
   first token once it sees the relay's control connection drop, and the client gets main's
   tokens from the next position it lacks (splice.py), and the prefill is told
   (``POST /pdd/relay_lost``): main's copy, which kept the small window of a copy a relay
   covers, goes on with the window that fills the line. But main only sees the drop of a
   connection it had: a relay that died before main first spoke to it (as in the fault suite,
   whose relay had handed nothing over yet) leaves main waiting ``--pdd-handoff-timeout`` after
   its copy landed. So once main's copy of the prompt has landed (the prefill answered: prefill
   finishes a request when its last copy lands) and main still says nothing for
   ``--relay-loss-main-grace-s``, the router aborts main's copy (main keeps the prompt's KV in
   its radix cache) and continues the request from the client's last token on a fresh placement
   (:mod:`resume`): prompt + emitted tokens, so only the emitted tokens' KV crosses the line.
   Main or prefill failing the request after the relay's loss (prefill fails a whole room when
   one of its copies fails) sends it the same way, whatever ``--retry-after-first-token`` says.
4. Main copies kept after the relay answered a request alone, only to cache its prompt, are
   dropped when their relay leaves rotation (``landing.py``).

Steps 2 and 3 are the fault paths below (:func:`relay_lost`, :func:`failed_after_the_relay_was_lost`,
:func:`main_never_noticed`), each run on the attempt whose relay was lost (``attempt.py``).

What still needs the servers: main cannot take the relay's tokens from the router (only from the
relay's control channel), so step 3 costs the emitted tokens' KV on the line or main's decode
of them again, where a router-to-main handoff of the token ids (one EXTEND, as the relay's
handoff) would cost neither; and main cannot tell a relay that never accepted its connection from
a slow one, which is why step 3 needs the router at all.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from pdd_sglang.router.landing import RELAY_LOST
from pdd_sglang.router.servers import Upstream
from pdd_sglang.router.upstream import UpstreamError

if TYPE_CHECKING:  # attempt.py runs these paths
    from pdd_sglang.router.attempt import Attempt

logger = logging.getLogger("pdd_sglang.router")

# Re-placements after relay losses that one request may take (each avoids the relays that
# failed it, so a second one means a second relay died under the same request).
MAX_RELAY_LOSS_REPLACEMENTS = 2


class RelayLost(RuntimeError):
    """An attempt given up because its relay is gone; ``Dispatcher.serve`` places the request
    again without ``relay``. ``cause`` is the relay's failure, what the client is told if the
    request cannot be placed again."""

    def __init__(self, relay: Upstream, cause: BaseException, emitted: int, why: str):
        super().__init__(f"relay {relay.url} lost after {emitted} tokens: {why}")
        self.relay = relay
        self.cause = cause
        self.emitted = emitted
        self.why = why


@dataclass
class MainSilence:
    """One request after its relay was lost: when main's silence means main never noticed.

    The deadline runs from whichever came last, the relay's loss or the landing of main's copy
    (before it lands main has nothing to decode from, noticed or not), and only while main has
    sent nothing: main streams nothing while it waits for a handoff, and from the first token
    once it decodes alone.
    """

    grace_s: float
    relay_lost_at: Optional[float] = None
    copy_landed_at: Optional[float] = None
    main_spoke: bool = False

    def deadline(self) -> Optional[float]:
        if self.main_spoke or self.relay_lost_at is None or self.copy_landed_at is None:
            return None
        return max(self.relay_lost_at, self.copy_landed_at) + self.grace_s

    def remaining(self, now: float) -> Optional[float]:
        deadline = self.deadline()
        return None if deadline is None else max(0.0, deadline - now)


def relay_lost(attempt: "Attempt", item) -> None:
    """The relay's stream broke before any handoff. The client sees a pause, then main's tokens
    from the next position it lacks: main, whose copy is already on the line (step 2), decodes
    from the first token. A relay that refused the connection never had the request: a longer
    wait, for a placement without it (step 2's first case)."""
    router, relay, splicer = attempt.router, attempt.placement.relay, attempt.splicer
    attempt.relay_failure = failure = item  # an UpstreamError, or its stream's early end
    router.metrics.errors.labels("relay_lost").inc()
    router.report(failure)
    if isinstance(failure, UpstreamError) and failure.refused and not splicer.emitted:
        raise RelayLost(relay, failure, 0, "refused before its first token")
    logger.warning("%s: relay %s lost (%s); going on with main %s", attempt.rid, relay.url,
                   failure, attempt.placement.main.url)
    splicer.relay_lost()
    attempt.silence.relay_lost_at = attempt.loop.time()
    router.abort([relay], attempt.rid)
    # The prefill does not see a relay die once it has its KV: main's copy is the request's only
    # way on now, and goes on with the window that fills the line (prefill/cache_only.py).
    router.cache_only_notices.tell(attempt.placement.prefill, attempt.body["bootstrap_room"],
                                   RELAY_LOST)
    router.shared.copy_uncovered(attempt.copy.get("main"))  # placement counts it from here


def failed_after_the_relay_was_lost(attempt: "Attempt", source: str, item) -> RelayLost:
    """Main or prefill failed the request after its relay was lost (prefill fails a whole room
    when one of its copies fails): the relay's loss is the cause. The client sees a pause, then
    the rest of its answer from a fresh placement without that relay (step 3)."""
    if isinstance(item, UpstreamError):
        attempt.router.report(item)
    return RelayLost(attempt.placement.relay, attempt.relay_failure,
                     len(attempt.splicer.emitted), f"{source} failed after it: {item}")


async def main_never_noticed(attempt: "Attempt") -> RelayLost:
    """Main's copy landed after the relay was lost and main stays silent: it never connected to
    the relay, so it waits for a handoff that never comes. The client sees a pause, then the rest
    of its answer from a fresh placement, from its last token (step 3)."""
    router, main, emitted = attempt.router, attempt.placement.main, len(attempt.splicer.emitted)
    logger.warning("%s: main %s silent %.1f s after its copy landed and relay %s was lost; "
                   "going on from token %d on a fresh placement", attempt.rid, main.url,
                   attempt.silence.grace_s, attempt.placement.relay.url, emitted)
    # Abort main's copy before the continuation reaches main: main then has the prompt in its
    # radix cache (an aborted held request keeps its landed KV there), and only the emitted
    # tokens' KV crosses the line.
    await router.client.abort(main, attempt.rid)
    router.shared.mirror_insert(main.url, attempt.job.prompt.key)
    return RelayLost(attempt.placement.relay, attempt.relay_failure, emitted,
                     "main never noticed")
