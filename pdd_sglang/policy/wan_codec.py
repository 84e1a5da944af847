"""Whether coding a WAN copy shortens it (issue 36): the rule the codec's ``auto`` setting is to
follow per copy (``--pdd-wan-kv-codec auto``, :mod:`pdd_sglang.prefill.wan_coded`), and the
simulator's. Pure and
deterministic, as the rest of :mod:`pdd_sglang.policy`.

A codec is known by its cost (:class:`CodecCost`): its ratio, and how fast one core encodes at the
prefill and decodes at main, as ``scripts/bench_wan_codec.py`` measures them or a profile declares
them. A copy is coded per window of its slices, so encoding, the line and decoding overlap across
windows: the slowest of the three sets the pace, and the first window's encoding and the last
one's decoding are paid on top (:func:`coded_copy_seconds`). Auto picks the shortest copy among
raw and the lossless codecs; a lossy codec is only ever chosen by name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class CodecCost:
    """name: the codec (kv_codec.CODECS); ratio: raw bytes per wire byte; encode_bytes_per_s and
    decode_bytes_per_s: raw bytes per second at the prefill and at main (inf: free); lossless:
    may auto choose it."""

    name: str
    ratio: float
    encode_bytes_per_s: float
    decode_bytes_per_s: float
    lossless: bool = True

    def __post_init__(self) -> None:
        for key in ("ratio", "encode_bytes_per_s", "decode_bytes_per_s"):
            value = getattr(self, key)
            if not value > 0 or (isinstance(value, float) and math.isnan(value)):
                raise ValueError(f"codec {self.name!r}: {key} must be > 0, got {value!r}")


RAW = CodecCost("raw", 1.0, math.inf, math.inf)
# The lossless codec as measured (scripts/bench_wan_codec.py, docs/results/wan_codec_bench.json:
# the tiny model's float32 KV, one core): auto's prior at a prefill, which then folds in what it
# measures on the copies it codes.
LOSSLESS_MEASURED = CodecCost("lossless", 1.22, 411e6, 396e6)


def coded_copy_seconds(raw_bytes: float, line_bytes_per_s: float, cost: CodecCost,
                       window_bytes: float = 0.0) -> float:
    """The copy's transfer time on an idle line at ``line_bytes_per_s`` (no RTT), coded per
    window of ``window_bytes`` raw bytes (0: the pipeline's fill is not counted)."""
    if not line_bytes_per_s > 0:
        raise ValueError(f"line_bytes_per_s must be > 0, got {line_bytes_per_s!r}")
    if raw_bytes < 0 or window_bytes < 0:
        raise ValueError("raw_bytes and window_bytes must be >= 0")
    wire_s = raw_bytes / cost.ratio / line_bytes_per_s
    encode_s = raw_bytes / cost.encode_bytes_per_s
    decode_s = raw_bytes / cost.decode_bytes_per_s
    window = min(window_bytes, raw_bytes)
    fill_s = window / cost.encode_bytes_per_s + window / cost.decode_bytes_per_s
    return max(wire_s, encode_s, decode_s) + fill_s


def choose_wan_codec(raw_bytes: float, line_bytes_per_s: float, candidates: Sequence[CodecCost],
                     window_bytes: float = 0.0) -> CodecCost:
    """Auto's choice: the lossless candidate (raw always among them) with the shortest copy;
    raw on a tie, since it costs no CPU."""
    best = RAW
    best_s = coded_copy_seconds(raw_bytes, line_bytes_per_s, RAW, window_bytes)
    for cost in candidates:
        if not cost.lossless:
            continue
        seconds = coded_copy_seconds(raw_bytes, line_bytes_per_s, cost, window_bytes)
        if seconds < best_s:
            best, best_s = cost, seconds
    return best


def stage_raw(slice_bytes: int, kv_buffers: int, block_bytes: int) -> bool:
    """Whether an uncoded copy on RDMA goes packed, as records in main's staging ring, rather
    than one-sided into main's pages (on TCP it always does). One-sided, a slice is one Mooncake request per KV buffer (a
    layer's K or V), so a model of many layers splits it into requests too small to keep the
    line full (``block_bytes``: the smallest that does, :data:`~pdd_sglang.prefill.wan_engine.
    BLOCK_BDPS` of the line's bandwidth-delay product); packed, a request is a record of
    ``block_bytes``, whatever the model, at the cost of a gather at the prefill and a scatter at
    main."""
    if slice_bytes <= 0 or block_bytes <= 0:
        raise ValueError(f"slice and block bytes must be > 0, got {slice_bytes}, {block_bytes}")
    return slice_bytes / max(kv_buffers, 1) < block_bytes


# Main's staging (issue 50): one ring per prefill rank that writes to a main rank, of slots that
# each hold one record. A slot holds a record of the prefill's size (half a bandwidth-delay
# product, at least 1 MiB, at most 32 MiB: prefill/wan_engine.py's block and wan_coded.py's
# record) plus its page ids and headers. A ring holds a copy's window (sixteen BDPs) plus the
# round trips a slot takes to come back (the record's arrival word, main's landing, prefill's
# read of the freed words: about three), with room to spare.
SLOT_BDPS = 0.5
MIN_SLOT_BYTES = 1 << 20
MAX_SLOT_BYTES = 32 << 20
RING_BDPS = 24.0
MIN_RING_SLOTS = 8
RINGS_PER_MAIN = 2  # prefill ranks writing to one main rank at once; more go one-sided
SLOT_ALIGN = 64


def _aligned(n: int) -> int:
    return -(-int(n) // SLOT_ALIGN) * SLOT_ALIGN


def staging_ring(bandwidth_gbps: float, rtt_ms: float, staging_mb: float = 0.0
                 ) -> tuple[int, int]:
    """``(slot_bytes, ring_bytes)`` of a main's staging rings for the declared line; with
    ``--pdd-wan-staging-mb`` > 0, the region is that and each of its RINGS_PER_MAIN rings an
    equal share (slots as the line gives, fewer when the share is small)."""
    if bandwidth_gbps <= 0 or rtt_ms <= 0 or staging_mb < 0:
        raise ValueError(f"a staging ring needs a positive line and staging >= 0 (got "
                         f"{bandwidth_gbps} Gbit/s, {rtt_ms} ms, {staging_mb} MiB)")
    bdp = bandwidth_gbps * 1e9 / 8 * rtt_ms / 1e3
    raw = int(min(max(SLOT_BDPS * bdp, MIN_SLOT_BYTES), MAX_SLOT_BYTES))
    slot = _aligned(raw + raw // 64 + 4096)  # page ids and headers; a slot's KV stays aligned
    if staging_mb > 0:
        ring = int(staging_mb * (1 << 20)) // RINGS_PER_MAIN
        slot = min(slot, max(ring // MIN_RING_SLOTS // SLOT_ALIGN * SLOT_ALIGN, SLOT_ALIGN))
        return slot, ring
    return slot, max(int(RING_BDPS * bdp), MIN_RING_SLOTS * slot)
