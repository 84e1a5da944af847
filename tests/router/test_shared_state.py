"""The replicated tables of ``--workers`` (router/shared_state.py): every event survives the wire,
and a peer that applies a worker's events holds what that worker holds. Pure logic."""

from __future__ import annotations

import asyncio

import pytest

from pdd_sglang.protocol import messages as msg
from pdd_sglang.router import shared_state as ss
from pdd_sglang.router.landing import LandingCopies
from pdd_sglang.router.line_state import MIN_SAMPLE_BYTES, LineAccounting
from pdd_sglang.router.prefix_mirror import PrefixMirror

EVENTS = [msg.MirrorInsert("m", "hello"), msg.MirrorInsert("m", [1, 2, 3]),
          msg.MirrorHit("m", "hello", 2), msg.MirrorsCleared(),
          msg.LandingStarted("0:1", "m", [1, 2], 1), msg.LandingEnded("0:1", "m"),
          msg.CopyBegun("0:2", "m", 5000, 12.5), msg.CopyOnWire("0:2", 13.0),
          msg.CopyBegun("0:3", "m", 7000, 12.6, relay_covered=True), msg.CopyUncovered("0:3"),
          msg.CopyCacheOnly("0:2"), msg.CopyEnded("0:2", True, 14.0), msg.WorkerHello(1, 3)]


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_every_event_survives_the_wire(event):
    frame = ss.encode(event)
    assert msg.decode_router_event(frame[ss._FRAME.size:]) == event
    assert ss._FRAME.unpack_from(frame)[0] == len(frame) - ss._FRAME.size


class Wire:
    """A bus to one peer, in memory: what one worker sends, the other applies."""

    def __init__(self):
        self.peer: ss.SharedState | None = None

    def send(self, event) -> None:
        self.peer.apply(msg.decode_router_event(ss.encode(event)[ss._FRAME.size:]))


def replica(worker: int, wire: Wire | None = None) -> ss.SharedState:
    return ss.SharedState({"m": PrefixMirror(10**6)}, LandingCopies(), LineAccounting(),
                          worker, wire)


def test_a_peer_holds_what_a_worker_changed():
    async def scenario():
        wire = Wire()
        mine, peer = replica(0, wire), replica(1)
        wire.peer = peer
        mine.mirror_insert("m", "system prompt, then turn 1")
        mine.mirror_insert("m", (5, 6, 7))
        assert peer.mirrors["m"].match_length("system prompt, then turn 2") == 25
        assert peer.mirrors["m"].match_length([5, 6, 7, 8]) == 3
        mine.mirror_hit("m", "system prompt, then turn 1", 6)
        assert peer.mirrors["m"].match_length("system prompt") == 6

        landing = mine.landing_started("m", "conversation, turn 1", 0, None, "rid", lambda: None)
        theirs = peer.landing.predecessor("m", "conversation, turn 1 and turn 2")
        assert theirs is not None and not theirs.done.is_set()
        mine.landing_ended("m", landing)
        assert theirs.done.is_set() and peer.landing.predecessor("m", "conversation") is None

        copy = mine.copy_begun("m", 2 * MIN_SAMPLE_BYTES)
        assert peer.lines.bytes_ahead("m") == 2 * MIN_SAMPLE_BYTES  # at once, not at a poll
        mine.copy_cache_only(copy)
        assert peer.lines.bytes_ahead("m") == 0
        mine.copy_ended(copy, landed=True)
        assert peer.lines.measured_bytes_per_s("m") == mine.lines.measured_bytes_per_s("m")
        handoff = mine.copy_begun("m", 3000, relay_covered=True)
        assert peer.lines.bytes_ahead("m") == 0  # its relay answers meanwhile: a later tier
        mine.copy_uncovered(handoff)  # the relay was lost
        assert peer.lines.bytes_ahead("m") == 3000
        mine.copy_ended(handoff, landed=False)
        assert peer.lines.bytes_ahead("m") == 0
        mine.mirrors_cleared()
        assert peer.mirrors["m"].match_length([5, 6, 7]) == 0

    asyncio.run(scenario())


def test_a_worker_alone_sends_nothing():
    alone = replica(0)
    copy = alone.copy_begun("m", 10)
    alone.copy_ended(copy, landed=False)
    assert alone.lines.bytes_ahead("m") == 0
