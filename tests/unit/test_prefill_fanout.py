"""Per-destination page offsets, at every page size and across chunk boundaries."""

import dataclasses

import numpy as np
import pytest

from pdd_sglang.prefill.destination_chunks import skip_prefix_pages


@dataclasses.dataclass
class Chunk:  # the fields of SGLang's TransferKVChunk that the offset touches
    room: int
    prefill_kv_indices: np.ndarray
    index_slice: slice
    num_kv_tokens: int | None = None
    is_last_chunk: bool = False


def chunks_of(total_pages: int, chunk_pages: int):
    """SGLang numbers a room's chunks from where sending started (the smallest prefix)."""
    pages = np.arange(1000, 1000 + total_pages, dtype=np.int32)  # source page ids
    for start in range(0, total_pages, chunk_pages):
        stop = min(start + chunk_pages, total_pages)
        yield Chunk(1, pages[start:stop], slice(start, stop))


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("skip_pages", [0, 1, 3, 7, 12])
@pytest.mark.parametrize("chunk_pages", [1, 2, 5, 64])
def test_destination_gets_exactly_the_pages_past_its_prefix(page_size, skip_pages, chunk_pages):
    total = 12
    sent_src, sent_dst = [], []
    for room_chunk in chunks_of(total, chunk_pages):
        view = skip_prefix_pages(room_chunk, skip_pages * page_size, page_size)
        assert len(view.prefill_kv_indices) == view.index_slice.stop - view.index_slice.start
        sent_src.extend(view.prefill_kv_indices.tolist())
        sent_dst.extend(range(view.index_slice.start, view.index_slice.stop))
    # Source pages: the room's pages from skip_pages on; destination slots: 0.. in its own numbering.
    assert sent_src == list(range(1000 + skip_pages, 1000 + total))
    assert sent_dst == list(range(0, total - skip_pages))


def test_zero_offset_returns_the_chunk_itself():
    chunk = next(chunks_of(4, 4))
    assert skip_prefix_pages(chunk, 0, 16) is chunk


@pytest.mark.parametrize("skip_tokens", [-16, 5])
def test_misaligned_or_negative_offset_is_refused(skip_tokens):
    with pytest.raises(ValueError, match="page size"):
        skip_prefix_pages(next(chunks_of(4, 4)), skip_tokens, 16)


# ---- the fan-out's owner: what it decides, driven event by event (tests/unit/fanout_harness.py)
import pdd_sglang.hooks as hooks  # noqa: E402
from fanout_harness import (MAIN, RELAY, Kv, chunk, drain, make_fanout, poll_name,  # noqa: E402
                            register, send_all)


@pytest.fixture(autouse=True)
def prefill_role(monkeypatch):
    monkeypatch.setattr(hooks, "_role", "prefill")


def opened(kv, room):
    from sglang.srt.disaggregation.base.conn import KVPoll

    kv.update_status(room, KVPoll.Bootstrapping)


def test_a_main_that_registered_first_waits_for_its_relay_then_the_room_starts_at_the_smallest_prefix():
    kv = Kv()
    fanout = make_fanout(kv)
    opened(kv, 8)
    register(fanout, kv, 8, MAIN, "main", prefix=16)
    assert poll_name(kv.request_status[8]) == "Bootstrapping"
    register(fanout, kv, 8, RELAY, "relay")
    assert poll_name(kv.request_status[8]) == "WaitingForInput"
    assert kv.req_to_decode_prefix_len[8] == 0
    fanout.take_chunk(chunk(8, 0, 24, last=True))
    drain(fanout)
    (relay_work,), (main_work,) = fanout.local_queues[0], fanout.wan_lines
    assert len(relay_work.chunk.prefill_kv_indices) == 24
    assert main_work.chunk.prefill_kv_indices.tolist() == list(range(16, 24))  # past its prefix


