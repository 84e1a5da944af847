"""The router's own view of the WAN line to each main, for congestion-aware placement.

Life cycle of a copy the router placed:

1. ``begin(main_url, kv_bytes)`` when the router sends a request to main (P->MD, or main's leg of
   P->RLD->MD): main's uncached suffix joins the bytes ahead of the next copy on that line.
2. ``on_wire(copy)`` when the KV is known to exist (on P->RLD->MD: the relay's first chunk, which
   needs prefill's forward done): the copy's clock restarts there, so prefill's queue and forward
   do not count as line time. (P->MD copies have no such mark; they are mostly small, under
   MIN_SAMPLE_BYTES, which keeps prefill's time out of the rate too.)
3. ``land(copy)`` when main shows it has the KV (its first chunk: it has run a forward on it), or
   ``drop(copy)`` when main's leg ends without (aborted, failed, cancelled). Landing records
   (start, end, bytes) among the recent copies.
4. ``state(main_url)`` is a :class:`pdd_sglang.policy.LineState`: the bytes a new copy waits
   behind (copies begun and not landed, less those marked ``cache_only``), and the throughput
   over the recent copies (their bytes over the time at least one of them was on the line, so
   copies sharing the line are not counted as slow).

A copy waits for the line in one of three tiers (:func:`pdd_sglang.policy.copy_tier`, the order
the prefill's line sends them in, pdd_sglang/prefill/wan_lines.py): *first-token* when its
request has no token without it (P->MD, or a P->RLD->MD request whose relay was lost:
``uncover(copy)``), *relay-covered* while a relay answers its request meanwhile (main's leg of
P->RLD->MD, from ``begin``), *cache-only* once its relay answered alone (``cache_only(copy)``:
it only warms main's cache). A new request's copy, placed P->MD, is first-token: it waits behind
first-token bytes, and for what a copy of a later tier has in flight (at most
``policy.BACKGROUND_IN_FLIGHT_S`` of line, the prefill's report counts it), not behind the
later tiers' queues. The placement predicts only that copy's time (``state``).

What this does not see: copies another router placed, and prefill's own queueing. Prefill sees
both: its /server_info carries ``pdd.wan_line``, bytes queued and in flight per main Mooncake
session and the throughput over its recent batches (pdd_sglang/prefill/wan_line.py), by tier
(``first_token_bytes_ahead``: first-token bytes queued and every byte in flight; a prefill
older than the tiers reports ``needed_now_bytes_ahead``, one older still ``bytes_ahead`` alone,
and those are read instead). The router polls it (``report``, summed over prefills). A fresh
report adds what it shows beyond the router's own first-token copies
that were open when the poll was sent or begun before its answer came (other routers' copies,
prefill's queue), so a copy the router saw land since the poll no longer counts, and one it
placed since counts once, whether or not the prefill saw it before answering; the report's rate
replaces the router's.

The poll reads ``GET /pdd/line``, the prefill's compact report (about 200 bytes per main,
written by a PDD thread of its scheduler process: pdd_sglang/diagnostics/line_report.py), which
costs the prefill nothing on its scheduler thread. A prefill without it (an older build, or
several HTTP workers) answers 404, and from then on that prefill's ``/server_info`` is read
instead, compactly (:func:`read_line_report`): it is large (its transfer ledger keeps up to
8,192 rows), and only the two small objects the router needs (``pdd.wan_line`` and
``pdd.fanout.mains_out``) are parsed; the rest is skipped as bytes.

Owner of the accounting: the router's event loop; its copies change only through
router/shared_state.py's SharedState (so every ``--workers`` process sees them), the reports
through the poller here.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from pdd_sglang import policy

LINE_REPORT_PATH = "/pdd/line"  # pdd_sglang.diagnostics.line_report.ROUTE
RECENT_COPIES = 16
REPORT_FRESH_S = 3.0  # a prefill report older than this (a missed poll) no longer counts
MIN_SAMPLE_BYTES = 1 << 20  # in smaller copies prefill's forward and round trips dominate

logger = logging.getLogger("pdd_sglang.router")


@dataclass(eq=False)
class Copy:
    main_url: str
    kv_bytes: int
    started: float
    open: bool = field(default=True)
    cache_only: bool = False  # its relay answered alone: no request waits for it
    relay_covered: bool = False  # a relay answers its request meanwhile (until lost)
    name: str = ""  # among every worker's copies (router/shared_state.py)


class LineAccounting:
    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._open: dict[str, list[Copy]] = {}
        self._first_token_bytes: dict[str, int] = {}  # the open first-token copies' bytes, by main
        self._begun_bytes: dict[str, int] = {}  # every copy's bytes ever begun, by main
        self._recent: dict[str, deque] = {}
        # url -> measured_bytes_per_s of _recent, until a copy lands there: every placement
        # reads it, a landing changes it.
        self._rates: dict[str, float | None] = {}
        # url -> (at, bytes beyond the router's own open copies, rate)
        self._reported: dict[str, tuple[float, int, float | None]] = {}
        # url -> KV bytes per wire byte the prefills' WAN codec reports (issue 36)
        self._wire_ratio: dict[str, float] = {}

    def report(self, main_url: str, bytes_ahead: int, bytes_per_s: float | None,
               own_bytes_at_poll: int | None = None, wire_ratio: float = 1.0) -> None:
        """What the prefills' WAN paths said about the line to ``main_url`` when polled:
        ``bytes_ahead`` a new copy would wait behind there (first-token bytes, and every byte in
        flight).

        ``own_bytes_at_poll``: this router's open first-token bytes to that main when the poll
        was sent (default: now); what the report shows beyond them is somebody else's.
        """
        rate = bytes_per_s if bytes_per_s and bytes_per_s > 0 else None
        own = self.bytes_ahead(main_url) if own_bytes_at_poll is None else own_bytes_at_poll
        self._reported[main_url] = (self._clock(), max(0, int(bytes_ahead) - own), rate)
        self._wire_ratio[main_url] = wire_ratio if wire_ratio and wire_ratio > 0 else 1.0

    def now(self) -> float:
        return self._clock()

    def begin(self, main_url: str, kv_bytes: int, started: float | None = None,
              relay_covered: bool = False) -> Copy:
        copy = Copy(main_url, max(0, int(kv_bytes)),
                    self._clock() if started is None else started, relay_covered=relay_covered)
        self._open.setdefault(main_url, []).append(copy)
        self._count(copy, +1)
        self._begun_bytes[main_url] = self._begun_bytes.get(main_url, 0) + copy.kv_bytes
        return copy

    def on_wire(self, copy: Copy | None, at: float | None = None) -> None:
        if copy is not None and copy.open:
            copy.started = max(copy.started, self._clock() if at is None else at)

    def land(self, copy: Copy, at: float | None = None) -> None:
        if self._close(copy) and copy.kv_bytes >= MIN_SAMPLE_BYTES:
            self._recent.setdefault(copy.main_url, deque(maxlen=RECENT_COPIES)).append(
                (copy.started, self._clock() if at is None else at, copy.kv_bytes))
            self._rates.pop(copy.main_url, None)

    def drop(self, copy: Copy) -> None:
        self._close(copy)

    def cache_only(self, copy: Copy | None) -> None:
        """The copy's relay answered alone: it goes on, behind every other tier."""
        if copy is not None and copy.open and not copy.cache_only:
            self._count(copy, -1)
            copy.cache_only = True

    def uncover(self, copy: Copy | None) -> None:
        """The copy's relay was lost: its request waits for it, first-token from now."""
        if copy is not None and copy.open and copy.relay_covered:
            copy.relay_covered = False
            self._count(copy, +1)

    def _close(self, copy: Copy) -> bool:
        if not copy.open:
            return False
        self._count(copy, -1)
        copy.open = False
        self._open[copy.main_url].remove(copy)
        return True

    def _count(self, copy: Copy, sign: int) -> None:
        """Add (+1) or take out (-1) an open copy's bytes where a first-token copy waits behind
        them."""
        if not copy.cache_only and not copy.relay_covered:
            url = copy.main_url
            self._first_token_bytes[url] = self._first_token_bytes.get(url, 0) + sign * copy.kv_bytes

    def bytes_ahead(self, main_url: str) -> int:
        """The router's own open first-token copies to ``main_url`` (every worker's): what a new
        P->MD copy waits behind of them."""
        return self._first_token_bytes.get(main_url, 0)  # kept as copies change: O(1)

    def begun_bytes(self, main_url: str) -> int:
        """Every copy's bytes ever begun to ``main_url`` (a running total: what two readings
        differ by was begun between them)."""
        return self._begun_bytes.get(main_url, 0)

    def measured_bytes_per_s(self, main_url: str) -> float | None:
        if main_url in self._rates:
            return self._rates[main_url]
        rate = self._rates[main_url] = self._measured_bytes_per_s(main_url)
        return rate

    def _measured_bytes_per_s(self, main_url: str) -> float | None:
        samples = sorted(self._recent.get(main_url, ()))
        if not samples:
            return None
        busy, end = 0.0, float("-inf")
        for start, stop, _ in samples:  # the union of the copies' time on the line
            if stop > end:
                busy += stop - max(start, end)
                end = stop
        total = sum(b for _, _, b in samples)
        return total / busy if busy > 0 else None

    def state(self, main_url: str) -> policy.LineState:
        ahead, rate = self.bytes_ahead(main_url), self.measured_bytes_per_s(main_url)
        at, foreign_ahead, reported_rate = self._reported.get(main_url, (None, 0, None))
        ratio = 1.0
        if at is not None and self._clock() - at <= REPORT_FRESH_S:
            ahead, rate = ahead + foreign_ahead, reported_rate or rate
            ratio = self._wire_ratio.get(main_url, 1.0)
        return policy.LineState(bytes_ahead=ahead, measured_bytes_per_s=rate, wire_ratio=ratio)


