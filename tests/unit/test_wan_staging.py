"""The packed WAN path in one process (issues 36, 50): prefill's records written by its WAN engine
into main's staging ring (a scripted Mooncake that copies the bytes), landed into main's pages by
main's landing thread as they arrive; a ring's slots recycled as records land, never written while
main may read them; the prefill's send pool and its abandoned blocks."""

from __future__ import annotations

import ctypes
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pdd_sglang.decode import wan_staging
from pdd_sglang.decode.wan_staging import LANDED, PENDING, MainStaging
from pdd_sglang.kv_codec import CorruptFrame, RawCodec
from pdd_sglang.kv_codec.staging import ALIGN, StagingAllocator
from pdd_sglang.kv_codec.wire import (WORD, RingLayout, pack_end, pack_record, pages_per_slot,
                                      read_slot)
from pdd_sglang.policy.wan_codec import MIN_RING_SLOTS, RINGS_PER_MAIN, stage_raw, staging_ring
from pdd_sglang.prefill import wan_coded
from pdd_sglang.prefill.wan_engine import CopyWindow, WanTransferEngine
from pdd_sglang.prefill.wan_lines import CopyClass
from pdd_sglang.prefill.wan_line import WanLine

LAYERS, PAGE, HEADS, HEAD_DIM, PAGES = 2, 4, 2, 8, 32
PAGE_BYTES = 2 * LAYERS * PAGE * HEADS * HEAD_DIM * 4  # every buffer's page, float32


class Receiver:
    """SGLang's KV receiver, as main's staging knows it."""


# ---- the allocator ---------------------------------------------------------------------------
def test_the_allocator_reserves_first_fit_and_merges_what_is_freed():
    alloc = StagingAllocator(10 * ALIGN)
    a, b, c = (alloc.reserve(n) for n in (ALIGN, 3 * ALIGN + 1, 2 * ALIGN))
    assert (a, b, c) == (0, ALIGN, 5 * ALIGN) and alloc.in_use == 7 * ALIGN
    assert alloc.reserve(4 * ALIGN) is None  # 3 left: the room goes raw
    alloc.free(b)
    assert alloc.reserve(4 * ALIGN) == ALIGN  # the freed hole, first fit
    for offset in (a, ALIGN, c):
        alloc.free(offset)
    assert alloc.in_use == 0 and alloc.ranges == 0 and alloc.largest_free() == 10 * ALIGN
    with pytest.raises(KeyError):
        alloc.free(a)  # twice


def test_the_allocator_leaks_nothing_over_reserves_cancels_and_failures():
    rng = np.random.default_rng(3)
    alloc, held = StagingAllocator(1 << 16), []
    for _ in range(2000):
        if held and rng.random() < 0.5:
            alloc.free(held.pop(rng.integers(len(held))))
        else:
            offset = alloc.reserve(int(rng.integers(1, 4096)))
            if offset is not None:
                held.append(offset)
    for offset in held:
        alloc.free(offset)
    assert alloc.in_use == 0 and alloc.largest_free() == 1 << 16


# ---- the wire format -------------------------------------------------------------------------
def test_records_are_checked_before_a_byte_is_used():
    frame = RawCodec().encode(torch.arange(8, dtype=torch.float32))
    slot = bytearray(256)
    record = pack_record(5, 7, np.array([3, 4]), len(frame)) + frame
    slot[:len(record)] = record
    got = read_slot(memoryview(slot), 7)
    assert (got.room, got.seq, list(got.pages), bytes(got.frame)) == (5, 7, [3, 4], frame)
    with pytest.raises(CorruptFrame, match="damaged"):
        read_slot(memoryview(slot), 8)  # an older record left in the slot
    damaged = bytearray(slot)
    damaged[40] ^= 1  # a page id
    with pytest.raises(CorruptFrame, match="CRC"):
        read_slot(memoryview(damaged), 7)
    with pytest.raises(CorruptFrame, match="no record"):
        read_slot(memoryview(bytearray(64)), 0)
    end = bytearray(pack_end(5, 9, 2, 123).ljust(64, b"\0"))
    assert read_slot(memoryview(end), 9).end == (2, 123)


