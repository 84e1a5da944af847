"""Packed copies to main (issues 36, 50): a window's pages as records in main's staging ring.

Life cycle of a main-bound copy:

1. Main's hello names its staging ring for this prefill rank (``DestinationHello.staging_addr``
   / ``staging_bytes`` / ``staging_slot_bytes``: :class:`~pdd_sglang.kv_codec.wire.RingLayout`);
   the owner keeps it as the destination's :class:`StagedCopy`, shared by every
   :class:`~pdd_sglang.prefill.room.Work` of that destination, and records how many there are
   once the room's last chunk is routed (:attr:`StagedCopy.total`). A main that named no ring
   (another TP size, no staging) gets a StagedCopy without one.
2. The first work of the destination that a sender takes decides its mode for all of them
   (:func:`codec_for`, counted by mode: ``sglang:pdd_wan_copies_total{mode}``):
   ``--pdd-wan-kv-codec`` (``auto`` asks :func:`pdd_sglang.policy.wan_codec.choose_wan_codec`
   whether coding losslessly shortens the copy on the line as measured, else as declared) gives
   coded or packed (raw records) whatever the copy's size; one-sided into main's pages only where
   records cannot go (no ring, head slices between TP sizes, a pool dtype no frame carries, a
   page larger than a slot), on RDMA where its requests are large enough
   (:func:`~pdd_sglang.policy.wan_codec.stage_raw`), or as the setting ``one_sided``. One-sided
   on TCP is logged once.
3. :func:`send_coded` takes a slot of main's ring (:mod:`pdd_sglang.prefill.wan_ring`: only
   slots main has freed), gathers the record's pages from prefill's pool straight into a place of
   the prefill's send pool (:mod:`pdd_sglang.prefill.send_pool`; raw: one torch copy per pool
   buffer, no bytes object; coded: the encoded frame copied once), and writes it into the slot
   inside the windowed copy, so cancelling and yielding still act within one window. Once a
   record's write has ended, its arrival word tells main it may land it.
4. The destination's last work writes the end record (how many records, their raw bytes), also
   when the copy went one-sided (then 0), and returns only once its arrival word has landed; main
   lands every record as it arrives (:mod:`pdd_sglang.decode.wan_staging`).

Threads: a :class:`StagedCopy` is written by the WAN sender holding its line (a line is one main
session, served by one sender at a time, so a destination's works never run at once), its
``total`` once by the owner; the send pool and the ring writers are shared by the senders under
their own locks. :class:`CodecChoice` is shared by the senders, its running figures under its
lock.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import zlib
from typing import Any, Optional

import numpy as np
import torch

from pdd_sglang.kv_codec import CODECS, HEADER as FRAME_HEADER, RawCodec, frame_header
from pdd_sglang.kv_codec.pool import CODABLE_DTYPES, PoolPages
from pdd_sglang.kv_codec.wire import (RingLayout, pack_end, pack_record, pages_per_slot,
                                      record_frame_offset)
from pdd_sglang.policy.wan_codec import LOSSLESS_MEASURED, CodecCost, choose_wan_codec, stage_raw
from pdd_sglang.prefill.ledger import LEDGER
from pdd_sglang.prefill.send_pool import SendPool, send_pool
from pdd_sglang.prefill.wan_ring import RingWriter, ring_writer
from pdd_sglang.prefill.wan_lines import CopyClass

logger = logging.getLogger(__name__)

# A record holds the raw bytes of one Mooncake request the line needs (the engine's
# ``block_bytes``, half a bandwidth-delay product), at least MIN_RECORD_BYTES so a slow line's
# records stay few, and never more than a slice (a cancel or a yield acts between slices). Tried
# and not kept: records of two BDPs. In 2 runs of one 20-BDP copy they moved 0.85-0.89 of a
# 400 x 100 and a 200 x 200 line against 0.76-0.83, but a fresh-clone bench of all five points
# (docs/results/wan_line_bench_records_2bdp_fresh_clone_ad93d7c_2026-12-05.json) gave one copy
# -0.07 to +0.08 beside the run before and four copies at once 0.66-0.67 where they had moved
# 0.87-0.89 (docs/measurements.md).
MIN_RECORD_BYTES = 1 << 20
# staged.codec of a destination whose copies go one-sided into main's pages, not as records.
UNSTAGED = "unstaged"
ONE_SIDED = "one_sided"  # --pdd-wan-kv-codec's setting for it
_RAW = RawCodec()
# CodecChoice.counters per copy, by the mode /metrics counts it under.
MODES = {"coded_copies": "coded", "packed_raw_copies": "packed", "one_sided_copies": "one_sided"}


@dataclasses.dataclass(eq=False)
class StagedCopy:
    """One main destination of a room: the staging ring its hello named (None: none), and what
    this prefill has written there for the room."""

    ring: Optional[RingLayout] = None
    records: int = 0
    wire_bytes: int = 0
    raw_bytes: int = 0
    codec: Optional[str] = None  # decided by the first work a sender takes
    done: int = 0  # works of this destination finished
    total: Optional[int] = None  # works of this destination in all, once its last is routed
    end_written: bool = False

    def last_work(self) -> bool:
        return self.total is not None and self.done + 1 == self.total


class CodecChoice:
    """``--pdd-wan-kv-codec`` per copy, with the lossless codec's running figures."""

    def __init__(self, mode: str, declared_line_bytes_per_s: float,
                 lossless: CodecCost = LOSSLESS_MEASURED):
        self.mode = mode
        self.declared_line_bytes_per_s = float(declared_line_bytes_per_s)
        self._lock = threading.Lock()
        self._lossless = lossless
        self.counters = {"coded_copies": 0, "one_sided_copies": 0, "packed_raw_copies": 0,
                         "coded_raw_bytes": 0, "coded_wire_bytes": 0}

    def pick(self, raw_bytes: int, line_bytes_per_s: Optional[float], window_bytes: int) -> str:
        if self.mode != "auto":
            return self.mode
        with self._lock:
            cost = self._lossless
        line = line_bytes_per_s or self.declared_line_bytes_per_s
        return choose_wan_codec(raw_bytes, line, [cost], window_bytes).name

    def observe(self, codec: str, raw_bytes: int, wire_bytes: int, encode_s: float) -> None:
        """A slice coded: fold its ratio and encode rate into the lossless codec's figures."""
        with self._lock:
            self.counters["coded_raw_bytes"] += raw_bytes
            self.counters["coded_wire_bytes"] += wire_bytes
            if codec != "lossless" or raw_bytes < (1 << 16) or encode_s <= 0:
                return
            old, weight = self._lossless, 0.2
            self._lossless = dataclasses.replace(
                old, ratio=(1 - weight) * old.ratio + weight * raw_bytes / max(wire_bytes, 1),
                encode_bytes_per_s=(1 - weight) * old.encode_bytes_per_s
                + weight * raw_bytes / encode_s)

    def count(self, key: str) -> None:
        with self._lock:
            self.counters[key] += 1

    def state(self) -> dict:
        with self._lock:
            cost = self._lossless
            return {"mode": self.mode, "lossless_ratio": round(cost.ratio, 4),
                    "lossless_encode_mb_s": round(cost.encode_bytes_per_s / 1e6, 1),
                    "copies_by_mode": {mode: self.counters[key] for key, mode in MODES.items()},
                    **self.counters}


