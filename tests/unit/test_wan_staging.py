"""The coded WAN path in one process (issue 36): prefill's records written by its WAN engine into
main's staging range (a scripted Mooncake that copies the bytes), decoded by main into its pages
before the room lands; the staging allocator gives back every byte on a cancel or a failure."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pdd_sglang.decode.wan_staging import MainStaging
from pdd_sglang.kv_codec import CorruptFrame
from pdd_sglang.kv_codec.pool import PoolPages
from pdd_sglang.kv_codec.staging import ALIGN, StagingAllocator
from pdd_sglang.kv_codec.wire import END_BYTES, RECORD, pack_end, pack_record, read_end, records
from pdd_sglang.prefill import wan_coded
from pdd_sglang.policy.wan_codec import stage_raw
from pdd_sglang.prefill.wan_engine import CopyWindow, WanTransferEngine
from pdd_sglang.prefill.wan_lines import CopyClass
from pdd_sglang.prefill.wan_line import WanLine

LAYERS, PAGE, HEADS, HEAD_DIM, PAGES = 2, 4, 2, 8, 32


class Receiver:
    """SGLang's KV receiver, as main's staging knows it (held by weak reference)."""


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
    frame = b"F" * 40
    staged = bytearray(END_BYTES)
    body = pack_record(5, np.array([3, 4]), frame) + pack_record(5, np.array([9]), frame)
    staged[:END_BYTES] = pack_end(5, 2, len(body), 123)
    staged += body
    view = memoryview(staged)
    assert read_end(view, 5) == (2, len(body), 123)
    got = [(list(p), bytes(f)) for p, f in records(view, 5, 2, len(body))]
    assert got == [([3, 4], frame), ([9], frame)]
    with pytest.raises(CorruptFrame, match="another room"):
        read_end(view, 6)
    damaged = bytearray(staged)
    damaged[END_BYTES + RECORD.size] ^= 1  # a page id
    with pytest.raises(CorruptFrame, match="CRC"):
        list(records(memoryview(damaged), 5, 2, len(body)))
    with pytest.raises(CorruptFrame, match="missing"):
        read_end(memoryview(bytearray(END_BYTES)), 5)


# ---- prefill to main in one process ----------------------------------------------------------
class CopyingMooncake:
    """Mooncake's asynchronous API: each write copies its bytes at once (addresses are real)."""

    def __init__(self):
        self.writes = []

    def transfer_submit_write(self, session, src, dst, length):
        ctypes.memmove(dst, src, length)
        self.writes.append(length)
        return len(self.writes)

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


def main_with_staging(buffers, size=1 << 20):
    registered = []
    engine = SimpleNamespace(register=lambda p, n: registered.append((p, n)),
                             deregister=lambda p: registered.remove(next(r for r in registered
                                                                          if r[0] == p)))
    staging = MainStaging(SimpleNamespace(kv_args=kv_args(buffers), engine=engine), size)
    assert registered == [(staging.addr, size)]
    staging.registered = registered
    return staging


def prefill(buffers, mode="lossless"):
    wan = WanTransferEngine.over(CopyingMooncake(), timeout_s=5.0, window_bytes=4096,
                                 slice_bytes=3 * PAGE * HEADS * HEAD_DIM * 4 * 2 * LAYERS)
    args = kv_args(buffers)
    fanout = SimpleNamespace(wan_engine=wan, wan_line=WanLine(),
                             codec_choice=wan_coded.CodecChoice(mode, 1e6))
    kv = SimpleNamespace(kv_args=args, pdd_fanout=fanout,
                         pdd_coded_pool=PoolPages(args.kv_data_ptrs, args.kv_data_lens,
                                                  args.kv_item_lens, torch.float32, HEAD_DIM))
    return kv


def send(kv, room, src_chunks, dst_chunks, staged):
    """Each chunk a work of one destination, as the fan-out routes them (total set with the
    last), then sent as a WAN sender would."""
    staged.total = len(src_chunks)
    for src, dst in zip(src_chunks, dst_chunks):
        work = SimpleNamespace(room=room, session="main-1", staged=staged, pages_done=0,
                               copy_class=None)
        codec = wan_coded.codec_for(kv, work, False, len(src) * 4096)
        if len(src) and codec is not None:
            assert wan_coded.send_coded(kv, work, src, dst, codec, None,
                                        lambda *a: False, "yielded") is True
        assert wan_coded.finish_staged(kv, work)