_WAN_LINE_KEY = b'"wan_line"'
_MAINS_OUT_KEY = b'"mains_out"'
_COLON = re.compile(rb"\s*:\s*")
_DECODER = json.JSONDecoder()
_WINDOW = 1 << 16  # bytes decoded after a key at first: the value is small


def _value_after(raw: bytes, key: bytes):
    """The JSON value right after the first ``"key":`` in ``raw`` (the first DP rank's), parsed
    alone (the rest of the body is never decoded); None when absent or unreadable."""
    at = raw.find(key)
    while at >= 0:
        match = _COLON.match(raw, at + len(key))
        if match is not None:
            break
        at = raw.find(key, at + 1)
    else:
        return None
    for end in (match.end() + _WINDOW, len(raw)):
        try:
            return _DECODER.raw_decode(raw[match.end():end].decode("utf-8", "replace"))[0]
        except ValueError:
            if end >= len(raw):
                return None
    return None


def read_line_report(info) -> tuple[dict, list]:
    """``(wan_line, mains_out)`` of a prefill's /server_info, given as raw bytes (only those two
    values are parsed) or as an already parsed dict, or of its parsed /pdd/line."""
    if isinstance(info, (bytes, bytearray, str)):
        raw = info.encode() if isinstance(info, str) else bytes(info)
        wan_line, mains_out = _value_after(raw, _WAN_LINE_KEY), _value_after(raw, _MAINS_OUT_KEY)
    elif "wan_line" in info:  # /pdd/line
        wan_line, mains_out = info["wan_line"], info.get("mains_out")
    else:
        states = info.get("internal_states") or [{}]
        pdd = states[0].get("pdd") or {}
        wan_line, mains_out = pdd.get("wan_line"), (pdd.get("fanout") or {}).get("mains_out")
    return (wan_line if isinstance(wan_line, dict) else {},
            list(mains_out) if isinstance(mains_out, (list, tuple)) else [])


