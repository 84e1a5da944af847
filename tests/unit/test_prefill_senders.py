"""The prefill's PDD senders: a copy to a main goes out in bounded batches, so a copy nobody wants
any more stops holding the WAN line at the next batch, not at the end of its chunk."""

import pytest

import pdd_sglang.hooks as hooks
from fanout_harness import LINE_BYTES_PER_S, MAIN, RELAY, Kv, chunk, drain, make_fanout, register
from pdd_sglang.prefill import senders
from pdd_sglang.prefill.events import ChunkSent

PAGE_BYTES = 200  # the harness's kv_item_lens, summed


@pytest.fixture(autouse=True)
def prefill_role(monkeypatch):
    monkeypatch.setattr(hooks, "_role", "prefill")


def _room_of_ten_pages(kv, fanout, room):
    from sglang.srt.disaggregation.base.conn import KVPoll

    kv.update_status(room, KVPoll.Bootstrapping)
    register(fanout, kv, room, RELAY, "relay")
    register(fanout, kv, room, MAIN, "main")
    fanout.take_chunk(chunk(room, 0, 10, last=True))
    drain(fanout)
    return fanout.local_queues[room % 2].pop(0), fanout.wan_lines.pop(0)


def test_a_copy_to_main_goes_out_in_batches_of_the_slice_and_a_relays_in_one():
    kv = Kv()
    fanout = make_fanout(kv)
    fanout.wan_engine.slice_bytes = 4 * PAGE_BYTES
    to_relay, to_main = _room_of_ten_pages(kv, fanout, 40)
    assert senders.send_work(kv, to_relay, None) == (True, None)
    assert senders.send_work(kv, to_main, None) == (True, None)
    assert kv.sent_kv == [(RELAY, 0, 10), (MAIN, 0, 4), (MAIN, 4, 4), (MAIN, 8, 2)]


def test_a_copy_to_main_aborted_while_it_is_written_stops_at_the_next_batch():
    """Failed before: the whole chunk went out after main had aborted (one batch of 10 pages),
    holding the line for a copy nobody reads; its ABORT's ack waited for all of it."""
    kv = Kv()
    fanout = make_fanout(kv)
    fanout.wan_engine.slice_bytes = 4 * PAGE_BYTES
    to_relay, to_main = _room_of_ten_pages(kv, fanout, 41)
    sglang_send = kv.send_kvcache

    def send_while_main_aborts(session, src, *args, **kwargs):
        result = sglang_send(session, src, *args, **kwargs)
        if len(kv.sent_kv) == 1:  # main's ABORT arrives during the first batch
            kv.handle_abort(41, MAIN)
            drain(fanout)  # the owner cancels main's work
        return result

    kv.send_kvcache = send_while_main_aborts
    assert senders.send_work(kv, to_main, None) == (None, None)
    assert kv.sent_kv == [(MAIN, 0, 4)]
    assert kv.abort_acks == []  # the write in progress had not reported yet
    fanout.handle(ChunkSent(to_main, None, None))
    assert kv.abort_acks == [(41, "127.0.0.1", 2002, 1)]
    kv.send_kvcache = sglang_send
    fanout.handle(ChunkSent(to_relay, *senders.send_work(kv, to_relay, None)))
    assert fanout.published["destinations_aborted"] == 1


def _a_needed_now_copy_behind_a_cache_only_one(room):
    """A cache-only copy of ``room`` taken by a sender, and a needed-now one of ``room + 1``
    queued behind it on the same line: (kv, fanout, lines, cache_only, needed_now)."""
    from pdd_sglang.prefill.wan_lines import CopyClass, WanLines

    kv = Kv()
    fanout = make_fanout(kv)
    fanout.wan_engine.slice_bytes = 4 * PAGE_BYTES
    lines = WanLines(LINE_BYTES_PER_S)
    _, cache_only = _room_of_ten_pages(kv, fanout, room)
    lines.put(cache_only, 10 * PAGE_BYTES, 10, CopyClass.CACHE_ONLY)
    assert lines.take() is cache_only
    _, needed_now = _room_of_ten_pages(kv, fanout, room + 1)
    lines.put(needed_now, 10 * PAGE_BYTES, 10, CopyClass.NEEDED_NOW)
    return kv, fanout, lines, cache_only, needed_now


def test_a_cache_only_copy_yields_to_a_needed_now_one_at_its_next_slice_and_resumes_there():
    """Issue 34: a copy a request waits for goes before one that only warms main's cache, on the
    wire and not only in the queue."""
    kv, fanout, lines, cache_only, needed_now = _a_needed_now_copy_behind_a_cache_only_one(42)
    assert senders.send_work(kv, cache_only, None, lines) == (senders.YIELDED, None)
    assert [s for s in kv.sent_kv if s[0] == MAIN] == [(MAIN, 0, 4)]  # one slice, then yields
    lines.put_back(cache_only)
    assert lines.take() is needed_now
    assert senders.send_work(kv, needed_now, None, lines) == (True, None)
    lines.release(needed_now)
    assert lines.take() is cache_only
    assert senders.send_work(kv, cache_only, None, lines) == (True, None)
    assert [s for s in kv.sent_kv if s[0] == MAIN] == [
        (MAIN, 0, 4), (MAIN, 0, 4), (MAIN, 4, 4), (MAIN, 8, 2), (MAIN, 4, 4), (MAIN, 8, 2)]
    line = fanout.wan_line.snapshot()[MAIN]  # /pdd/line's bytes by class, as handed to the line
    assert (line["needed_now_sent_bytes"], line["cache_only_sent_bytes"]) == (
        10 * PAGE_BYTES, 10 * PAGE_BYTES)


def test_a_yielding_copy_frees_its_line_before_it_waits_for_its_window_to_land(monkeypatch):
    """Issue 34: the needed-now copy that overtakes a background one is taken while the yielding
    copy's window is still landing (it used to be taken only after, and after the last block's
    acknowledgement)."""
    import threading

    from pdd_sglang.prefill.wan_engine import WanCopy

    kv, _, lines, cache_only, needed_now = _a_needed_now_copy_behind_a_cache_only_one(44)
    taken_while_landing = []
    finish = WanCopy.finish

    def finish_after_the_other_is_taken(copy):
        taker = threading.Thread(target=lambda: taken_while_landing.append(lines.take()))
        taker.start()
        taker.join(5)
        if taker.is_alive():  # the line was still held: let the taker go
            lines.stop()
            taker.join(5)
        return finish(copy)

    monkeypatch.setattr(WanCopy, "finish", finish_after_the_other_is_taken)
    assert senders.send_work(kv, cache_only, None, lines) == (senders.YIELDED, None)
    assert taken_while_landing == [needed_now]