@pytest.mark.parametrize("mode", ["lossless", "fp8"])
def test_a_coded_copy_lands_in_mains_pages_only_when_it_is_decoded(mode):
    src_pool, dst_pool = pool(1), pool(2)
    before = [b.clone() for b in dst_pool]
    staging = main_with_staging(dst_pool)
    receiver = Receiver()
    src = np.array([5, 6, 7, 8, 9, 10, 11, 12, 20])
    dst = np.array([0, 1, 2, 3, 4, 5, 6, 7, 30])
    addr, nbytes = staging.offer(receiver, 77, np.concatenate([dst, [31]]))
    staged = wan_coded.StagedCopy(addr, nbytes)
    kv = prefill(src_pool, mode)
    # three chunks of the room, the last one (its aux) with no page of its own past the prefix
    send(kv, 77, [src[:4], src[4:], src[:0]], [dst[:4], dst[4:], dst[:0]], staged)
    assert staged.records >= 3 and staged.end_written  # slices of 3 pages
    assert all(torch.equal(a, b) for a, b in zip(dst_pool, before))  # nothing in the pages yet
    assert staging.land(receiver, 77, landed=True) is None
    untouched = np.setdiff1d(np.arange(PAGES), dst)
    for s_buf, d_buf, d_before in zip(src_pool, dst_pool, before):
        if mode == "lossless":
            assert torch.equal(d_buf[dst], s_buf[src])  # bit-exact
        else:
            assert torch.allclose(d_buf[dst], s_buf[src], rtol=0.07, atol=1e-2)
        assert torch.equal(d_buf[untouched], d_before[untouched])
    assert staging.state()["in_use_bytes"] == 0 and staging.counters["landed_coded"] == 1
    if mode == "lossless":
        assert 0 < staged.wire_bytes < staged.raw_bytes + staged.records * 128


class RelayFinishesAfterTheFirstRecord:
    """The WAN lines as a sender asks them between records: the copy's relay answered alone
    after its first record (the owner made it cache-only), and nothing waits behind it."""

    def should_yield(self, work):
        work.copy_class = CopyClass.CACHE_ONLY
        return False


class NothingWaits:
    def should_yield(self, work):
        return False


@pytest.mark.parametrize("relay_covered, lines, records", [
    (False, RelayFinishesAfterTheFirstRecord(), 1 + 5),  # 3 pages needed-now, then a page a record
    (True, NothingWaits(), 8),  # a handoff's copy: a page a record from the start
])
def test_a_background_copy_goes_in_the_smaller_records_and_lands_bit_exact(relay_covered, lines,
                                                                            records):
    src_pool, dst_pool = pool(1), pool(2)
    staging = main_with_staging(dst_pool)
    receiver = Receiver()
    src, dst = np.arange(8), np.arange(8, 16)
    addr, nbytes = staging.offer(receiver, 79, dst)
    staged = wan_coded.StagedCopy(addr, nbytes)
    staged.total = 1
    kv = prefill(src_pool)
    page_bytes = kv.pdd_coded_pool.page_bytes
    kv.pdd_fanout.wan_engine.background_window = CopyWindow(page_bytes, 2 * page_bytes, 64)
    work = SimpleNamespace(room=79, session="main-1", staged=staged, pages_done=0,
                           copy_class=CopyClass.NEEDED_NOW, relay_covered=relay_covered)
    codec = wan_coded.codec_for(kv, work, False, len(src) * page_bytes)
    assert wan_coded.send_coded(kv, work, src, dst, codec, lines, lambda *a: False,
                                "yielded") is True
    assert wan_coded.finish_staged(kv, work)
    assert staged.records == records
    assert staging.land(receiver, 79, landed=True) is None
    for s_buf, d_buf in zip(src_pool, dst_pool):
        assert torch.equal(d_buf[dst], s_buf[src])


def test_a_damaged_record_fails_the_room_with_no_page_written_and_frees_its_range():
    src_pool, dst_pool = pool(1), pool(2)
    before = [b.clone() for b in dst_pool]
    staging = main_with_staging(dst_pool)
    receiver = Receiver()
    src, dst = np.arange(8), np.arange(8, 16)
    addr, nbytes = staging.offer(receiver, 78, dst)
    staged = wan_coded.StagedCopy(addr, nbytes)
    send(prefill(src_pool), 78, [src], [dst], staged)
    view = memoryview(staging.region.numpy())[addr - staging.addr:][:nbytes]
    view[END_BYTES + staged.wire_bytes - 1] ^= 0xFF  # the last frame's last byte
    reason = staging.land(receiver, 78, landed=True)
    assert reason is not None and "failed to decode" in reason and "CRC" in reason
    assert all(torch.equal(a, b) for a, b in zip(dst_pool, before))  # earlier records too
    assert staging.state()["in_use_bytes"] == 0 and staging.counters["corrupt"] == 1


def test_a_room_that_fails_or_is_dropped_gives_its_range_back():
    staging = main_with_staging(pool(2), size=64 << 10)
    failed, dropped, other = Receiver(), Receiver(), Receiver()
    assert staging.offer(failed, 1, np.arange(4))[1] > 0
    assert staging.offer(dropped, 2, np.arange(4, 8))[1] > 0
    assert staging.land(other, 1, landed=True) is None  # not its receiver: nothing happens
    assert staging.state()["rooms"] == 2
    assert staging.land(failed, 1, landed=False) is None  # the copy failed: no decode ...
    assert staging.state()["rooms"] == 2  # ... and its range held while SGLang holds the room
    del dropped, failed  # SGLang let the requests go (their pages freed): swept at the next
    assert staging.state()["rooms"] == 0 and staging.state()["in_use_bytes"] == 0  # report
    big = np.arange(PAGES * 100)  # more than the region: this room goes raw
    assert staging.offer(Receiver(), 3, big) == (0, 0)
    assert staging.counters["no_room"] == 1
    staging.close()
    staging.close()  # the scheduler's exit path may run twice
    assert staging.registered == []


