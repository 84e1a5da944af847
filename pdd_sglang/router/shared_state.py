"""The router's tables that every worker must see alike (``--workers N``), kept alike.

What is shared, and why:

- each main's prefix mirror (inserts, corrections by main's real hit, clears): a conversation's
  next turn finds its prefix at the main that holds it, whichever worker takes the turn, so it
  stays on that main;
- the copies still landing at main after the relay answered alone (their start and their end):
  the next turn waits for its predecessor's copy and counts what main holds now, whichever
  worker placed the predecessor;
- the line accounting's copies (begun, on the wire, cache-only, uncovered, landed, dropped):
  each worker's congestion-aware placement sees every worker's copies on the line, once each, as
  soon as they start; the prefills' line reports add only what no worker placed (each worker
  subtracts every worker's copies it knows at its poll), so a line's bytes are neither counted N
  times nor missed until the next poll.

What is not: outstanding requests per server (each worker balances its own), health and roles
(each worker polls each server once per interval, as one router did), the text-token estimate
(each learns from its own answers).

How: every worker holds a whole replica of these tables. :class:`SharedState` is the one way the
router changes them: a change is applied to this worker's replica and sent to every peer as one
event (:class:`PeerBus`: a Unix stream socket per pair of workers, made by the supervisor before
it forks them, router/workers.py); a peer applies it to its replica. The events are messages of
pdd_sglang/protocol/messages.py (``RouterEvent``; the bus's first, ``WorkerHello``, names their
version). One worker's events reach a peer in the order it made them. A copy or a landing copy is named by its worker and a number, so
its end finds it. With one worker there is no bus and nothing is sent.

Owner: each worker's event loop owns its replica; a peer's events are applied on it, between two
of its own steps.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import struct
from typing import Callable, Optional

from pdd_sglang.protocol.messages import (ROUTER_EVENTS_VERSION, CopyBegun, CopyCacheOnly,
                                         CopyEnded, CopyOnWire, CopyUncovered, LandingEnded,
                                         LandingStarted,
                                         MirrorHit, MirrorInsert, MirrorsCleared, WorkerHello,
                                         decode_router_event, encode_router_event)
from pdd_sglang.router.landing import Landing, LandingCopies
from pdd_sglang.router.line_state import Copy, LineAccounting
from pdd_sglang.router.prefix_mirror import PrefixMirror
from pdd_sglang.router.prompt import Key, as_key

logger = logging.getLogger("pdd_sglang.router")

_FRAME = struct.Struct("!I")  # each event: its length, then its msgpack bytes


def encode(event) -> bytes:
    """One frame of the bus: ``event``'s length, then its bytes (protocol/messages.py)."""
    payload = encode_router_event(event)
    return _FRAME.pack(len(payload)) + payload


def _wire_key(key: Key):
    return key if isinstance(key, str) else list(key)