async def poll_prefill_lines(lines: LineAccounting, prefills, mains, get_json,
                             interval_s: float = 1.0) -> None:
    """Forever: each healthy prefill's WAN line, summed per main, into ``lines.report``.
    ``get_json(upstream, path)`` is the router's HTTP client, returning the raw body or a parsed
    dict. Each prefill's ``/pdd/line`` is read; one that answers 404 has its ``/server_info``
    read from then on (compactly, :func:`read_line_report`). A prefill without the fields (an
    older build) or a failed poll just leaves the router's own accounting in charge. Several
    prefills' first-token bytes add up (:func:`first_token_bytes`); the line's rate is the lowest
    any of them measured."""
    without_report: set[str] = set()  # prefills that answered /pdd/line with 404
    while True:
        # The router's own copies the reports may show: those open when the poll is sent, and
        # those begun before the answers are in (a prefill may have seen them before it
        # answered; subtracting them all counts no copy twice, at worst misses another
        # router's bytes of the same size until the next poll).
        at_poll = {main.url: (lines.bytes_ahead(main.url), lines.begun_bytes(main.url))
                   for main in mains}
        totals: dict[str, list] = {}
        out: set[str] = set()
        for prefill in [p for p in prefills if p.healthy]:
            try:
                info = await _line_report(prefill, get_json, without_report)
            except Exception:  # noqa: BLE001 - a missed poll ages out (REPORT_FRESH_S)
                continue
            wan_line, mains_out = read_line_report(info)
            out.update(m for m in mains_out if isinstance(m, str))
            for main in mains:
                entry = wan_line.get(main.mooncake_session) if main.mooncake_session else None
                if entry is not None:
                    total = totals.setdefault(main.url, [0, [], []])
                    total[0] += first_token_bytes(entry)
                    if entry.get("recent_bytes_per_s"):
                        total[1].append(entry["recent_bytes_per_s"])
                    total[2].append(float(entry.get("kv_codec_ratio") or 1.0))
        for url, (ahead, rates, ratios) in totals.items():
            open_at_poll, begun_at_poll = at_poll[url]
            own = open_at_poll + lines.begun_bytes(url) - begun_at_poll
            # the copy is predicted in wire bytes: at the lowest ratio any prefill reports
            lines.report(url, ahead, min(rates) if rates else None, own,
                         wire_ratio=min(ratios))
        mark_mains_out(mains, out)
        await asyncio.sleep(interval_s)


