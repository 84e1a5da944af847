"""Splice the relay's eager tokens and main's tokens into one client stream (pure logic, no I/O).

The contract with the servers (pdd_sglang.decode):
  - relay hands off: its final chunk's finish reason is ``{"type": "pdd_handoff",
    "handed_tokens": n, "mode": ...}``; main's ``output_ids`` then start at generated position n
    (main streams nothing the relay already streamed).
  - relay finishes the request itself (EOS, stop, length; no ``pdd_handoff``): the relay's answer
    is the whole answer, and main's is ignored (the caller aborts main's copy).
  - P->MD: main's answer is the whole answer.
  - the relay's stream breaks before any handoff (the relay died): main decodes the request from
    the first token (pdd_sglang.decode.main notices the lost relay), and the client's stream
    goes on from main at the next position it has not seen (:meth:`StreamSplicer.relay_lost`).

Tokens are placed by *position*, never by arrival: a position already sent to the client must hold
the same token in every later chunk (else SpliceError: the two servers disagree), a position past
the end of what was sent must follow directly (else SpliceError: a gap). So the client never sees
a gap, a duplicate or a reordering, whatever the servers send.

The client's text only grows: what might still be cut (the start of a stop string, an incomplete
character) waits until it is known not to be, and the matched stop string is cut from what the
client never had (:mod:`pdd_sglang.router.stop_strings`). Token ids are never held back: SGLang
keeps a matched stop string's tokens in ``output_ids`` too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Sequence
from typing import Callable, Optional

from pdd_sglang.protocol.messages import HANDOFF_FINISH_TYPE
from pdd_sglang.router.detokenize import IncrementalDetokenizer
from pdd_sglang.router.stop_strings import StopStrings


class SpliceError(RuntimeError):
    """The relay's and main's streams cannot be joined into one consistent answer."""


class IdsPrefix(Sequence):
    """The first ``n`` ids of a list that only grows (an incremental stream's running ids): the
    chunk's cumulative ids without copying them at every chunk."""

    __slots__ = ("_ids", "_n")

    def __init__(self, ids: list[int], n: int):
        self._ids, self._n = ids, n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index):
        if isinstance(index, slice):
            if index.step is None and (index.start or 0) >= 0:
                stop = index.stop
                if stop is None:  # the tail a client lacks (app.py, each chunk)
                    return self._ids[index.start:self._n]
                if 0 <= stop <= self._n:
                    return self._ids[index]  # the common case, a slice inside the prefix
            return self._ids[:self._n][index] if index.step not in (None, 1) else \
                self._ids[slice(*index.indices(self._n))]
        if not -self._n <= index < self._n:
            raise IndexError(index)
        return self._ids[index % self._n]

    def __eq__(self, other) -> bool:
        return list(self) == list(other)


@dataclass
class UpstreamChunk:
    """One streamed /generate chunk from a server, normalised to cumulative form."""

    output_ids: Sequence[int]  # every token this server generated for the request so far
    text: Optional[str]  # this server's cumulative text (None: the router decodes)
    meta: dict
    finished: bool


@dataclass
class SplicedUpdate:
    """What the client is told next: cumulative ids and text plus the newly added ids."""

    new_ids: list[int]
    output_ids: Sequence[int]  # every id the client has (a view: list() it to keep or encode)
    text: str  # the client's whole text: every earlier update's text, extended
    meta: dict
    finished: bool
    source: str  # "relay" or "main"
    first_after_handoff: bool = False
    # The text of output_ids that follows ``text`` but may still be cut (a stop string's start):
    # a continuation of the answer (resume.py) goes on after it.
    held_text: str = ""