def test_mains_copy_is_relay_covered_while_the_room_has_a_relay_and_not_once_it_failed():
    """A relay answers the request while main's copy flies: the copy keeps the background window
    (prefill/wan_engine.py) until the relay fails, and then goes on with the full one."""
    from pdd_sglang.prefill.events import ChunkSent, RelayLost

    kv = Kv()
    fanout = make_fanout(kv)
    opened(kv, 26)
    register(fanout, kv, 26, MAIN, "main")
    register(fanout, kv, 26, RELAY, "relay")
    fanout.take_chunk(chunk(26, 0, 8))
    drain(fanout)
    (relay_work,), (main_work,) = fanout.local_queues[0], fanout.wan_lines
    assert main_work.relay_covered
    fanout.handle(ChunkSent(relay_work, False, "PDD: the relay's copy failed"))
    assert not main_work.relay_covered  # queued: its next slice goes out in the full window
    fanout.take_chunk(chunk(26, 8, 12, last=True))
    drain(fanout)
    assert [w.relay_covered for w in fanout.wan_lines] == [False, False]
    opened(kv, 28)  # the router saw the relay die after it had its KV: prefill never would
    register(fanout, kv, 28, MAIN, "main")
    register(fanout, kv, 28, RELAY, "relay")
    fanout.take_chunk(chunk(28, 0, 8))
    drain(fanout)
    mains = [w for w in fanout.wan_lines if w.room == 28]
    assert [w.relay_covered for w in mains] == [True]
    fanout.handle(RelayLost(28))
    fanout.take_chunk(chunk(28, 8, 12, last=True))
    drain(fanout)
    assert [w.relay_covered for w in fanout.wan_lines if w.room == 28] == [False, False]
    assert fanout.published["relays_lost"] == 1
    opened(kv, 27)  # P->MD: main alone, nothing answers the request meanwhile
    register(fanout, kv, 27, MAIN, "main", destinations=1)
    fanout.take_chunk(chunk(27, 0, 4, last=True))
    drain(fanout)
    assert not fanout.wan_lines[-1].relay_covered


def test_silent_relay_is_dropped_and_a_late_one_refused():
    kv = Kv()
    fanout = make_fanout(kv)
    fanout.relay_bootstrap_timeout_s = 2.0
    opened(kv, 9)
    register(fanout, kv, 9, MAIN, "main", prefix=32)
    start = fanout._rooms[9].first_hello_at
    fanout.tick(now=start + 1.0)
    assert poll_name(kv.request_status[9]) == "Bootstrapping"
    fanout.tick(now=start + 3.0)
    assert poll_name(kv.request_status[9]) == "WaitingForInput"
    assert kv.req_to_decode_prefix_len[9] == 32  # the main's own prefix: only it is served
    register(fanout, kv, 9, RELAY, "relay")
    assert kv.messages == [((("127.0.0.1", 1001),), 9, "Failed")]
    assert fanout.published["relays_dropped"] == 1 and fanout.published["refused_late"] == 1


def test_malformed_and_repeated_hellos_are_refused():
    from fanout_harness import hello_frames

    kv = Kv()
    fanout = make_fanout(kv)
    frames = hello_frames(kv, 5, MAIN, "main", prefix=16)
    frames[8] = b"64"  # the metadata's prefix disagrees with the hello's
    assert fanout.claim_registration(5, MAIN, frames)
    drain(fanout)
    assert fanout.published["refused_hellos"] == 1 and 5 not in fanout.pdd_rooms
    register(fanout, kv, 6, MAIN, "main", destinations=1)
    register(fanout, kv, 6, MAIN, "main", destinations=1)
    assert kv.messages[-1] == ((("127.0.0.1", 2002),), 6, "Failed")
    assert len(fanout._rooms[6].destinations) == 1


def test_a_prefix_claim_beyond_the_prompt_fails_the_room_cleanly():
    kv = Kv()
    fanout = make_fanout(kv)
    opened(kv, 3)
    register(fanout, kv, 3, RELAY, "relay")
    register(fanout, kv, 3, MAIN, "main", prefix=500)
    fanout.take_chunk(chunk(3, 0, 100, last=True))
    drain(fanout)
    send_all(fanout, kv, fanout.local_queues[1])
    assert poll_name(kv.request_status[3]) == "Failed"
    assert "beyond the 100 tokens" in kv.failure_records[3]
    assert {m[2] for m in kv.messages} == {"Failed"}


def test_silent_main_is_dropped_after_the_relay_has_its_kv():
    kv = Kv()
    fanout = make_fanout(kv)
    fanout.main_bootstrap_timeout_s = 3.0
    opened(kv, 12)
    register(fanout, kv, 12, RELAY, "relay")
    fanout.take_chunk(chunk(12, 0, 4, last=True))
    drain(fanout)
    start = fanout._rooms[12].first_hello_at
    fanout.tick(now=start + 10)  # past the deadline, but the relay's copy is not done: keep the KV
    assert poll_name(kv.request_status[12]) == "WaitingForInput"
    send_all(fanout, kv, fanout.local_queues[0])
    assert kv.messages == [((("127.0.0.1", 1001),), 12, "Success")]  # the relay decodes now
    fanout.tick(now=start + 2)
    assert poll_name(kv.request_status[12]) == "WaitingForInput"
    fanout.tick(now=start + 4)
    assert poll_name(kv.request_status[12]) == "Success"  # prefill frees the room's KV
    assert fanout.published["mains_dropped"] == 1