def test_a_room_sent_raw_lands_as_before():
    staging = main_with_staging(pool(2))
    receiver = Receiver()
    addr, nbytes = staging.offer(receiver, 9, np.arange(4))
    staged = wan_coded.StagedCopy(addr, nbytes)
    send(prefill(pool(1), mode="raw"), 9, [np.arange(4)], [np.arange(4)], staged)
    assert staged.codec == wan_coded.UNSTAGED and staged.records == 0 and not staged.end_written
    assert staging.land(receiver, 9, landed=True) is None  # a clear end record: nothing coded
    assert staging.counters["landed_raw"] == 1 and staging.state()["in_use_bytes"] == 0


@pytest.mark.parametrize("line_bytes_per_s, expected", [(1e6, "lossless"), (1.25e9, "raw")])
def test_auto_codes_a_copy_only_where_it_shortens_it_on_the_line(line_bytes_per_s, expected):
    """``--pdd-wan-kv-codec auto``: on a slow line (8 Mbit/s) the lossless codec's 1.22x pays for
    its CPU; at 10 Gbit/s one core's ~400 MB/s would lengthen the copy, so it goes raw. One
    choice per destination, taken by its first work."""
    kv = prefill(pool(1), mode="auto")
    kv.pdd_fanout.codec_choice.declared_line_bytes_per_s = line_bytes_per_s
    staged = wan_coded.StagedCopy(4096, 1 << 20)
    work = SimpleNamespace(room=1, session="main-1", staged=staged)
    settled = wan_coded.UNSTAGED if expected == "raw" else expected  # 2 layers: not packed
    got = wan_coded.codec_for(kv, work, False, 64 << 20)
    assert (got or wan_coded.UNSTAGED) == settled and staged.codec == settled
    kv.pdd_fanout.codec_choice.declared_line_bytes_per_s = 1e6 if expected == "raw" else 1e12
    assert (wan_coded.codec_for(kv, work, False, 64 << 20) or wan_coded.UNSTAGED) == settled


def test_a_raw_copy_whose_per_layer_blocks_are_too_small_goes_packed_and_lands_bit_exact():
    """One-sided, a slice is one Mooncake request per KV buffer; when those would be smaller
    than the line's block (``block_bytes``), the uncoded copy goes as raw records packed into
    main's staging range instead, decoded into the same pages."""
    src_pool, dst_pool = pool(1), pool(2)
    staging = main_with_staging(dst_pool)
    receiver = Receiver()
    src, dst = np.arange(3, 11), np.arange(12, 20)
    addr, nbytes = staging.offer(receiver, 80, dst)
    staged = wan_coded.StagedCopy(addr, nbytes)
    kv = prefill(src_pool, mode="raw")
    wan = kv.pdd_fanout.wan_engine
    wan.block_bytes = wan.slice_bytes // 2  # each of the 2 * LAYERS buffers gets less than that
    send(kv, 80, [src], [dst], staged)
    assert staged.codec == "raw" and staged.records >= 2 and staged.end_written
    assert staged.wire_bytes > staged.raw_bytes  # uncoded: the records' headers on top
    assert kv.pdd_fanout.codec_choice.counters["packed_raw_copies"] == 1
    assert staging.land(receiver, 80, landed=True) is None
    assert all(torch.equal(d[dst], s[src]) for s, d in zip(src_pool, dst_pool))
    assert staging.state()["in_use_bytes"] == 0


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

    def __init__(self):
        super().__init__()
        self.sources = []

    def transfer_submit_write(self, session, src, dst, length):
        self.sources.append((src, length, ctypes.string_at(src, length)))
        if len(self.sources) > 1:
            super().transfer_submit_write(session, src, dst, length)
        return len(self.sources)

    def transfer_check_status(self, batch):
        return 0 if batch == 1 else 1


def test_a_copy_that_gave_up_keeps_its_send_memory_until_mooncake_ends_the_block():
    """After a copy gives up (twice its timeout), Mooncake may still be reading the records it
    was given; the next copy must not write its records over them."""
    src_pool = pool(1)
    staging = main_with_staging(pool(2))
    kv = prefill(src_pool, mode="raw")
    engine = FirstBlockNeverEnds()
    kv.pdd_fanout.wan_engine = WanTransferEngine.over(engine, timeout_s=0.01, window_bytes=4096,
                                                      slice_bytes=kv.pdd_fanout.wan_engine.
                                                      slice_bytes)
    wan = kv.pdd_fanout.wan_engine
    for room, pages in ((81, np.arange(1)), (82, np.arange(4, 8))):
        addr, nbytes = staging.offer(Receiver(), room, pages)
        staged = wan_coded.StagedCopy(addr, nbytes, codec="raw")
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
