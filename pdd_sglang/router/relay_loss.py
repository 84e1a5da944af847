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
   tokens from the next position it lacks (splice.py). But main only sees the drop of a
   connection it had: a relay that died before main first spoke to it (as in the fault suite,
   whose relay had handed nothing over yet) leaves main waiting ``--pdd-handoff-timeout`` after
   its copy landed. So once main's copy of the prompt has landed (the prefill answered: prefill
   finishes a request when its last copy lands) and main still says nothing for
   ``--relay-loss-main-grace-s``, the router aborts main's copy (main keeps the prompt's KV in
   its radix cache) and continues the request from the client's last token on a fresh placement
   (:mod:`resume`): prompt + emitted tokens, so only the emitted tokens' KV crosses the line.
   Main or prefill failing the request after the relay's loss (prefill fails a whole room when
   one of its copies fails) sends it the same way, whatever ``--retry-after-first-token`` says.
4. Main copies kept after the relay answered a request alone, only to cache its prompt
   (``landing.py``), are dropped when their relay leaves rotation: main would wait
   ``--pdd-handoff-timeout`` for the relay's refusal, then decode an answer nobody reads, while
   the line carries them ahead of the copies of requests that now all go P->MD.

What still needs the servers: main cannot take the relay's tokens from the router (only from the
relay's control channel), so step 3 costs the emitted tokens' KV on the line or main's decode
of them again, where a router-to-main handoff of the token ids (one EXTEND, as the relay's
handoff) would cost neither; and main cannot tell a relay that never accepted its connection from
a slow one, which is why step 3 needs the router at all.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Callable, Optional

from pdd_sglang.router.servers import Upstream

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


@dataclass(eq=False)
class _Kept:
    rid: str
    task: asyncio.Task
    drop: Callable[[], None]


@dataclass
class CachingCopies:
    """Main copies kept only to cache a prompt the relay already answered, by that relay."""

    _by_relay: dict = field(default_factory=dict)

    def keep(self, relay: Upstream, rid: str, task: asyncio.Task,
             drop: Callable[[], None]) -> None:
        """``drop`` cancels the copy (its stream and the WAN transfer feeding it)."""
        kept = _Kept(rid, task, drop)
        copies = self._by_relay.setdefault(relay, {})
        copies[rid] = kept
        task.add_done_callback(lambda _: self._forget(relay, rid))

    def _forget(self, relay: Upstream, rid: str) -> None:
        copies = self._by_relay.get(relay, {})
        copies.pop(rid, None)
        if not copies:
            self._by_relay.pop(relay, None)

    def drop_for(self, relay: Upstream) -> list[str]:
        """Drop every copy kept for ``relay``; the rids dropped."""
        copies = list(self._by_relay.pop(relay, {}).values())
        for kept in copies:
            kept.drop()
        return [kept.rid for kept in copies]

    def __len__(self) -> int:
        return sum(len(copies) for copies in self._by_relay.values())