@dataclass
class StreamSplicer:
    """Joins one request's streams. ``with_relay`` False: main alone (P->MD)."""

    with_relay: bool
    decode: Callable[[list[int]], str]
    stops: StopStrings = field(default_factory=StopStrings)
    # start(decode, ids) -> (detokenizer, its text): how the router decodes main's tokens
    # (detokenize.py); None: IncrementalDetokenizer.
    start_detokenizer: Optional[Callable] = None
    emitted: list[int] = field(default_factory=list)
    text: str = ""  # the text of ``emitted``; the client has ``client_text``, a prefix of it
    client_text: str = ""
    handed_tokens: Optional[int] = None
    handoff_info: Optional[dict] = None  # the relay's pdd_handoff dict (mode etc., if it says)
    main_cached_tokens: Optional[int] = None  # set by the caller as soon as main reports it
    outcome: Optional[str] = None  # "main", "relay_finished", "handoff", "relay_lost" at the end
    relay_lost_at: Optional[int] = None  # positions the client had from the relay when it died
    diverged: bool = False  # after relay_lost: main sampled other tokens at those positions
    phase: str = field(init=False)
    _detok: Optional[IncrementalDetokenizer] = field(default=None, init=False)
    # ((phase, first position), ids of that stream already placed): see _place.
    _checked: tuple = field(default=(None, 0), init=False)
    _main_started: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self.phase = "relay" if self.with_relay else "main"

    @property
    def finished(self) -> bool:
        return self.phase == "done"

    def chunk(self, source: str, chunk: UpstreamChunk) -> Optional[SplicedUpdate]:
        """A chunk of ``source``'s stream ("relay" or "main", the phase the client reads): the
        client's next update, None when it adds nothing."""
        if source != self.phase:
            raise SpliceError(f"{source} chunk in phase {self.phase!r}")
        first_after_handoff = False
        if source == "relay":
            new_ids = self._relay_ids(chunk)
        else:
            new_ids, first_after_handoff = self._main_ids(chunk)
        finished = self.phase == "done"
        if not (new_ids or finished):
            return None
        return self._update(new_ids, chunk.meta, finished, source,
                            first_after_handoff and bool(new_ids))

    def relay_chunk(self, chunk: UpstreamChunk) -> Optional[SplicedUpdate]:
        return self.chunk("relay", chunk)

    def main_chunk(self, chunk: UpstreamChunk) -> Optional[SplicedUpdate]:
        return self.chunk("main", chunk)

    # ---- relay --------------------------------------------------------------------------
    def _relay_ids(self, chunk: UpstreamChunk) -> list[int]:
        """Place the relay's chunk; at its last, the relay finished alone or handed off."""
        new_ids = self._place(chunk.output_ids, 0)
        self.text = chunk.text if chunk.text is not None else self.decode(self.emitted)
        if not chunk.finished:
            return new_ids
        reason = chunk.meta.get("finish_reason")
        handoff = reason if isinstance(reason, dict) and reason.get("type") == HANDOFF_FINISH_TYPE else None
        if handoff is None:
            self.phase, self.outcome = "done", "relay_finished"
            return new_ids
        handed = handoff.get("handed_tokens")
        if not isinstance(handed, int) or not 0 <= handed <= len(self.emitted):
            raise SpliceError(f"relay handed {handed!r} tokens but streamed {len(self.emitted)}")
        self.handed_tokens, self.handoff_info = handed, handoff
        self.phase = "main"
        self._start_main_text()
        return new_ids

    def relay_lost(self) -> None:
        """The relay's stream broke before it handed anything over: go on with main's stream."""
        if self.phase != "relay" or not self.with_relay:
            raise SpliceError(f"relay lost in phase {self.phase!r}")
        self.phase = "main"
        self.relay_lost_at = len(self.emitted)
        self._start_main_text()

    def _start_main_text(self) -> None:
        """From here the router decodes main's tokens itself, incrementally (O(new tokens) per
        chunk, :mod:`pdd_sglang.router.detokenize`), after the relay's text."""
        start = self.start_detokenizer or IncrementalDetokenizer.start
        self._detok, decoded = start(self.decode, self.emitted)
        if self._detok.read_offset < len(self.emitted) and self.text != decoded:
            # The relay's last tokens end inside a character and its text shows them (as
            # U+FFFD, which the client was not sent): the router's decode up to the character's
            # start counts from here, the character comes whole with main's tokens.
            self.text = decoded

    # ---- main ---------------------------------------------------------------------------
    def _main_ids(self, chunk: UpstreamChunk) -> tuple[list[int], bool]:
        """Place main's chunk: its new ids, and whether they are main's first after the relay."""
        if self.main_cached_tokens is None:
            self.main_cached_tokens = chunk.meta.get("cached_tokens")
        first = self._main_start(chunk, self.handed_tokens or 0)
        first_after_handoff = self.with_relay and not self._main_started
        # Main streaming from position 0 after the client had tokens from the relay means it went
        # on alone (the relay died, or main's wait for the relay timed out): the client keeps what
        # it has, and gets main's tokens from the next position it has not seen.
        seen = self.handed_tokens if self.handed_tokens is not None else (self.relay_lost_at or 0)
        new_ids = self._place(chunk.output_ids, first, lenient=first == 0 < seen)
        if new_ids:
            self._main_started = True
        if self._detok is not None:
            piece = self._detok.step(self.emitted, final=chunk.finished)
            if piece:
                self.text += piece
        else:
            self.text = chunk.text if chunk.text is not None else self.decode(self.emitted)
        if chunk.finished:
            self.phase = "done"
            self.outcome = ("relay_lost" if self.relay_lost_at is not None
                            else "handoff" if self.with_relay else "main")
        return new_ids, first_after_handoff

    # ---- helpers ------------------------------------------------------------------------
    @staticmethod
    def _main_start(chunk: UpstreamChunk, expected: int) -> int:
        """The position of main's first streamed token.

        SGLang's ``completion_tokens`` counts every output token the request holds, the handed
        ones included, while main streams only from where its stream started; the difference is
        that start. Without the count, main started where it was expected to.
        """
        total = chunk.meta.get("completion_tokens")
        if isinstance(total, int) and total >= len(chunk.output_ids):
            return total - len(chunk.output_ids)
        return expected

    def _place(self, ids: list[int], first: int, lenient: bool = False) -> list[int]:
        """Check ``ids`` (at positions first..) against what was sent; return the new tail.

        ``lenient``: a disagreement on positions the client already has is recorded
        (``diverged``: a sampled answer drawn twice) instead of refused; those cannot be unsent.
        """
        emitted, count = self.emitted, len(ids)
        if first > len(emitted):
            raise SpliceError(f"gap: tokens start at position {first}, {len(emitted)} sent")
        overlap = min(len(emitted) - first, count)
        # A cumulative stream repeats its earlier ids in every chunk: those were checked (or
        # placed) with its previous chunk, so only the rest is compared (O(new ids) a chunk).
        key, checked = self._checked
        start = min(checked, overlap) if key == (self.phase, first) else 0
        if start < overlap and emitted[first + start:first + overlap] != list(ids[start:overlap]):
            if not lenient:
                raise SpliceError(f"servers disagree on positions {first}..{first + overlap}")
            self.diverged = True
        new_ids = list(ids[overlap:count]) if overlap < count else []
        emitted.extend(new_ids)
        self._checked = ((self.phase, first), count)
        return new_ids

    def _update(self, new_ids, meta, finished, source, first_after_handoff=False) -> SplicedUpdate:
        client_meta = dict(meta)
        client_meta["completion_tokens"] = len(self.emitted)
        if self.main_cached_tokens is not None:
            client_meta["cached_tokens"] = self.main_cached_tokens
        if not finished:
            client_meta["finish_reason"] = None
        text = self._grow_client_text(finished, meta.get("finish_reason"))
        held = "" if finished or len(self.text) == len(text) else self.text[len(text):]
        # The ids so far as a view of ``emitted``, which only grows: no copy per chunk.
        return SplicedUpdate(new_ids, IdsPrefix(self.emitted, len(self.emitted)), text,
                             client_meta, finished, source, first_after_handoff, held)

    def _grow_client_text(self, finished: bool, finish_reason) -> str:
        """The client's text after this update: ``text`` up to what may be sent now."""
        sent = len(self.client_text)
        if not finished:
            end = self.stops.sendable_end(self.text, sent)
        elif self._detok is not None:
            # The router's own decode: cut the matched stop string as SGLang would have.
            end = self.stops.final_end(self.text, sent, finish_reason)
        else:
            end = len(self.text)  # a server's own text, which SGLang cut already
        if end > sent:  # else nothing new (or a server whose text shrank: the client keeps its)
            self.client_text = self.text if end == len(self.text) else self.text[:end]
        return self.client_text
