"""How each of a prefill's copies to main crossed the WAN: ``packed``, ``coded`` or ``one_sided``.

Packed and coded copies are records in main's staging range (raw, or encoded by the WAN codec);
a one-sided copy goes straight into main's pages. The tests and benches read a copy's mode only
through :func:`copies_by_mode`, so where the prefill exposes it is one function's concern.
"""

from __future__ import annotations

MODES = ("packed", "coded", "one_sided")


def copies_by_mode(prefill) -> dict[str, int]:
    """The main-bound copies ``prefill`` (a TP 1 server) has sent, by mode, from its
    ``/server_info``: the WAN codec's counters count each copy main offered a staging range
    (``coded_copies``, ``packed_raw_copies``, and ``raw_copies`` for one sent one-sided anyway);
    a copy main offered no range counts in none of them and goes one-sided, so one-sided copies
    are the rooms the transfer ledger sent main pages for, less the packed and coded ones."""
    pdd = prefill.pdd_state()
    codec = pdd.get("wan_codec") or {}
    rooms = {row["room"] for row in pdd["transfers"]["by_request"]
             if row["role"] == "main" and row["pages"] > 0}
    packed, coded = codec.get("packed_raw_copies", 0), codec.get("coded_copies", 0)
    return {"packed": packed, "coded": coded, "one_sided": len(rooms) - packed - coded}


def copy_mode(before: dict[str, int], after: dict[str, int]) -> str:
    """The mode of the one copy sent between two :func:`copies_by_mode` readings."""
    grown = {mode: after[mode] - before[mode] for mode in MODES if after[mode] != before[mode]}
    if list(grown.values()) != [1]:
        raise ValueError(f"not one copy between the readings: {before} -> {after}")
    return next(iter(grown))