def test_a_ring_lays_its_words_then_its_slots_within_its_bytes():
    layout = RingLayout.for_slots(1 << 20, 5, 1000)
    assert layout.slots == 5 and layout.slot_addr(0) - layout.addr == 128  # 80 B of words
    assert layout.arrived_addr(0) == layout.addr + 5 * WORD.itemsize
    assert layout.slot_addr(4) + 1000 == layout.addr + layout.nbytes
    assert RingLayout(0, layout.nbytes - 1, 1000).slots == 4
    assert pages_per_slot(1000, 200) == (1000 - 60) // 204 and pages_per_slot(50, 200) == 0


def test_main_sizes_its_rings_from_the_declared_line_or_the_flag():
    slot, ring = staging_ring(10, 20)  # the brief's line: 25 MB BDP
    assert slot == 12_699_456 and ring == 24 * 25_000_000  # 12.5 MB, ids and headers, aligned
    slot, ring = staging_ring(0.01, 40)  # the demo's line: slots of 1 MiB, eight of them at least
    assert slot == (1 << 20) + (1 << 14) + 4096 and ring == MIN_RING_SLOTS * slot
    slot, ring = staging_ring(10, 20, staging_mb=64)
    assert ring == (64 << 20) // RINGS_PER_MAIN and slot == ring // MIN_RING_SLOTS
    assert all(staging_ring(g, 7)[0] % 64 == 0 for g in (0.3, 1.7, 13.1))
    with pytest.raises(ValueError):
        staging_ring(0, 20)


# ---- prefill to main in one process ----------------------------------------------------------
class CopyingMooncake:
    """Mooncake's asynchronous API: each write and read copies its bytes at once (addresses are
    real). ``check`` (optional) sees every write before it lands."""

    def __init__(self, check=None):
        self.writes, self.reads, self.check = [], 0, check

    def transfer_submit_write(self, session, src, dst, length):
        if self.check is not None:
            self.check(dst, length)
        ctypes.memmove(dst, src, length)
        self.writes.append((dst, length))
        return len(self.writes) + self.reads

    def batch_transfer_async_read(self, session, local, remote, lengths):
        ctypes.memmove(local[0], remote[0], lengths[0])
        self.reads += 1
        return len(self.writes) + self.reads

    def transfer_check_status(self, batch):
        return 1

    def batch_register_memory(self, ptrs, lens):
        return 0


def pool(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(PAGES, PAGE * HEADS, HEAD_DIM, generator=gen) for _ in range(2 * LAYERS)]


def kv_args(buffers):
    item = PAGE * HEADS * HEAD_DIM * 4
    return SimpleNamespace(kv_data_ptrs=[b.data_ptr() for b in buffers],
                           kv_data_lens=[b.numel() * 4 for b in buffers],
                           kv_item_lens=[item] * len(buffers), page_size=PAGE, kv_head_num=HEADS,
                           kv_cache_dtype_str="float32")


@pytest.fixture
def mains():
    """Main staging regions made by a test, closed after it (their landing threads stopped)."""
    made = []
    yield made
    for staging in made:
        staging.close()


def main_with_staging(mains, buffers, slots=16, slot_pages=3):
    registered = []
    engine = SimpleNamespace(register=lambda p, n: registered.append((p, n)),
                             deregister=lambda p: registered.remove(next(r for r in registered
                                                                          if r[0] == p)))
    slot_bytes = slot_pages * (PAGE_BYTES + 4) + 60
    ring = RingLayout.for_slots(0, slots, slot_bytes).nbytes
    staging = MainStaging(SimpleNamespace(kv_args=kv_args(buffers), engine=engine),
                          RINGS_PER_MAIN * ring, ring, slot_bytes)
    assert registered == [(staging.addr, RINGS_PER_MAIN * ring)]
    staging.registered = registered
    staging.buffers = buffers  # its pool's memory, by address only: kept alive as SGLang's is
    mains.append(staging)
    return staging