def test_a_relay_whose_transfer_fails_drops_out_and_a_late_main_still_gets_every_chunk():
    kv = Kv()
    fanout = make_fanout(kv)
    kv.fail_kv = {RELAY}
    opened(kv, 21)
    register(fanout, kv, 21, RELAY, "relay")
    fanout.take_chunk(chunk(21, 0, 8))
    drain(fanout)
    send_all(fanout, kv, fanout.local_queues[1])
    assert kv.messages == [((("127.0.0.1", 1001),), 21, "Failed")]
    register(fanout, kv, 21, MAIN, "main")
    fanout.take_chunk(chunk(21, 8, 12, last=True))
    drain(fanout)
    assert not fanout.local_queues[1]  # nothing more for the relay
    send_all(fanout, kv, fanout.wan_lines)
    assert [s for s in kv.sent_kv if s[0] == MAIN] == [(MAIN, 0, 8), (MAIN, 8, 4)]
    assert poll_name(kv.request_status[21]) == "Success"


def test_a_room_waits_for_its_chunks_in_flight_before_it_concludes_failed():
    """A failed relay with main's chunk still queued: the room may not conclude (and prefill may
    not free the KV the queued chunk reads) until that chunk has reported."""
    kv = Kv()
    fanout = make_fanout(kv)
    kv.fail_kv = {MAIN}
    opened(kv, 22)
    register(fanout, kv, 22, MAIN, "main", destinations=1)
    fanout.take_chunk(chunk(22, 0, 4))
    fanout.take_chunk(chunk(22, 4, 8, last=True))
    drain(fanout)
    queue = fanout.wan_lines
    first = queue.pop(0)
    from pdd_sglang.prefill.events import ChunkSent

    fanout.handle(ChunkSent(first, False, "PDD: the line broke"))
    assert poll_name(kv.request_status[22]) == "WaitingForInput"  # one chunk still queued
    assert queue[0].cancelled
    send_all(fanout, kv, queue)  # the sender skips it and reports
    assert poll_name(kv.request_status[22]) == "Failed"
    assert [s[0] for s in kv.sent_kv] == [] and kv.messages[-1][2] == "Failed"


def test_a_chunk_stuck_in_a_sender_fails_its_destination_and_frees_the_room():
    kv = Kv()
    fanout = make_fanout(kv)
    fanout.stuck_after_s = 30.0
    opened(kv, 23)
    register(fanout, kv, 23, MAIN, "main", destinations=1)
    fanout.take_chunk(chunk(23, 0, 4, last=True))
    drain(fanout)
    work = fanout.wan_lines[0]
    work.started_at = fanout.clock()  # a sender took it, and Mooncake never returns
    fanout.tick(now=work.started_at + 10)
    assert poll_name(kv.request_status[23]) == "WaitingForInput"
    fanout.tick(now=work.started_at + 31)
    assert poll_name(kv.request_status[23]) == "Failed"
    assert fanout.published["rooms_stuck"] == 1 and fanout.published["rooms_open"] == 0


def test_a_room_sglang_cleared_frees_its_destinations_and_is_forgotten_at_once():
    """An abort clears SGLang's sender within one tick: the clear is an event (patch 0006), so
    the owner neither misses it nor starts the room later (which would re-create its status)."""
    kv = Kv()
    fanout = make_fanout(kv)
    fanout.relay_bootstrap_timeout_s = 1.0
    opened(kv, 24)
    register(fanout, kv, 24, MAIN, "main")
    kv.request_status.pop(24)  # the client aborted: SGLang's sender.clear()
    fanout.sender_cleared(24)
    drain(fanout)
    assert kv.messages == [((("127.0.0.1", 2002),), 24, "Failed")]
    fanout.tick(now=fanout.clock() + 5)  # past the relay's deadline: nothing starts
    assert 24 not in kv.request_status and fanout.published["rooms_tracked"] == 0
    register(fanout, kv, 24, RELAY, "relay")  # late: refused, not a new room
    assert kv.messages[-1][2] == "Failed" and fanout.published["rooms_tracked"] == 0


def test_a_started_room_prefill_never_computes_is_abandoned_after_the_decode_timeout():
    kv = Kv()
    fanout = make_fanout(kv)
    fanout.abandon_after_s = 40.0
    opened(kv, 25)
    register(fanout, kv, 25, RELAY, "relay")
    register(fanout, kv, 25, MAIN, "main")
    started = fanout._rooms[25].started_at
    fanout.tick(now=started + 30)
    assert fanout.published["rooms_open"] == 1
    fanout.tick(now=started + 41)
    assert poll_name(kv.request_status[25]) == "Failed"
    assert sorted(m[0][0][1] for m in kv.messages) == [1001, 2002]
    assert fanout.published["rooms_abandoned"] == 1 and fanout.published["rooms_open"] == 0