class SharedState:
    """The replicated tables' one writer on this worker (see the module's docstring)."""

    def __init__(self, mirrors: dict[str, PrefixMirror], landing: LandingCopies,
                 lines: LineAccounting, worker: int = 0, bus: Optional["PeerBus"] = None):
        self.mirrors, self.landing, self.lines = mirrors, landing, lines
        self.worker, self.bus = worker, bus
        self._numbers = itertools.count()
        self._copies: dict[str, Copy] = {}  # peers' open copies by name
        self._landings: dict[str, Landing] = {}  # peers' landing copies by name

    def _send(self, event) -> None:
        if self.bus is not None:
            self.bus.send(event)

    def _name(self) -> str:
        return f"{self.worker}:{next(self._numbers)}"

    # ---- this worker's changes -------------------------------------------------------------
    def mirror_insert(self, main_url: str, key: Key) -> None:
        self.mirrors[main_url].insert(key)
        self._send(MirrorInsert(main_url, _wire_key(key)))

    def mirror_hit(self, main_url: str, key: Key, held: int) -> None:
        self.mirrors[main_url].observe_hit(key, held)
        self._send(MirrorHit(main_url, _wire_key(key), held))

    def mirrors_cleared(self) -> None:
        for mirror in self.mirrors.values():
            mirror.clear()
        self._send(MirrorsCleared())

    def landing_started(self, main_url: str, key: Key, cached_before: int, answered_by,
                        rid: str, drop: Callable[[], None]) -> Landing:
        landing = self.landing.add(main_url, key, cached_before, answered_by, rid, drop)
        landing.name = self._name()
        self._send(LandingStarted(landing.name, main_url, _wire_key(key), cached_before))
        return landing

    def landing_ended(self, main_url: str, landing: Landing) -> None:
        self.landing.ended(main_url, landing)
        self._send(LandingEnded(landing.name, main_url))

    def copy_begun(self, main_url: str, kv_bytes: float, relay_covered: bool = False) -> Copy:
        copy = self.lines.begin(main_url, kv_bytes, relay_covered=relay_covered)
        copy.name = self._name()
        self._send(CopyBegun(copy.name, main_url, copy.kv_bytes, copy.started, relay_covered))
        return copy

    def copy_on_wire(self, copy: Optional[Copy]) -> None:
        if copy is not None and copy.open:
            self.lines.on_wire(copy)
            self._send(CopyOnWire(copy.name, copy.started))

    def copy_cache_only(self, copy: Optional[Copy]) -> None:
        if copy is not None and copy.open:
            self.lines.cache_only(copy)
            self._send(CopyCacheOnly(copy.name))

    def copy_uncovered(self, copy: Optional[Copy]) -> None:
        if copy is not None and copy.open and copy.relay_covered:
            self.lines.uncover(copy)
            self._send(CopyUncovered(copy.name))

    def copy_ended(self, copy: Copy, landed: bool) -> None:
        if not copy.open:
            return
        at = self.lines.now()
        if landed:
            self.lines.land(copy, at)
        else:
            self.lines.drop(copy)
        self._send(CopyEnded(copy.name, landed, at))

    # ---- a peer's changes ------------------------------------------------------------------
    def apply(self, event) -> None:
        """A peer's event, applied to this worker's replica (never sent on)."""
        if isinstance(event, MirrorInsert):
            self._mirror(event.main).insert(as_key(event.key))
        elif isinstance(event, MirrorHit):
            self._mirror(event.main).observe_hit(as_key(event.key), event.held)
        elif isinstance(event, MirrorsCleared):
            for mirror in self.mirrors.values():
                mirror.clear()
        elif isinstance(event, LandingStarted):
            self._landings[event.name] = self.landing.add(event.main, as_key(event.key),
                                                          event.cached_before)
        elif isinstance(event, LandingEnded):
            landing = self._landings.pop(event.name, None)
            if landing is not None:
                self.landing.ended(event.main, landing)
        else:
            self._apply_copy(event)

    def _apply_copy(self, event) -> None:
        if isinstance(event, CopyBegun):
            self._copies[event.name] = self.lines.begin(event.main, event.kv_bytes, event.started,
                                                        event.relay_covered)
            return
        copy = self._copies.get(event.name)
        if copy is None:
            return
        if isinstance(event, CopyOnWire):
            self.lines.on_wire(copy, event.at)
        elif isinstance(event, CopyCacheOnly):
            self.lines.cache_only(copy)
        elif isinstance(event, CopyUncovered):
            self.lines.uncover(copy)
        elif isinstance(event, CopyEnded):
            del self._copies[event.name]
            if event.landed:
                self.lines.land(copy, event.at)
            else:
                self.lines.drop(copy)

    def _mirror(self, main_url: str) -> PrefixMirror:
        return self.mirrors[main_url]


class PeerBus:
    """This worker's connections to every other worker: events out, a peer's events in."""

    def __init__(self, worker: int, sockets: list[socket.socket]):
        self.worker = worker
        self._sockets = sockets
        self._transports: list[asyncio.Transport] = []
        self.peers_lost: list[int] = []

    async def start(self, state: SharedState) -> None:
        """Connect to the peers (a hello each), then apply what they send to ``state``."""
        loop = asyncio.get_running_loop()
        for sock in self._sockets:
            transport, _ = await loop.create_unix_connection(
                lambda: _PeerProtocol(state, self), sock=sock)
            transport.write(encode(WorkerHello(ROUTER_EVENTS_VERSION, self.worker)))
            self._transports.append(transport)
        self._sockets = []

    def send(self, event) -> None:
        frame = encode(event)
        for transport in self._transports:
            transport.write(frame)

    def close(self) -> None:
        for transport in self._transports:
            transport.close()
        self._transports = []


class _PeerProtocol(asyncio.Protocol):
    def __init__(self, state: SharedState, bus: PeerBus):
        self.state, self.bus = state, bus
        self._buffer = bytearray()
        self.peer: Optional[int] = None

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        start = 0
        while len(buffer) - start >= _FRAME.size:
            (length,) = _FRAME.unpack_from(buffer, start)
            end = start + _FRAME.size + length
            if len(buffer) < end:
                break
            self._take(decode_router_event(buffer[start + _FRAME.size:end]))
            start = end
        del buffer[:start]

    def _take(self, message) -> None:
        if isinstance(message, WorkerHello):
            if message.version != ROUTER_EVENTS_VERSION:
                raise RuntimeError(f"router worker {message.worker} speaks events version "
                                   f"{message.version}, this one {ROUTER_EVENTS_VERSION}")
            self.peer = message.worker
            return
        self.state.apply(message)

    def connection_lost(self, exc) -> None:
        # The supervisor stops every worker when one exits (router/workers.py).
        logger.warning("PDD router worker %s: lost router worker %s (%r)", self.bus.worker,
                       self.peer, exc)
        self.bus.peers_lost.append(self.peer)