def prefill(buffers, mode="lossless", engine=None):
    wan = WanTransferEngine.over(engine or CopyingMooncake(), timeout_s=5.0, window_bytes=1 << 16,
                                 slice_bytes=3 * PAGE_BYTES)
    wan.protocol = "tcp"
    args = kv_args(buffers)
    fanout = SimpleNamespace(wan_engine=wan, wan_line=WanLine(),
                             codec_choice=wan_coded.CodecChoice(mode, 1e6))
    kv = SimpleNamespace(kv_args=args, pdd_fanout=fanout,
                         pdd_coded_pool=wan_coded.PoolPages(args.kv_data_ptrs, args.kv_data_lens,
                                                            args.kv_item_lens, torch.float32,
                                                            HEAD_DIM),
                         buffers=buffers)  # its pool's memory, kept alive as SGLang's is
    return kv


def send(kv, room, src_chunks, dst_chunks, staged, lines=None):
    """Each chunk a work of one destination, as the fan-out routes them (total set with the
    last), then sent as a WAN sender would."""
    staged.total = len(src_chunks)
    for src, dst in zip(src_chunks, dst_chunks):
        work = SimpleNamespace(room=room, session="main-1", staged=staged, pages_done=0,
                               copy_class=None)
        codec = wan_coded.codec_for(kv, work, False, len(src) * PAGE_BYTES)
        if len(src) and codec is not None:
            assert wan_coded.send_coded(kv, work, src, dst, codec, lines,
                                        lambda *a: False, "yielded") is True
        assert wan_coded.finish_staged(kv, work)


def landed(staging, room, timeout_s=10.0):
    """What the scheduler's poll gets for a room prefill said landed, once it is no longer
    pending (the landing thread lands records as they arrive)."""
    deadline = time.monotonic() + timeout_s
    while True:
        outcome = staging.land(room, landed=True)
        if outcome != PENDING or time.monotonic() > deadline:
            return outcome
        time.sleep(0.001)


def offered(staging, room, pages, peer="prefill-0"):
    return wan_coded.StagedCopy(staging.offer(Receiver(), room, pages, peer))


@pytest.mark.parametrize("mode", ["raw", "lossless", "fp8"])
def test_a_packed_copy_lands_in_mains_pages_off_the_scheduler_thread(mains, mode):
    src_pool, dst_pool = pool(1), pool(2)
    before = [b.clone() for b in dst_pool]
    staging = main_with_staging(mains, dst_pool)
    src = np.array([5, 6, 7, 8, 9, 10, 11, 12, 20])
    dst = np.array([0, 1, 2, 3, 4, 5, 6, 7, 30])
    staged = offered(staging, 77, np.concatenate([dst, [31]]))
    kv = prefill(src_pool, mode)
    # three chunks of the room, the last one (its aux) with no page of its own past the prefix
    send(kv, 77, [src[:4], src[4:], src[:0]], [dst[:4], dst[4:], dst[:0]], staged)
    assert staged.records >= 3 and staged.end_written  # slots of 3 pages
    assert landed(staging, 77) == LANDED
    untouched = np.setdiff1d(np.arange(PAGES), dst)
    for s_buf, d_buf, d_before in zip(src_pool, dst_pool, before):
        if mode == "fp8":
            assert torch.allclose(d_buf[dst], s_buf[src], rtol=0.07, atol=1e-2)
        else:
            assert torch.equal(d_buf[dst], s_buf[src])  # bit-exact
        assert torch.equal(d_buf[untouched], d_before[untouched])
    assert staging.counters["landed_packed"] == 1 and staging.counters["records"] == staged.records
    state = staging.state()
    assert state["in_use_bytes"] == 0 and 0 < state["peak_bytes"] <= state["bytes"]
    assert state["last_landed"]["room"] == 77 and state["last_landed"]["last_record_decode_s"] > 0
    modes = kv.pdd_fanout.codec_choice.state()["copies_by_mode"]
    assert modes == {"packed": mode == "raw", "coded": mode != "raw", "one_sided": 0}
    assert staging.land(77, landed=True) is None  # landed once, then forgotten


