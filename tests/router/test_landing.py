"""Main's copies still landing: the next turn sees only what main holds now, and waits for them."""

from __future__ import annotations

import asyncio

from pdd_sglang.router.landing import LandingCopies


def test_the_next_turn_finds_its_predecessor_and_counts_only_what_main_holds_now():
    copies = LandingCopies()
    turn1 = list(range(100))
    landing = copies.add("http://main", turn1, cached_before=60)
    turn2 = turn1 + [7, 8, 9]
    assert copies.predecessor("http://main", turn2) is landing
    # Another main, another conversation, or a prompt that diverges inside turn 1: no wait.
    assert copies.predecessor("http://other", turn2) is None
    assert copies.predecessor("http://main", [1] + turn2) is None
    assert copies.predecessor("http://main", turn1[:50]) is None
    copies.ended("http://main", landing)
    assert landing.done.is_set() and len(copies) == 0
    assert copies.predecessor("http://main", turn2) is None


def test_the_longest_landing_prefix_wins():
    copies = LandingCopies()
    short = copies.add("m", [1, 2], cached_before=0)
    long = copies.add("m", [1, 2, 3, 4], cached_before=2)
    assert copies.predecessor("m", [1, 2, 3, 4, 5]) is long
    assert copies.predecessor("m", [1, 2, 9]) is short
    copies.ended("m", long)
    copies.ended("m", long)  # a second report of the same landing changes nothing
    assert copies.predecessor("m", [1, 2, 3, 4, 5]) is short and len(copies) == 1


def test_a_waiter_wakes_when_the_copy_lands():
    async def scenario():
        copies = LandingCopies()
        landing = copies.add("m", [1, 2, 3], cached_before=0)
        waiter = asyncio.create_task(landing.done.wait())
        await asyncio.sleep(0)
        assert not waiter.done()
        copies.ended("m", landing)
        await asyncio.wait_for(waiter, 1)

    asyncio.run(scenario())