def record_bytes(window: Any) -> int:
    """The raw bytes a record of a copy holds at most (even: whole elements), for ``window``
    (a :class:`~pdd_sglang.prefill.wan_engine.CopyWindow`, or the engine: its own window)."""
    return max(min(window.slice_bytes, max(window.block_bytes, MIN_RECORD_BYTES)) & ~1, 2)


def _pool(wan: Any) -> SendPool:
    return send_pool(wan, record_bytes(wan))


def pool_pages(kv_mgr: Any) -> Optional[PoolPages]:
    """Prefill's pool as coded copies read it, made once; None when a frame cannot carry it."""
    pool = getattr(kv_mgr, "pdd_coded_pool", False)
    if pool is not False:
        return pool
    pool = None
    try:
        args = kv_mgr.kv_args
        dtype = _pool_dtype(str(getattr(args, "kv_cache_dtype_str", "auto") or "auto"))
        if dtype is not None:
            size = torch.empty((), dtype=dtype).element_size()
            row = args.kv_item_lens[0] // (args.page_size * max(int(args.kv_head_num), 1) * size)
            pool = PoolPages(args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens, dtype,
                             max(row, 1), _device())
    except Exception as err:
        logger.warning("PDD: main-bound copies go raw: this pool cannot be coded (%s)", err)
    kv_mgr.pdd_coded_pool = pool
    return pool


def _device() -> str:
    from sglang.srt.runtime_context import get_server_args

    return str(getattr(get_server_args(), "device", "cpu") or "cpu")


def _pool_dtype(name: str) -> Optional[torch.dtype]:
    if name in CODABLE_DTYPES:
        return CODABLE_DTYPES[name]
    if name != "auto":
        return None  # an fp8 pool: nothing left to gain
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.runtime_context import get_server_args

    return ModelConfig.from_server_args(get_server_args()).dtype