def test_a_copy_many_times_the_ring_recycles_its_slots_and_never_writes_one_main_may_read(
        mains, monkeypatch):
    """A room reserves nothing: a copy of 32 pages goes through a ring of two 2-page slots, each
    written only once main has landed what it held. Main's landing is held until prefill has
    found no slot free; prefill waits (reading main's freed words), writing nothing."""
    src_pool, dst_pool = pool(1), pool(2)
    staging = main_with_staging(mains, dst_pool, slots=2, slot_pages=2)
    ring = staging.rings[0]
    hold, go = threading.Event(), threading.Event()
    real_land = staging._land_slot

    def held(ring_, slot):
        hold.set()
        go.wait(10)
        real_land(ring_, slot)
    monkeypatch.setattr(staging, "_land_slot", held)
    violations = []

    def check(dst, length):  # a record or end record written into a slot main may still read
        for slot in range(ring.layout.slots):
            if ring.layout.slot_addr(slot) == dst and ring.arrived[slot] > ring.freed[slot]:
                violations.append(slot)
    engine = CopyingMooncake(check)
    kv = prefill(src_pool, "raw", engine)
    src, dst = np.arange(PAGES), np.arange(PAGES)[::-1].copy()
    staged = offered(staging, 90, dst)
    sender = threading.Thread(target=send, args=(kv, 90, [src], [dst], staged))
    sender.start()
    assert hold.wait(10)  # main has a record to land, and holds it
    writer = next(iter(kv.pdd_fanout.wan_engine.ring_writers.values()))
    deadline = time.monotonic() + 10
    while writer.reads < 3 and time.monotonic() < deadline:  # prefill found no slot, twice
        time.sleep(0.001)
    record_writes = [w for w in engine.writes if w[1] > WORD.itemsize]
    assert writer.reads >= 3 and len(record_writes) == 2  # one record a slot, then it waits
    go.set()
    sender.join(30)
    assert not sender.is_alive() and violations == []
    assert staged.records == PAGES // 2 and landed(staging, 90) == LANDED
    assert all(torch.equal(d[dst], s[src]) for s, d in zip(src_pool, dst_pool))
    assert kv.pdd_fanout.wan_engine.send_pool.state()["in_use_bytes"] == 0


def test_a_damaged_record_fails_its_room_cleanly_and_the_ring_goes_on(mains, monkeypatch):
    src_pool, dst_pool = pool(1), pool(2)
    staging = main_with_staging(mains, dst_pool)
    kv = prefill(src_pool, "raw")
    real = staging._scatter
    damaged = []

    def damage_first(room, room_id, pages, frame):
        if room_id == 78 and not damaged:
            damaged.append(room_id)
            frame[len(frame) - 1] ^= 0xFF  # a flipped WAN bit in its payload
        real(room, room_id, pages, frame)
    monkeypatch.setattr(staging, "_scatter", damage_first)
    send(kv, 78, [np.arange(8)], [np.arange(8, 16)], offered(staging, 78, np.arange(8, 16)))
    reason = landed(staging, 78)
    assert reason not in (LANDED, PENDING) and "CRC" in reason
    assert staging.counters["corrupt"] == 1 and staging.counters["failed_rooms"] == 1
    # the next room on the same ring lands whole
    send(kv, 79, [np.arange(4)], [np.arange(20, 24)], offered(staging, 79, np.arange(20, 24)))
    assert landed(staging, 79) == LANDED
    assert all(torch.equal(d[20:24], s[:4]) for s, d in zip(src_pool, dst_pool))