def test_a_destination_of_a_tp_size_sglang_cannot_pair_is_refused_naming_both_sizes(caplog):
    """Heterogeneous TP (issues 23, 37): SGLang's PD pairs ranks of different TP sizes by whole
    ratios (tests/unit/test_mixed_tp.py); a size neither dividing nor divided by prefill's is
    refused at bootstrap."""
    from fanout_harness import hello_frames

    from pdd_sglang.protocol.messages import DestinationHello, encode

    kv = Kv()
    kv.attn_tp_size = 2
    fanout = make_fanout(kv)
    frames = hello_frames(kv, 7, MAIN, "main")
    frames[-1] = encode(DestinationHello(room=7, role="main", destinations=2, prefix_tokens=0,
                                         tp_size=3))
    assert fanout.claim_registration(7, MAIN, frames)
    drain(fanout)
    assert fanout.published["refused_hellos"] == 1 and 7 not in fanout.pdd_rooms
    assert kv.messages[-1] == ((("127.0.0.1", 2002),), 7, "Failed")
    assert ("the main runs --tp-size 3, this prefill --tp-size 2: SGLang's PD pairs prefill and "
            "decode ranks by whole ratios" in caplog.text)
    register(fanout, kv, 8, MAIN, "main", destinations=1)  # TP 1 under prefill's 2: accepted
    assert len(fanout._rooms[8].destinations) == 1


# ---- copy classes (issue 34): the copy a request waits for goes first --------------------------
def _room_with_relay_done(kv, fanout, room):
    opened(kv, room)
    register(fanout, kv, room, RELAY, "relay")
    register(fanout, kv, room, MAIN, "main")
    fanout.take_chunk(chunk(room, 0, 8, last=True))
    drain(fanout)
    send_all(fanout, kv, fanout.local_queues[room % 2])  # the relay has its KV


def test_a_room_the_router_calls_cache_only_sends_main_its_copy_behind_needed_now_ones():
    from pdd_sglang.prefill.events import CacheOnly
    from pdd_sglang.prefill.wan_lines import CopyClass

    kv = Kv()
    fanout = make_fanout(kv)
    _room_with_relay_done(kv, fanout, 30)
    fanout.events.put(CacheOnly(30))
    fanout.events.put(CacheOnly(999))  # a room it never knew: ignored
    drain(fanout)
    (work,) = fanout.wan_lines
    assert work.copy_class is CopyClass.CACHE_ONLY
    assert fanout.published["cache_only_copies"] == 1
    send_all(fanout, kv, fanout.wan_lines)
    assert poll_name(kv.request_status[30]) == "Success"


def test_past_the_backlog_bound_a_cache_only_copy_is_dropped_main_told_not_taken_out():
    from pdd_sglang.prefill.events import CacheOnly

    kv = Kv()
    fanout = make_fanout(kv)
    fanout.cache_only_backlog_s = 1.0
    _room_with_relay_done(kv, fanout, 31)
    fanout.handle(CacheOnly(31))
    fanout.wan_line._main(MAIN).recent.append((100, 1.0))  # the line measured at 100 B/s
    fanout.tick()  # 8 pages x 200 B ahead, 16 s of line: past the 1 s bound
    assert fanout.published["cache_only_dropped"] == 1 and MAIN not in fanout.mains_out
    assert kv.messages[-1][1:] == (31, "Failed")  # main frees its slots
    assert fanout.wan_line.snapshot()[MAIN]["dropped_cache_only_bytes"] == 1600
    assert fanout.wan_line.snapshot()[MAIN]["bytes_ahead"] == 0  # cancelled: nothing ahead
    send_all(fanout, kv, fanout.wan_lines)  # the sender skips it and reports
    assert poll_name(kv.request_status[31]) == "Success"  # the relay answers; prefill's KV freed
    assert [s for s in kv.sent_kv if s[0] == MAIN] == []


def test_the_backlog_bound_counts_wire_bytes_on_a_coded_line():
    """The bound is seconds of the line at its measured rate, in wire bytes; queued work is KV
    bytes, which a coded line sends in fewer: the drop must convert, or it drops too much."""
    from pdd_sglang.prefill.events import CacheOnly

    kv = Kv()
    fanout = make_fanout(kv)
    fanout.cache_only_backlog_s = 10.0
    for room in (41, 43):  # two rooms on the same main line, 1600 KV bytes each
        _room_with_relay_done(kv, fanout, room)
        fanout.handle(CacheOnly(room))
    fanout.wan_line.coded(MAIN, 2000, 1000)  # the line's copies code 2:1: 800 wire bytes a room
    fanout.wan_line._main(MAIN).recent.append((100, 1.0))  # 100 wire B/s: keep 1000 wire bytes
    fanout.tick()  # 1600 wire bytes ahead: dropping the newest leaves 800, within the bound
    assert fanout.published["cache_only_dropped"] == 1
    assert fanout.wan_line.snapshot()[MAIN]["dropped_cache_only_bytes"] == 800  # wire bytes
    assert [m[1:] for m in kv.messages if m[2] == "Failed"] == [(43, "Failed")]
