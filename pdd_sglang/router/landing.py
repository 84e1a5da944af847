"""Main's WAN copies still landing after the client has its answer, and who should wait for them.

When the relay answers a request alone, the router finishes the client's request at once, but
main's copy of the prompt keeps crossing the WAN so main can cache it (``policy.cancel_wan_copy``
decides which copies go on). The conversation's next turn usually arrives before that copy has
landed. Sent to main at once, it would find only the older prefix in main's radix cache and pull
the same pages across the line a second time, beside the copy already on its way: twice the WAN
bytes, and every transfer behind them slower.

So the router remembers each landing copy (:class:`Landing`), counts only what main holds *now*
when it places the next turn (the mirror already counts the landing prompt), and on P->RLD->MD
sends that turn to main only once the copy it extends has landed (at most
``--main-wait-for-landing-s``). The relay answers meanwhile, and prefill, which starts on the
relay's registration, keeps the KV for main until it registers.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Optional, Sequence


@dataclass(eq=False)
class Landing:
    prompt: tuple
    cached_before: int  # what main held of this prompt when its copy started
    done: asyncio.Event = field(default_factory=asyncio.Event)


class LandingCopies:
    def __init__(self) -> None:
        self._by_main: dict[str, list[Landing]] = {}

    def add(self, main_url: str, prompt: Sequence[int], cached_before: int) -> Landing:
        landing = Landing(tuple(prompt), cached_before)
        self._by_main.setdefault(main_url, []).append(landing)
        return landing

    def landed(self, main_url: str, landing: Landing) -> None:
        landing.done.set()
        copies = self._by_main.get(main_url, [])
        if landing in copies:
            copies.remove(landing)
        if not copies:
            self._by_main.pop(main_url, None)

    def predecessor(self, main_url: str, prompt: Sequence[int]) -> Optional[Landing]:
        """The longest landing copy whose prompt begins ``prompt`` (the previous turn's)."""
        best = None
        for landing in self._by_main.get(main_url, []):
            n = len(landing.prompt)
            if n <= len(prompt) and (best is None or n > len(best.prompt)) \
                    and tuple(prompt[:n]) == landing.prompt:
                best = landing
        return best

    def cached_now(self, main_url: str, prompt: Sequence[int], mirror_match: int) -> int:
        """The mirror's match, less the part of it still crossing the WAN."""
        landing = self.predecessor(main_url, prompt)
        return mirror_match if landing is None else min(mirror_match, landing.cached_before)

    def __len__(self) -> int:
        return sum(len(v) for v in self._by_main.values())