def test_forgetting_a_room_waits_until_no_record_of_it_is_being_scattered(mains, monkeypatch):
    """SGLang clears a receiver, then gives its pages to another request: main's forget must not
    return while the landing thread still writes them."""
    src_pool, dst_pool = pool(1), pool(2)
    staging = main_with_staging(mains, dst_pool)
    in_scatter, go, order = threading.Event(), threading.Event(), []
    real = staging.pool.scatter

    def slow_scatter(pages, data, stream=None):
        in_scatter.set()
        go.wait(10)
        real(pages, data, stream)
        order.append("scattered")
    monkeypatch.setattr(staging.pool, "scatter", slow_scatter)
    staged = offered(staging, 80, np.arange(4))
    sender = threading.Thread(target=send, args=(prefill(src_pool, "raw"), 80, [np.arange(4)],
                                                 [np.arange(4)], staged))
    sender.start()
    assert in_scatter.wait(10)
    forgetting = threading.Thread(target=lambda: (staging.forget(80), order.append("forgot")))
    forgetting.start()
    forgetting.join(0.2)
    assert forgetting.is_alive()  # the scheduler waits while the record is scattered
    go.set()
    forgetting.join(10)
    sender.join(10)
    assert order == ["scattered", "forgot"]  # its second record is no longer its room's
    assert staging.land(80, landed=True) is None  # forgotten: nothing left of it
    assert staging.counters["forgotten_unlanded"] == 1 and staging.counters["foreign"] >= 1


def test_a_copy_that_cannot_be_packed_goes_one_sided_counted_and_main_still_lands_its_room(
        mains, caplog):
    src_pool, dst_pool = pool(1), pool(2)
    staging = main_with_staging(mains, dst_pool)
    kv = prefill(src_pool, "one_sided")
    staged = offered(staging, 81, np.arange(4))
    work = SimpleNamespace(room=81, session="main-1", staged=staged, pages_done=0)
    assert wan_coded.codec_for(kv, work, False, 4 * PAGE_BYTES) is None
    staged.total = 1
    assert wan_coded.finish_staged(kv, work)  # its end record: 0 records
    assert landed(staging, 81) == LANDED and staging.counters["landed_one_sided"] == 1
    for sliced, ring in ((True, staging.rings[0].layout), (False, None)):  # other TP; no ring
        work = SimpleNamespace(room=82, session="main-1", staged=wan_coded.StagedCopy(ring),
                               pages_done=0)
        assert wan_coded.codec_for(prefill(src_pool, "raw"), work, sliced, 4096) is None
    assert kv.pdd_fanout.codec_choice.state()["copies_by_mode"]["one_sided"] == 1


def test_a_raw_copy_goes_packed_on_tcp_and_one_sided_on_rdma_where_its_requests_fill_the_line(
        mains):
    staging = main_with_staging(mains, pool(2))
    for protocol, block_bytes, expected in (("tcp", 1, "raw"), ("rdma", 1, None),
                                            ("rdma", 1 << 30, "raw")):
        kv = prefill(pool(1), "raw")
        kv.pdd_fanout.wan_engine.protocol = protocol
        kv.pdd_fanout.wan_engine.block_bytes = block_bytes
        work = SimpleNamespace(room=83, session="main-1", pages_done=0,
                               staged=wan_coded.StagedCopy(staging.rings[0].layout))
        assert wan_coded.codec_for(kv, work, False, 4 * PAGE_BYTES) == expected


def test_a_room_a_third_prefill_rank_sends_goes_one_sided(mains):
    staging = main_with_staging(mains, pool(2))
    rings = [staging.offer(Receiver(), room, np.arange(2), f"prefill-{room}")
             for room in range(RINGS_PER_MAIN + 1)]
    assert rings[:-1] == [r.layout for r in staging.rings] and rings[-1] is None
    assert staging.offer(Receiver(), 9, np.arange(2), "prefill-0") == staging.rings[0].layout
    assert staging.counters["no_ring"] == 1
    assert staging.land(RINGS_PER_MAIN, landed=True) is None  # never offered: as SGLang says


