"""One PDD room at the prefill: its destinations, their progress, and the rules that move it.

Pure state and decisions, no threads and no SGLang calls: :class:`~pdd_sglang.prefill.fanout.
PrefillFanout` owns every :class:`Room` on its one thread and acts on what these methods decide.

A room moves through :class:`RoomPhase` once, forwards only:

    WAITING (a destination registered; prefill may not compute yet)
      -> SENDING (prefill computes; each chunk goes to every active destination)
      -> CONCLUDED (Success or Failed told to every destination; prefill's KV is SGLang's to free)

A destination moves through :class:`DestinationState`:

    REGISTERED -> DONE (its last chunk and the aux landed, every chunk before it too)
               -> FAILED (a chunk to it failed, or it was refused)
               -> ABORTED (it aborted its request: :mod:`pdd_sglang.prefill.aborts`)
    and a destination that never registered in time is *dropped* (the room's flag, not a state).
"""

from __future__ import annotations

import dataclasses
import enum
import time
from typing import Any, Optional


class RoomPhase(enum.Enum):
    WAITING = "waiting"
    SENDING = "sending"
    CONCLUDED = "concluded"


class DestinationState(enum.Enum):
    REGISTERED = "registered"
    DONE = "done"
    FAILED = "failed"
    ABORTED = "aborted"


@dataclasses.dataclass(eq=False)
class Work:
    """One chunk for one destination, already cut to the pages past that destination's prefix.

    The owner makes it and puts it on a sender's queue; the sender sets ``started_at`` when it
    takes it (a float written by one thread and only compared by the owner's stuck check).
    """

    room: int
    session: str
    role: str
    destination: Any  # SGLang's TransferInfo
    chunk: Any  # SGLang's TransferKVChunk, this destination's own copy
    started_at: Optional[float] = None
    cancelled: bool = False  # set by the owner: the sender skips it (and still reports)
    # Main-bound work only (prefill/wan_lines.py): its class (changed by the owner under the
    # lines' lock), its size, and the pages a sender has handed to Mooncake (the sender's; a
    # copy put back between slices resumes there).
    copy_class: Any = None  # a wan_lines.CopyClass
    # A relay of its room answers the request while this copy flies (set by the owner when it
    # queues the work, cleared once the relay fails): the copy keeps the small window
    # (wan_engine.background_window), as a cache-only one does.
    relay_covered: bool = False
    queued_at: float = 0.0  # when the owner put it on its line (monotonic)
    nbytes: int = 0
    pages: int = 0
    pages_done: int = 0
    # Its main destination's copy: the staging ring main named, if any (a packed copy's records
    # go there: prefill/wan_coded.py); shared by the destination's works.
    staged: Any = None


@dataclasses.dataclass
class Destination:
    """One registered session: a relay or main, or at a decode TP above prefill's one rank of it."""

    role: str  # "relay" or "main"
    info: Any  # SGLang's TransferInfo
    prefix_tokens: int
    state: DestinationState = DestinationState.REGISTERED
    routed: int = 0  # chunks put on its sender's queue
    completed: int = 0  # of those, reported back
    last_routed: bool = False  # the room's last chunk is among them
    told: Optional[str] = None  # the status it was told ("Success" / "Failed"), once
    abort_acks: list = dataclasses.field(default_factory=list)  # SGLang AckTargets, not sent yet
    staged: Any = None  # wan_coded.StagedCopy: a main destination's, with its staging ring if any

    @property
    def target(self) -> tuple:
        return (self.info.endpoint, self.info.dst_port)

    @property
    def dummy(self) -> bool:
        """SGLang's dummy registration (MLA, prefill TP above the decode's: the decode rank
        pulls its KV from one of the prefill ranks it registers with): it gets no KV and is
        told nothing, as SGLang's own worker does."""
        return bool(getattr(self.info, "is_dummy", False))

    def all_landed(self) -> bool:
        return self.last_routed and self.completed == self.routed