def first_token_bytes(entry: dict) -> int:
    """The bytes of one prefill's line to a main that a new request's copy waits behind: its
    first-token bytes (and every byte in flight); from an older prefill its needed-now bytes,
    or the whole line from one that reports no classes."""
    for key in ("first_token_bytes_ahead", "needed_now_bytes_ahead", "bytes_ahead"):
        if entry.get(key) is not None:
            return int(entry[key])
    return 0


async def _line_report(prefill, get_json, without_report: set):
    if prefill.url not in without_report:
        try:
            body = await get_json(prefill, LINE_REPORT_PATH)
            return json.loads(body) if isinstance(body, (bytes, bytearray, str)) else body
        except Exception as err:  # noqa: BLE001 - only a 404 changes the path
            if getattr(err, "status", None) != 404:
                raise
            without_report.add(prefill.url)
            logger.info("PDD router: prefill %s has no %s; reading its /server_info",
                        prefill.url, LINE_REPORT_PATH)
    return await get_json(prefill, "/server_info")


def mark_mains_out(mains, sessions_out) -> None:
    """Take a main out of placement while a prefill lists its Mooncake session as out after a
    failed WAN copy, and back in once none does (their probes over the WAN engine reached it)."""
    for main in mains:
        was = main.wan_out
        main.wan_out = bool(main.mooncake_session) and main.mooncake_session in sessions_out
        if main.wan_out != was:
            logger.warning("PDD router: main %s %s", main.url, "is out: a prefill's WAN copy to it "
                           "failed" if main.wan_out else "is back: a prefill's WAN probe reached it")