def test_a_background_copy_goes_in_the_smaller_records_and_lands_bit_exact(mains):
    src_pool, dst_pool = pool(1), pool(2)
    staging = main_with_staging(mains, dst_pool)
    src, dst = np.arange(8), np.arange(8, 16)
    staged = offered(staging, 84, dst)
    staged.total = 1
    kv = prefill(src_pool)
    kv.pdd_fanout.wan_engine.background_window = CopyWindow(PAGE_BYTES, 2 * PAGE_BYTES, 64)
    work = SimpleNamespace(room=84, session="main-1", staged=staged, pages_done=0,
                           copy_class=CopyClass.NEEDED_NOW, relay_covered=True)
    codec = wan_coded.codec_for(kv, work, False, len(src) * PAGE_BYTES)
    assert wan_coded.send_coded(kv, work, src, dst, codec, None, lambda *a: False,
                                "yielded") is True
    assert wan_coded.finish_staged(kv, work)
    assert staged.records == 8  # a page a record
    assert landed(staging, 84) == LANDED
    assert all(torch.equal(d[dst], s[src]) for s, d in zip(src_pool, dst_pool))


@pytest.mark.parametrize("line_bytes_per_s, expected", [(1e6, "lossless"), (1.25e9, "raw")])
def test_auto_codes_a_copy_only_where_it_shortens_it_on_the_line(mains, line_bytes_per_s,
                                                                 expected):
    """``--pdd-wan-kv-codec auto``: on a slow line (8 Mbit/s) the lossless codec's 1.22x pays for
    its CPU; at 10 Gbit/s one core's ~400 MB/s would lengthen the copy, so it goes packed raw.
    One choice per destination, taken by its first work."""
    staging = main_with_staging(mains, pool(2))
    kv = prefill(pool(1), mode="auto")
    kv.pdd_fanout.codec_choice.declared_line_bytes_per_s = line_bytes_per_s
    staged = wan_coded.StagedCopy(staging.rings[0].layout)
    work = SimpleNamespace(room=1, session="main-1", staged=staged)
    assert wan_coded.codec_for(kv, work, False, 64 << 20) == expected == staged.codec
    kv.pdd_fanout.codec_choice.declared_line_bytes_per_s = 1e6 if expected == "raw" else 1e12
    assert wan_coded.codec_for(kv, work, False, 64 << 20) == expected


@pytest.mark.parametrize("slice_bytes, buffers, block_bytes, packed", [
    (10_000_000, 8, 1_250_000, False),  # a 4-layer model at 200 Mbit/s x 100 ms: half a BDP each
    (10_000_000, 64, 1_250_000, True),  # 32 layers: 156 KB requests
    (64 << 20, 8, 12_500_000, True),  # 10 Gbit/s x 20 ms: the slice is capped, its blocks shrink
    (256 << 10, 8, 25_000, False),  # a slow line: the slice is clamped up, its blocks grow
])
def test_stage_raw_packs_only_where_one_sided_requests_are_below_the_lines_block(
        slice_bytes, buffers, block_bytes, packed):
    assert stage_raw(slice_bytes, buffers, block_bytes) is packed


# ---- the two hazards of a copy that gives up (issue 50) -----------------------------------
class FirstBlockNeverEnds(CopyingMooncake):
    """Mooncake's asynchronous API where the first block never ends (a stalled line: Mooncake
    still reads its source), and every later one copies at once; each block's source is kept
    with the bytes it held when submitted."""

    STUCK = 1

    def __init__(self):
        super().__init__()
        self.sources = []

    def transfer_submit_write(self, session, src, dst, length):
        self.sources.append((src, length, ctypes.string_at(src, length)))
        if len(self.sources) == 1:
            return self.STUCK
        return 100 + super().transfer_submit_write(session, src, dst, length)

    def batch_transfer_async_read(self, session, local, remote, lengths):
        return 100 + super().batch_transfer_async_read(session, local, remote, lengths)

    def transfer_check_status(self, batch):
        return 0 if batch == self.STUCK else 1


