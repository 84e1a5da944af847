"""Coded copies to main (issue 36): a window's pages encoded into records in main's staging range.

Life cycle of a main-bound copy that is coded:

1. Main's hello offers a staging range for the room (``DestinationHello.staging_addr`` /
   ``staging_bytes``); the owner keeps it as the destination's :class:`StagedCopy`, shared by
   every :class:`~pdd_sglang.prefill.room.Work` of that destination, and records how many there
   are once the room's last chunk is routed (:attr:`StagedCopy.total`).
2. The first work of the destination that a sender takes decides the codec for all of them
   (:meth:`CodecChoice.pick`: ``--pdd-wan-kv-codec``; ``auto`` asks
   :func:`pdd_sglang.policy.wan_codec.choose_wan_codec` whether coding losslessly shortens the
   copy on the line as measured, else as declared); raw, and every copy that cannot be coded
   (no staging range, head slices between TP sizes, a pool dtype no frame carries), goes as
   before, one-sided into main's pages.
3. Coded: :func:`send_coded` reads each slice's pages from prefill's pool, encodes them into one
   frame (the raw codec's where coding would grow it), wraps it in a record (the room, the
   destination pages, a CRC) in a place of the prefill's send pool
   (:mod:`pdd_sglang.prefill.send_pool`), and writes it to the next free place in main's range
   inside the windowed copy, so cancelling and yielding still act within one window. A pool
   place is reused only once Mooncake has ended the block written from it.
4. The destination's last work to finish writes the end record (how many records, their bytes)
   to the range's start; main decodes every record into its pages when it sees the room landed
   (:mod:`pdd_sglang.decode.wan_staging`).

Threads: a :class:`StagedCopy` is written by the WAN sender holding its line (a line is one main
session, served by one sender at a time, so a destination's works never run at once), its
``total`` once by the owner; the send pool is shared by the senders under its own lock.
:class:`CodecChoice` is shared by the senders, its running figures under its lock.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any, Optional

import numpy as np
import torch

from pdd_sglang.kv_codec import CODECS, HEADER as FRAME_HEADER, RawCodec
from pdd_sglang.kv_codec.pool import CODABLE_DTYPES, PoolPages
from pdd_sglang.kv_codec.wire import END_BYTES, pack_end, pack_record
from pdd_sglang.policy.wan_codec import LOSSLESS_MEASURED, CodecCost, choose_wan_codec, stage_raw
from pdd_sglang.prefill.ledger import LEDGER
from pdd_sglang.prefill.send_pool import SendPool, send_pool
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
_RAW = RawCodec()


@dataclasses.dataclass(eq=False)
class StagedCopy:
    """One destination's staging range at main, and what this prefill has written into it."""

    addr: int
    nbytes: int
    offset: int = END_BYTES  # the next record's place
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
        self.counters = {"coded_copies": 0, "raw_copies": 0, "packed_raw_copies": 0,
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


def codec_for(kv_mgr: Any, work: Any, sliced: bool, raw_bytes: int) -> Optional[str]:
    """The codec of this work's copy as records in main's staging range ("raw" too: packed,
    uncoded), None when it goes one-sided into main's pages; the first work of a destination
    decides."""
    staged = getattr(work, "staged", None)
    fanout = kv_mgr.pdd_fanout
    choice = getattr(fanout, "codec_choice", None)
    if staged is None or choice is None:
        return None
    if staged.codec is None:
        codec, wan = UNSTAGED, fanout.wan_engine
        if not sliced and pool_pages(kv_mgr) is not None:
            line = fanout.wan_line.snapshot().get(work.session, {}).get("recent_bytes_per_s")
            # coded per record: encoding, the line and decoding overlap record by record
            codec = choice.pick(raw_bytes, line, record_bytes(wan))
            if codec == "raw" and not stage_raw(wan.slice_bytes,
                                                len(kv_mgr.kv_args.kv_data_ptrs),
                                                wan.block_bytes):
                codec = UNSTAGED
        staged.codec = codec
        choice.count({UNSTAGED: "raw_copies", "raw": "packed_raw_copies"}.get(codec,
                                                                            "coded_copies"))
    return None if staged.codec == UNSTAGED else staged.codec


def send_coded(kv_mgr: Any, work: Any, src: Any, dst: Any, codec_name: str, lines: Any,
               let_go: Any, yielded: Any) -> Any:
    """The coded twin of ``senders._send_to_main``: True once every record landed, False on a
    failure, None when cancelled, ``yielded`` when a needed-now copy waits behind this one."""
    fanout = kv_mgr.pdd_fanout
    wan, pool, staged = fanout.wan_engine, pool_pages(kv_mgr), work.staged
    codec = CODECS[codec_name]
    pool_out = _pool(wan)
    with wan.copy(work.session) as copy:
        start = work.pages_done
        while start < len(src):
            if start:
                if let_go(kv_mgr, work):
                    return None
                if lines is not None and lines.should_yield(work):
                    lines.hand_over(work)  # the other copy starts beside this window
                    return yielded if copy.finish() else False
            window = copy.window_for_next_slice(
                getattr(work, "copy_class", None) is CopyClass.CACHE_ONLY
                or getattr(work, "relay_covered", False))
            step = max(record_bytes(window) // pool.page_bytes, 1)
            pages = np.asarray(src[start:start + step])
            if not _write_record(kv_mgr, work, copy, pool_out, codec, pages,
                                 np.asarray(dst[start:start + step])):
                return False
            start = work.pages_done = min(start + step, len(src))
        if staged.last_work() and not _write_end(work, copy, pool_out):
            return False
        return copy.finish()


def _write_record(kv_mgr: Any, work: Any, copy: Any, out: SendPool, codec: Any, pages: Any,
                  dst: Any) -> bool:
    fanout, staged = kv_mgr.pdd_fanout, work.staged
    began = time.perf_counter()
    kv = pool_pages(kv_mgr).gather(pages)
    frame = codec.encode(kv)
    raw_bytes = kv.numel() * kv.element_size()
    if len(frame) > raw_bytes + FRAME_HEADER.size:  # coding would grow it: the raw frame
        frame = _RAW.encode(kv)
    record = pack_record(work.room, dst, frame)
    fanout.codec_choice.observe(codec.name, raw_bytes, len(record), time.perf_counter() - began)
    if staged.offset + len(record) > staged.nbytes:
        logger.error("PDD: room %s's coded copy outgrows main %s's staging range (%d bytes)",
                     work.room, work.session, staged.nbytes)
        return False
    if not _submit(copy, out, record, staged.addr + staged.offset):
        return False
    LEDGER.record_batch(work.session, [raw_bytes], wire_bytes=len(record))
    fanout.wan_line.coded(work.session, raw_bytes, len(record))
    if getattr(work, "copy_class", None) is not None:  # the line report's bytes by class
        fanout.wan_line.handed(work.session, work.copy_class.value, len(record))
    staged.offset += len(record)
    staged.records += 1
    staged.wire_bytes += len(record)
    staged.raw_bytes += raw_bytes
    return True


def _submit(copy: Any, out: SendPool, data: bytes, peer_addr: int) -> bool:
    """Write ``data`` to ``peer_addr`` from a place of the send pool, held until Mooncake has
    ended the block."""
    place = out.take(len(data), copy)
    if place is None:
        return False
    out.array[place:place + len(data)] = np.frombuffer(data, np.uint8)
    return copy.submit([out.addr + place], [peer_addr], [len(data)], release=out.releaser(place))


def _write_end(work: Any, copy: Any, out: SendPool) -> bool:
    staged = work.staged
    end = pack_end(work.room, staged.records, staged.wire_bytes, staged.raw_bytes)
    if not _submit(copy, out, end, staged.addr):
        return False
    staged.end_written = True
    return True


def finish_staged(kv_mgr: Any, work: Any) -> bool:
    """A work of a destination with a staging range sent its KV: count it; the destination's last
    writes the end record if its records have none yet (a last work with no page of its own).
    False when that write failed."""
    staged = getattr(work, "staged", None)
    if staged is None:
        return True
    last = staged.last_work()
    staged.done += 1
    if not last or staged.end_written or not staged.records:
        return True
    wan = kv_mgr.pdd_fanout.wan_engine
    with wan.copy(work.session) as copy:
        return _write_end(work, copy, _pool(wan)) and copy.finish()