_ONE_SIDED_LOGGED = threading.Event()


def codec_for(kv_mgr: Any, work: Any, sliced: bool, raw_bytes: int) -> Optional[str]:
    """The codec of this work's copy as records in main's staging ring ("raw" too: packed,
    uncoded), None when it goes one-sided into main's pages; the first work of a destination
    decides, and counts it by mode."""
    staged = getattr(work, "staged", None)
    fanout = kv_mgr.pdd_fanout
    choice = getattr(fanout, "codec_choice", None)
    if staged is None or choice is None:
        return None
    if staged.codec is None:
        codec, why = _decide(kv_mgr, work, sliced, raw_bytes)
        staged.codec = codec
        choice.count({UNSTAGED: "one_sided_copies", "raw": "packed_raw_copies"}.get(
            codec, "coded_copies"))
        if codec == UNSTAGED and fanout.wan_engine.protocol == "tcp" \
                and not _ONE_SIDED_LOGGED.is_set():
            _ONE_SIDED_LOGGED.set()
            logger.warning("PDD: a WAN copy to main %s goes one-sided on TCP (%s); its Mooncake "
                           "requests are one KV buffer's pages each (logged once; /metrics "
                           "counts them: sglang:pdd_wan_copies_total{mode=\"one_sided\"})",
                           work.session, why)
    return None if staged.codec == UNSTAGED else staged.codec


def _decide(kv_mgr: Any, work: Any, sliced: bool, raw_bytes: int) -> tuple[str, str]:
    """``(codec or UNSTAGED, why one-sided)``."""
    fanout, staged = kv_mgr.pdd_fanout, work.staged
    wan, choice = fanout.wan_engine, fanout.codec_choice
    pool = pool_pages(kv_mgr) if staged.ring is not None and not sliced else None
    if staged.ring is None:
        return UNSTAGED, "main offered no staging ring (another TP size, or none left)"
    if sliced or pool is None:
        return UNSTAGED, "head slices between TP sizes" if sliced else "a pool no frame carries"
    if pages_per_slot(staged.ring.slot_bytes, pool.page_bytes) < 1:
        return UNSTAGED, f"a page of {pool.page_bytes} bytes outgrows main's slots"
    if choice.mode == ONE_SIDED:
        return UNSTAGED, "--pdd-wan-kv-codec one_sided"
    line = fanout.wan_line.snapshot().get(work.session, {}).get("recent_bytes_per_s")
    # coded per record: encoding, the line and decoding overlap record by record
    codec = choice.pick(raw_bytes, line, record_bytes(wan))
    if codec == "raw" and wan.protocol == "rdma" and not stage_raw(
            wan.slice_bytes, len(kv_mgr.kv_args.kv_data_ptrs), wan.block_bytes):
        return UNSTAGED, "RDMA, whose one-sided requests fill the line"
    return codec, ""