def test_a_copy_that_gave_up_keeps_its_send_memory_until_mooncake_ends_the_block(mains):
    """After a copy gives up (twice its timeout), Mooncake may still be reading the records it
    was given; the next copy must not write its records over them."""
    src_pool = pool(1)
    staging = main_with_staging(mains, pool(2))
    engine = FirstBlockNeverEnds()
    kv = prefill(src_pool, mode="raw", engine=engine)
    wan = kv.pdd_fanout.wan_engine
    wan.timeout_s = 0.01
    for room, pages in ((81, np.arange(1)), (82, np.arange(4, 8))):
        staged = offered(staging, room, pages)
        staged.codec = "raw"
        staged.total = 1
        work = SimpleNamespace(room=room, session="main-1", staged=staged, pages_done=0,
                               copy_class=None)
        sent = wan_coded.send_coded(kv, work, pages, pages, "raw", None, lambda *a: False,
                                    "yielded")
        assert sent is (room != 81)  # the first copy gave up on its stalled block
    assert len(engine.sources) > 2  # the second copy's records went out
    src, length, held = engine.sources[0]
    assert ctypes.string_at(src, length) == held  # what Mooncake still reads is untouched
    assert wan.abandoned_batches() == [1]
    assert wan.send_pool.state()["in_use_bytes"] > 0  # held while Mooncake may read it
    engine.transfer_check_status = lambda batch: 1  # Mooncake ends the stalled block at last
    assert wan._reap_abandoned() and wan.send_pool.state()["in_use_bytes"] == 0


class Unregistering(FirstBlockNeverEnds):
    def __init__(self, ends_after_polls=None):
        super().__init__()
        self.polls, self.ends_after_polls, self.unregistered = 0, ends_after_polls, []

    def transfer_check_status(self, batch):
        self.polls += 1
        if self.ends_after_polls is not None and self.polls >= self.ends_after_polls:
            return 1
        return 0

    def batch_unregister_memory(self, ptrs):
        self.unregistered.extend(ptrs)
        return 0


@pytest.mark.parametrize("ends", [False, True])
def test_shutdown_leaves_memory_registered_while_an_abandoned_block_may_still_read_it(ends):
    """At shutdown the copies on the line give up at once; the prefill then closes its WAN
    engine. It unregisters its memory only once Mooncake has ended every block it was given
    (waiting a bounded time); a block still running keeps it registered and alive."""
    buf = torch.zeros(4096, dtype=torch.uint8)
    engine = Unregistering()
    wan = WanTransferEngine.over(engine, timeout_s=60.0)
    wan.register_regions([(buf.data_ptr(), buf.numel())])
    done = []
    with wan.copy("main") as copy:
        assert copy.submit([buf.data_ptr()], [0], [4096])
        wan.stop_waiting()  # shutdown: the copy gives up at its next poll
        done.append(copy.finish())
    assert done == [False] and wan.abandoned_batches() == [1]
    if ends:
        engine.ends_after_polls = engine.polls + 3  # Mooncake ends it while the engine closes
    wan.close()
    assert engine.unregistered == ([buf.data_ptr()] if ends else [])