@dataclasses.dataclass
class Room:
    room: int
    declared: int  # destinations the hellos announce: 2 on P->RLD->MD, 1 on P->MD
    first_hello_at: float = dataclasses.field(default_factory=time.monotonic)
    phase: RoomPhase = RoomPhase.WAITING
    send_start: int = 0  # tokens: where prefill's chunks start (the smallest prefix)
    destinations: dict = dataclasses.field(default_factory=dict)  # session -> Destination
    relay_dropped: bool = False
    main_dropped: bool = False
    # Every chunk so far, in prefill's order: replayed to a main that registers late.
    chunks: list = dataclasses.field(default_factory=list)
    in_flight: list = dataclasses.field(default_factory=list)  # Work not reported back yet
    started_at: float = 0.0  # when prefill was let compute (WaitingForInput)
    chunk_seen: bool = False  # prefill has computed and handed over at least one chunk
    pending: Optional[tuple] = None  # (status, reason) decided while chunks were in a sender
    forget_when_drained: bool = False  # SGLang cleared it while an abort's ack waited on a sender
    cache_only: bool = False  # the relay answered alone: main's copy only warms its cache
    relay_lost: bool = False  # the router saw the relay die while it answered
    # role -> how many of its ranks register with this prefill rank (1 unless the decode runs a
    # larger TP: protocol.messages.sessions_per_prefill_rank), from its first hello.
    ranks: dict = dataclasses.field(default_factory=dict)

    def of_role(self, role: str) -> list[Destination]:
        """The sessions of ``role`` registered so far (one per decode rank paired with this
        prefill rank)."""
        return [d for d in self.destinations.values() if d.role == role]

    def role_in(self, role: str) -> bool:
        """Every rank of ``role`` that registers with this prefill rank has."""
        return role in self.ranks and len(self.of_role(role)) >= self.ranks[role]

    def active(self) -> list[Destination]:
        """Destinations still receiving: registered, neither failed nor done."""
        return [d for d in self.destinations.values() if d.state is DestinationState.REGISTERED]

    def awaits_main(self) -> bool:
        """A P->RLD->MD room whose main (every rank of it) has neither registered nor been
        dropped."""
        return self.declared >= 2 and not self.role_in("main") and not self.main_dropped

    def awaits_relay(self) -> bool:
        return self.declared >= 2 and not self.role_in("relay") and not self.relay_dropped

    def is_late(self, role: str) -> bool:
        """A registration the room went on without: refused."""
        if self.phase is RoomPhase.CONCLUDED:
            return True
        return (role == "relay" and self.relay_dropped) or (role == "main" and self.main_dropped)

    def ready_to_start(self) -> bool:
        """Prefill computes once the relay is in (the main's registration crosses the WAN and
        must not hold the relay's first token), or once the only destination is."""
        if self.phase is not RoomPhase.WAITING or not self.destinations:
            return False
        if self.declared < 2:
            return all(self.role_in(d.role) for d in self.destinations.values())
        return self.role_in("relay") or self.relay_dropped

    def start_tokens(self) -> int:
        return min(d.prefix_tokens for d in self.destinations.values())

    def finished(self) -> bool:
        """Every destination that will ever receive this room has all its KV."""
        if self.awaits_main() or self.awaits_relay():
            return False
        states = [d.state for d in self.destinations.values()]
        return (not self.in_flight and DestinationState.DONE in states
                and all(s is not DestinationState.REGISTERED for s in states))

    def any_done(self) -> bool:
        return any(d.state is DestinationState.DONE for d in self.destinations.values())

    def relay_serving(self) -> bool:
        """A relay of this room has registered and none of its ranks failed: the request's
        tokens come from it while main's copy flies."""
        relays = self.of_role("relay")
        return (not self.relay_dropped and not self.relay_lost and bool(relays)
                and all(d.state is not DestinationState.FAILED for d in relays))

    def relay_finished_or_gone(self) -> bool:
        return self.relay_dropped or (self.role_in("relay") and all(
            d.state is not DestinationState.REGISTERED for d in self.of_role("relay")))

    def oldest_in_flight(self) -> Optional[float]:
        started = [w.started_at for w in self.in_flight if w.started_at is not None]
        return min(started, default=None)