def send_coded(kv_mgr: Any, work: Any, src: Any, dst: Any, codec_name: str, lines: Any,
               let_go: Any, yielded: Any) -> Any:
    """The packed twin of ``senders._send_to_main``: True once every record landed and main was
    told, False on a failure, None when cancelled, ``yielded`` when a needed-now copy waits
    behind this one."""
    fanout = kv_mgr.pdd_fanout
    wan, pool, staged = fanout.wan_engine, pool_pages(kv_mgr), work.staged
    codec = CODECS[codec_name]
    out, ring = _pool(wan), ring_writer(wan, work.session, staged.ring)
    per_slot = pages_per_slot(staged.ring.slot_bytes, pool.page_bytes)
    with wan.copy(work.session) as copy:
        start = work.pages_done
        while start < len(src):
            if start:
                if let_go(kv_mgr, work):
                    return None
                if lines is not None and lines.should_yield(work):
                    lines.hand_over(work)  # the other copy starts beside this window
                    return yielded if _finish(copy, ring) else False
            window = copy.window_for_next_slice(
                getattr(work, "copy_class", None) is CopyClass.CACHE_ONLY
                or getattr(work, "relay_covered", False))
            step = max(min(record_bytes(window) // pool.page_bytes, per_slot), 1)
            if not _write_record(kv_mgr, work, copy, (out, ring), codec,
                                 np.asarray(src[start:start + step]),
                                 np.asarray(dst[start:start + step])):
                return False
            start = work.pages_done = min(start + step, len(src))
            if not ring.announce(copy):
                return False
        if staged.last_work() and not _write_end(work, wan, copy, out, ring):
            return False
        return _finish(copy, ring)


def _finish(copy: Any, ring: RingWriter) -> bool:
    """Every record landed, then every arrival word: main may land all of them."""
    return copy.finish() and ring.announce(copy) and copy.finish()


def _write_record(kv_mgr: Any, work: Any, copy: Any, to: tuple, codec: Any, pages: Any,
                  dst: Any) -> bool:
    fanout, staged, (out, ring) = kv_mgr.pdd_fanout, work.staged, to
    wan, pool = fanout.wan_engine, pool_pages(kv_mgr)
    slot_seq = ring.take(wan, copy)
    if slot_seq is None:
        return False
    slot, seq = slot_seq
    began = time.perf_counter()
    raw_bytes = len(pages) * pool.page_bytes
    placed = (_gather_raw if codec.name == "raw" else _encode)(pool, out, copy, codec, pages)
    if placed is None:
        ring.releaser(slot, seq)(False)
        return False
    place, frame_len = placed
    prefix = pack_record(work.room, seq, dst, frame_len)
    out.array[place:place + len(prefix)] = np.frombuffer(prefix, np.uint8)
    nbytes = len(prefix) + frame_len
    fanout.codec_choice.observe(codec.name, raw_bytes, nbytes, time.perf_counter() - began)
    if not copy.submit([out.addr + place], [staged.ring.slot_addr(slot)], [nbytes],
                       release=out.releaser(place, ring.releaser(slot, seq))):
        return False
    LEDGER.record_batch(work.session, [raw_bytes], wire_bytes=nbytes)
    fanout.wan_line.coded(work.session, raw_bytes, nbytes)
    if getattr(work, "copy_class", None) is not None:  # the line report's bytes by class
        fanout.wan_line.handed(work.session, work.copy_class.value, nbytes)
    staged.records += 1
    staged.wire_bytes += nbytes
    staged.raw_bytes += raw_bytes
    return True


def _gather_raw(pool: PoolPages, out: SendPool, copy: Any, codec: Any, pages: Any
                ) -> Optional[tuple[int, int]]:
    """The pages gathered straight into a send pool place, behind room for the record's header
    and the raw frame's: ``(place, frame bytes)``."""
    payload_at = record_frame_offset(len(pages)) + FRAME_HEADER.size
    payload = len(pages) * pool.page_bytes
    place = out.take(payload_at + payload, copy)
    if place is None:
        return None
    begin = place + payload_at
    target = out.buffer[begin:begin + payload].view(len(pool.views), len(pages), pool.item_len)
    kv = pool.gather(pages, out=target)
    header = frame_header(_RAW.codec_id, kv, zlib.crc32(out.array[begin:begin + payload]))
    at = place + record_frame_offset(len(pages))
    out.array[at:at + len(header)] = np.frombuffer(header, np.uint8)
    return place, len(header) + payload


def _encode(pool: PoolPages, out: SendPool, copy: Any, codec: Any, pages: Any
            ) -> Optional[tuple[int, int]]:
    """The pages encoded into one frame (the raw codec's where coding would grow it), copied
    once into a send pool place behind room for the record's header."""
    kv = pool.gather(pages)
    frame = codec.encode(kv)
    if len(frame) > kv.numel() * kv.element_size() + FRAME_HEADER.size:
        frame = _RAW.encode(kv)
    at = record_frame_offset(len(pages))
    place = out.take(at + len(frame), copy)
    if place is None:
        return None
    out.array[place + at:place + at + len(frame)] = np.frombuffer(frame, np.uint8)
    return place, len(frame)


def _write_end(work: Any, wan: Any, copy: Any, out: SendPool, ring: RingWriter) -> bool:
    staged = work.staged
    slot_seq = ring.take(wan, copy)
    if slot_seq is None:
        return False
    slot, seq = slot_seq
    end = pack_end(work.room, seq, staged.records, staged.raw_bytes)
    if not out.write(copy, end, staged.ring.slot_addr(slot), ring.releaser(slot, seq)):
        return False
    staged.end_written = True
    return True


def finish_staged(kv_mgr: Any, work: Any) -> bool:
    """A work of a destination with a staging ring sent its KV: count it; the destination's last
    writes the end record if it has not yet (a last work with no page of its own, or a copy
    that went one-sided: main waits for it all the same). False when that write failed."""
    staged = getattr(work, "staged", None)
    if staged is None or staged.ring is None:
        return True
    last = staged.last_work()
    staged.done += 1
    if not last or staged.end_written:
        return True
    wan = kv_mgr.pdd_fanout.wan_engine
    ring = ring_writer(wan, work.session, staged.ring)
    with wan.copy(work.session) as copy:
        return _write_end(work, wan, copy, _pool(wan), ring) and _finish(copy, ring)