def test_a_packed_copy_crosses_real_mooncake_engines_into_mains_ring(mains):
    """The ring's one-sided protocol over Mooncake's TCP transport in one process: records and
    arrival words written, main's freed words read as credits, a copy several times the ring."""
    from mooncake.engine import TransferEngine

    receiver = TransferEngine()
    assert receiver.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    src_pool, dst_pool = pool(1), pool(2)
    engine = SimpleNamespace(register=lambda p, n: receiver.register_memory(p, n),
                             deregister=receiver.unregister_memory)
    slot_bytes = 2 * (PAGE_BYTES + 4) + 60
    ring = RingLayout.for_slots(0, 3, slot_bytes).nbytes
    staging = MainStaging(SimpleNamespace(kv_args=kv_args(dst_pool), engine=engine),
                          RINGS_PER_MAIN * ring, ring, slot_bytes)
    mains.append(staging)
    wan = WanTransferEngine("127.0.0.1", "tcp", None, timeout_s=30.0)
    kv = prefill(src_pool, "raw", engine=wan.engine)
    kv.pdd_fanout.wan_engine = wan
    wan.slice_bytes = 3 * PAGE_BYTES
    wan.register_regions([(b.data_ptr(), b.numel() * 4) for b in src_pool])
    session = f"127.0.0.1:{receiver.get_rpc_port()}"
    src, dst = np.arange(PAGES), np.arange(PAGES)[::-1].copy()
    staged = offered(staging, 91, dst)
    staged.total = 1
    work = SimpleNamespace(room=91, session=session, staged=staged, pages_done=0, copy_class=None)
    assert wan_coded.codec_for(kv, work, False, PAGES * PAGE_BYTES) == "raw"
    assert wan_coded.send_coded(kv, work, src, dst, "raw", None, lambda *a: False, "y") is True
    assert wan_coded.finish_staged(kv, work)
    assert landed(staging, 91) == LANDED and staged.records == PAGES // 2
    assert all(torch.equal(d[dst], s[src]) for s, d in zip(src_pool, dst_pool))
    assert next(iter(wan.ring_writers.values())).reads >= 1
    wan.close()


def test_an_arrival_word_whose_write_failed_is_sent_again_by_the_next_copy(mains):
    """Main lands a slot only once its arrived word passes its freed one: a word whose write
    failed would hold its slot for ever. The next copy sends it again, so main frees it."""
    src_pool, dst_pool = pool(1), pool(2)
    staging = main_with_staging(mains, dst_pool, slots=2)
    arrived_words = {staging.rings[0].layout.arrived_addr(slot) for slot in range(2)}

    class LosesTheFirstArrivalWord(CopyingMooncake):
        lost: list = []

        def transfer_submit_write(self, session, src, dst, length):
            if dst in arrived_words and not self.lost:
                self.lost.append(dst)
                return -1
            return super().transfer_submit_write(session, src, dst, length)
    kv = prefill(src_pool, "raw", LosesTheFirstArrivalWord())
    failed = offered(staging, 92, np.arange(2))
    failed.total = 1
    work = SimpleNamespace(room=92, session="main-1", staged=failed, pages_done=0,
                           copy_class=None)
    assert wan_coded.send_coded(kv, work, np.arange(2), np.arange(2), "raw", None,
                                lambda *a: False, "y") is False  # its record and end record
    assert LosesTheFirstArrivalWord.lost and staging.land(92, landed=False) is None  # it failed
    # the request placed again: its copy needs both slots, so the lost word must be sent again
    send(kv, 93, [np.arange(4)], [np.arange(4, 8)], offered(staging, 93, np.arange(4, 8)))
    assert landed(staging, 93) == LANDED and staging.counters["foreign"] == 2  # room 92's two
    assert all(torch.equal(d[4:8], s[:4]) for s, d in zip(src_pool, dst_pool))


def test_one_sided_on_tcp_is_logged_once_and_every_copy_counted(monkeypatch, caplog):
    import threading as _threading

    monkeypatch.setattr(wan_coded, "_ONE_SIDED_LOGGED", _threading.Event())
    kv = prefill(pool(1), "raw")
    for room in (1, 2, 3):  # mains that named no ring (another TP size, or none left)
        work = SimpleNamespace(room=room, session="main-1", staged=wan_coded.StagedCopy(None),
                               pages_done=0)
        with caplog.at_level("WARNING", logger=wan_coded.logger.name):
            assert wan_coded.codec_for(kv, work, False, 4096) is None
    logged = [r for r in caplog.records if "goes one-sided on TCP" in r.getMessage()]
    assert len(logged) == 1 and "no staging ring" in logged[0].getMessage()
    assert kv.pdd_fanout.codec_choice.state()["copies_by_mode"]["one_sided"] == 3
