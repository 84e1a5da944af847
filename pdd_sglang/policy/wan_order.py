"""Which copy a WAN line serves next, and how long a copy no request waits on holds it up: the
rules prefill's sender (``prefill/wan_lines.py``, ``wan_engine.py``) and the simulator's line
(``sim/wan_lines.py``) both follow.

**Earliest deadline first**, a copy's deadline being when it was first queued plus
:data:`DEADLINE_STRETCH` times its bytes at the line's rate (its time alone on the line,
stretched); fixed when it is queued, whatever it has sent since. So a copy queued later, at
``t_b`` with ``b`` bytes, goes before one queued at ``t_a`` with ``a`` bytes only if
``t_b - t_a < DEADLINE_STRETCH x (a - b) / rate``:

- a short copy passes a long one queued well before it (a P->MD request's 46-token copy and a
  document's 9.9 MB copy for a handoff, 8 s of the demo's 10 Mbit/s line: passed while it
  arrives within 16 s of the document);
- a copy about as large as one queued before it passes it only if it arrives within twice their
  difference (a relay death's 764-page probe at 20 Mbit/s against 700-page copies, one every
  2.3 s: 0.4 s), so every copy's wait has an end: nothing queued after its deadline passes it.

What came before, and why it went: least-left first alone (an unbounded stretch) let the
relay-death probe wait 30 s while nine copies queued after it went first, until main gave up on
it (``scripts/fault_suite.py --quick``, 20 Mbit/s); then least-left with at most two passes per
copy (a bound by count) made a 46-token P->MD copy wait 5.05 s, x9 its time alone, behind a
document two smaller copies had already passed (the demo's idle-line setup, fresh clone of
4d20877, docs/measurements.md). A deadline bounds a copy's wait by time, whatever the count. And it is the copy's whole size,
not what it has left: a deadline from the bytes left moved a copy's deadline closer as it sent,
so a document's copy 5 s into its 6 s kept the line from a 46-token P->MD copy, which waited
4.38 s, x7 alone (fresh clone of 74d4114).

**Tiers before deadlines.** A line serves a copy a request with no token yet waits for (P->MD,
a relay that failed or died) before a relay-covered one (a handoff's: the relay answers the
request meanwhile, so its copy only moves the handoff), and that before a cache-only one
(:func:`copy_tier`); deadlines order each tier. Within needed-now the deadline alone used to
decide, and a handoff's copy queued 0.5-1.4 s before a P->MD request's was due first: in two
fresh-clone demos the idle-line P->MD copies over 1.5x alone waited behind such copies in 3 of
8 cases (8da2cbf, c88dcdc), the more so once a relay-covered copy kept the small window below.
A relay-covered copy can wait behind first-token copies for long; its relay answers meanwhile,
and finishes the request alone if it must.

**A background copy yields sooner.** A needed-now copy that takes the line from the copy on it
shares the line with what that copy has in flight: the sender yields between slices, hands the
line over at once and lands its window beside the new copy, so the new copy never waits for
that window to land and be acknowledged. A copy no request waits on for a token, a *background*
copy, keeps at most :data:`BACKGROUND_IN_FLIGHT_S` of the declared line in flight, its slice
included: a cache-only copy (the relay answered alone), and a relay-covered one (a handoff's: a
relay answers the request while its copy flies, until that relay fails). Every other copy keeps
the window that fills the line. So the copy of a request with no token yet (P->MD; a relay that
failed) shares the line with that much at most of a background copy. What that costs, measured at the demo's
10 Mbit/s x 40 ms (docs/measurements.md, the window probe): one packed copy fills 0.87 of the
line with the product's 862 KB window (0.69 s of line), 0.71 with 150 KB (0.12 s); a handoff's
copy lands that much later, and its relay decodes that much longer. What it saves: the
idle-line P->MD copies over 1.5x their time alone waited behind background copies, each about a
copy alone plus the 0.69 s window of the one it took the line from: a cache-only document's
(fresh clones of a08b43a, 378f4bc); then, with only cache-only copies bounded, a handoff's or a
document's whose relay was still decoding (two runs of 8da2cbf: 5 of the 6 over 1.5x; the
sixth waited for a whole handoff's copy due before it). At the brief's 10 Gbit/s x 20 ms the
bound is 5 round trips, against 16.

Pure: no clock, no I/O. The callers give the times (``time.monotonic`` in prefill, the
simulator's clock) and the rate (the declared line in prefill, the line's profile in the
simulator).
"""

from __future__ import annotations

# Declared, not fitted: how far a copy's time alone is stretched into its deadline. 0 is first
# come, first served; the larger, the closer to least-left first (and the longer a large copy
# may wait behind later, smaller ones).
DEADLINE_STRETCH = 2.0

# Declared, not fitted: seconds of the declared line a background copy keeps in flight at most
# (its slice included). The idle-line goal leaves a 26-token P->MD copy (0.44 s alone on the
# demo's line, 0.23 s of it fixed) 0.22 s behind another copy: this bound, a round trip for the
# last acknowledgement and the sender's hand-over fit in it.
BACKGROUND_IN_FLIGHT_S = 0.1


# Declared, not fitted: seconds of the line (bytes ahead over its measured rate) past which a
# line's queued cache-only copies are dropped (--pdd-wan-cache-only-backlog-s). At least the
# router's landing wait (router.landing, 20 s): a turn's cache-only copy is what makes the next
# turn of its conversation cheap, and the router waits that long for it to land, so a copy that
# would land within it is worth its bytes. A dropped copy is not saved: the next turn's copy
# carries its prefix again, larger, and is likelier to be dropped in its turn. At 10 s the
# demo's PDD setups queued 46-89 MB of main-bound copies where a run of the same 24 requests
# that dropped nothing queued 33.5 MB, and its relays finished alone more (the demo's line
# samples, dev/testing/line_backlog.py).
CACHE_ONLY_BACKLOG_S = 30.0


# The tiers a line serves in order, before deadlines: a copy a request with no token yet waits
# for (P->MD, a relay that failed or died), a relay-covered one (a handoff's: the relay answers
# the request meanwhile, so its copy only moves the handoff), a cache-only one.
FIRST_TOKEN, RELAY_COVERED, CACHE_ONLY = 0, 1, 2


def copy_tier(cache_only: bool, relay_covered: bool) -> int:
    """A copy's tier (see above): the line serves the lowest first, then by deadline."""
    return CACHE_ONLY if cache_only else RELAY_COVERED if relay_covered else FIRST_TOKEN


def copy_deadline(first_queued_s: float, copy_bytes: float, line_bytes_per_s: float) -> float:
    """When a copy of ``copy_bytes`` first queued at ``first_queued_s`` is due."""
    if not line_bytes_per_s > 0:
        raise ValueError(f"the line's rate must be positive, got {line_bytes_per_s!r} bytes/s")
    return first_queued_s + DEADLINE_STRETCH * max(copy_bytes, 0.0) / line_bytes_per_s


def background_in_flight_bytes(line_bytes_per_s: float,
                               in_flight_s: float = BACKGROUND_IN_FLIGHT_S) -> float:
    """The most bytes a background copy keeps in flight on a line of ``line_bytes_per_s``
    (``in_flight_s`` other than the policy's: the simulator's sweeps)."""
    if not line_bytes_per_s > 0:
        raise ValueError(f"the line's rate must be positive, got {line_bytes_per_s!r} bytes/s")
    if not in_flight_s > 0:
        raise ValueError(
            f"a background copy's time in flight must be positive, got {in_flight_s!r}")
    return in_flight_s * line_bytes_per_s
