"""Main's WAN copies still landing after the client has its answer, and who should wait for them.

When the relay answers a request alone, the router finishes the client's request at once, but
main's copy of the prompt keeps crossing the WAN so main can cache it (``policy.cancel_wan_copy``
decides which copies go on). The conversation's next turn usually arrives before that copy has
landed. Sent to main at once, it would find only the older prefix in main's radix cache and pull
the same pages across the line a second time, beside the copy already on its way: twice the WAN
bytes, and every transfer behind them slower.

Life cycle of a kept copy (:func:`keep_mains_copy`, called by the attempt whose relay answered):

1. the prefill is told the copy is cache-only (``POST /pdd/cache_only``: it goes behind every copy
   a request waits for; :class:`CacheOnlyNotices` gathers rooms into one notice per prefill),
   and so is the router's line accounting;
2. the copy joins :class:`LandingCopies` (a :class:`Landing`, by main and by relay): the next
   turn counts only what main holds *now* when it is placed, and on P->RLD->MD reaches main only
   once the copy it extends has ended (at most ``--main-wait-for-landing-s``). The relay answers
   meanwhile, and prefill, which starts on the relay's registration, keeps the KV for main until
   it registers;
3. main's stream ends: the prefix mirror records the prompt only if the copy landed
   (:func:`copy_landed`), never when it failed or was dropped (the prefill drops a cache-only
   copy past its backlog bound); the copy leaves the table;
4. or its relay leaves rotation first (:meth:`LandingCopies.drop_for`): main would wait
   ``--pdd-handoff-timeout`` for the relay's refusal, then decode an answer nobody reads, while
   the line carries the copy ahead of the requests that now all go P->MD; it is dropped (3.).

Owner of the table and of the notices: the router's event loop (an attempt adds a copy, the
copy's end removes it).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

from pdd_sglang.protocol.messages import FINISHED_AT_RELAY
from pdd_sglang.router.prompt import Key, as_key
from pdd_sglang.router.upstream import UpstreamError

if TYPE_CHECKING:  # both import placement, which imports this module
    from pdd_sglang.router.attempt import Attempt
    from pdd_sglang.router.pumps import StreamEnd

logger = logging.getLogger("pdd_sglang.router")

NOTICE_INTERVAL_S = 0.01  # rooms gathered for this long go to their prefill in one notice
MAX_NOTICE_ROOMS = 4096  # per notice (pdd_sglang/prefill/cache_only.py, MAX_ROOMS)

# Main's relay refused its handoff because it answered the request alone (FINISHED_AT_RELAY,
# pdd_sglang/decode/main.py): main then aborts its copy with it in the message, and keeps the
# prompt's landed KV in its radix cache.
RELAY_ANSWERED_ALONE = FINISHED_AT_RELAY


def copy_landed(end: "StreamEnd") -> bool:
    """Whether main's copy landed, from how main's stream ended: main streamed tokens (it
    decoded on the landed KV), or it let go of the copy because the relay had answered alone.
    Any other end (a failed or dropped copy, a broken stream) leaves main without it."""
    if end.chunks:
        return True
    err = end.error
    return (isinstance(err, UpstreamError) and err.cause == "upstream_abort"
            and RELAY_ANSWERED_ALONE in err.message)


@dataclass(eq=False)
class Landing:
    prompt: Key  # the prompt's key (router/prompt.py: its text, or its tuple of ids)
    cached_before: int  # the tokens main held of this prompt when its copy started
    answered_by: Any = None  # the relay that answered the request (its Upstream)
    rid: str = ""
    drop: Optional[Callable[[], None]] = None  # cancels the copy and the transfer feeding it
    done: asyncio.Event = field(default_factory=asyncio.Event)
    name: str = ""  # among every worker's landing copies (router/shared_state.py)


class LandingCopies:
    def __init__(self) -> None:
        # By main, then by prompt: a prompt asked again while its copy lands (a retried or
        # repeated turn) adds a landing to its group, and a look-up compares each prompt once.
        self._by_main: dict[str, dict[Key, list[Landing]]] = {}
        self._by_relay: dict[Any, dict[str, Landing]] = {}

    def add(self, main_url: str, prompt: Key, cached_before: int, answered_by=None,
            rid: str = "", drop: Optional[Callable[[], None]] = None) -> Landing:
        """A copy to ``main_url``; ``answered_by``: the relay that answered its request, whose
        leaving drops it (``drop``)."""
        landing = Landing(as_key(prompt), cached_before, answered_by, rid, drop)
        self._by_main.setdefault(main_url, {}).setdefault(landing.prompt, []).append(landing)
        if answered_by is not None:
            self._by_relay.setdefault(answered_by, {})[rid] = landing
        return landing

    def ended(self, main_url: str, landing: Landing) -> None:
        """The copy landed, failed or was dropped: nobody waits for it any more."""
        landing.done.set()
        by_prompt = self._by_main.get(main_url, {})
        copies = by_prompt.get(landing.prompt, [])
        if landing in copies:
            copies.remove(landing)
            if not copies:
                del by_prompt[landing.prompt]
        if not by_prompt:
            self._by_main.pop(main_url, None)
        kept = self._by_relay.get(landing.answered_by, {})
        if kept.get(landing.rid) is landing:
            del kept[landing.rid]
            if not kept:
                self._by_relay.pop(landing.answered_by, None)

    def drop_for(self, relay) -> list[str]:
        """Drop every copy kept for ``relay`` (it left rotation); the rids dropped."""
        kept = list(self._by_relay.pop(relay, {}).values())
        for landing in kept:
            if landing.drop is not None:
                landing.drop()
        return [landing.rid for landing in kept]

    def predecessor(self, main_url: str, prompt: Key) -> Optional[Landing]:
        """The longest landing copy whose prompt begins ``prompt`` (the previous turn's); of
        several with that prompt, the oldest."""
        prompt, best = as_key(prompt), None
        by_prompt = self._by_main.get(main_url, {})
        for key in by_prompt:
            if (best is None or len(key) > len(best)) and _begins(prompt, key):
                best = key
        return None if best is None else by_prompt[best][0]

    def kept_for(self, relay) -> int:
        return len(self._by_relay.get(relay, ()))

    def __len__(self) -> int:
        return sum(len(copies) for by_prompt in self._by_main.values()
                   for copies in by_prompt.values())


def _begins(prompt: Key, key: Key) -> bool:
    """Whether ``prompt`` begins with ``key`` (a text with a text, ids with ids), without a
    copy of the prompt's head: prompts are thousands of tokens, looked up at every placement."""
    if isinstance(prompt, str):
        return isinstance(key, str) and prompt.startswith(key)
    return (isinstance(key, tuple) and len(key) <= len(prompt)
            and prompt[:len(key)] == key)


CACHE_ONLY, RELAY_LOST = "cache_only", "relay_lost"  # a notice's kind: /pdd/<kind> at the prefill


class CacheOnlyNotices:
    """Rooms told to their prefill in batches, one POST per prefill and kind per
    NOTICE_INTERVAL_S, not one per request: ``cache_only`` (the relay answered alone) and
    ``relay_lost`` (the relay died while it answered: main's copy is the request's only way on,
    relay_loss.py); never again to a prefill that answered 404 for that kind (a build older
    than its route)."""

    def __init__(self, client, spawn: Callable):
        self._client, self._spawn = client, spawn
        self._pending: dict[tuple, list[int]] = {}  # (prefill (its Upstream), kind) -> rooms
        self._without_route: set[tuple] = set()  # (prefill url, kind)

    def tell(self, prefill, room: int, kind: str = CACHE_ONLY) -> None:
        if (prefill.url, kind) in self._without_route:
            return
        if not self._pending:
            asyncio.get_running_loop().call_later(NOTICE_INTERVAL_S, self._flush)
        self._pending.setdefault((prefill, kind), []).append(room)

    def _flush(self) -> None:
        pending, self._pending = self._pending, {}
        for (prefill, kind), rooms in pending.items():
            for start in range(0, len(rooms), MAX_NOTICE_ROOMS):
                self._spawn(self._send(prefill, kind, rooms[start:start + MAX_NOTICE_ROOMS]))

    async def _send(self, prefill, kind: str, rooms: list[int]) -> None:
        if await self._client.relay_notice(prefill, kind, rooms) == 404:
            self._without_route.add((prefill.url, kind))
            logger.info("PDD router: prefill %s has no /pdd/%s; it goes on without that "
                        "notice", prefill.url, kind)


def keep_mains_copy(attempt: "Attempt") -> None:
    """The relay answered ``attempt``'s request alone, but main's WAN copy completes and main
    caches the prompt (the relay refuses main's handoff, main frees the request): the
    conversation's next turn still hits at main. Nothing more for the client."""
    router, placement, main_task = attempt.router, attempt.placement, attempt.tasks["main"]
    router.metrics.child(router.metrics.outcomes, "relay_finished_main_cached", "none").inc()
    router.cache_only_notices.tell(placement.prefill, attempt.body["bootstrap_room"])
    shared = router.shared
    shared.copy_cache_only(attempt.copy.get("main"))
    main_url, prompt = placement.main.url, attempt.job.prompt.key
    landing = shared.landing_started(main_url, prompt, placement.main_cached_tokens,
                                     placement.relay, attempt.rid, attempt.drop_mains_copy)

    def ended(task: asyncio.Task) -> None:
        if not task.cancelled() and copy_landed(task.result()):
            shared.mirror_insert(main_url, prompt)  # main has it now
        shared.landing_ended(main_url, landing)

    main_task.add_done_callback(ended)
