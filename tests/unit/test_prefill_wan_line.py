"""Prefill's WAN line counters (bytes queued and in flight per main, recent throughput), and the
WAN engine's asynchronous copies on a real pair of Mooncake TCP engines."""

import threading
import time

import numpy as np
import pytest

from pdd_sglang.prefill.wan_line import WanLine
from pdd_sglang.prefill.wan_lines import CopyClass, WanLines

LINE_BYTES_PER_S = 10e9 / 8  # the declared line, where a test does not depend on it


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def _work(room, session="main-a", cancelled=False):
    from pdd_sglang.prefill.room import Work

    return Work(room, session, "main", None, None, cancelled=cancelled)


def test_bytes_are_queued_then_in_flight_then_gone():
    lines = WanLines(LINE_BYTES_PER_S)
    line = WanLine(Clock())
    line.queue_view = lines.queued_by_class
    lines.put(_work(1), 500, 5, CopyClass.NEEDED_NOW)
    lines.put(_work(2, "main-b"), 300, 3, CopyClass.NEEDED_NOW)
    assert line.snapshot()["main-a"]["bytes_ahead"] == 500
    work = lines.take()
    assert work.room in (1, 2)
    work = work if work.room == 1 else lines.take()
    work.pages_done = 5  # the sender handed every page to Mooncake
    assert line.snapshot()["main-a"]["queued_bytes"] == 0
    started = line.started("main-a", 500)
    assert line.snapshot()["main-a"]["in_flight_bytes"] == 500
    line.finished("main-a", 500, started, ok=True)
    lines.release(work)
    snap = line.snapshot()["main-a"]
    assert (snap["in_flight_bytes"], snap["bytes_ahead"], snap["sent_bytes"]) == (0, 0, 500)


def test_a_line_serves_needed_now_first_then_the_least_left_when_queued_together_and_one_sender_at_a_time():
    lines = WanLines(1e3, Clock())  # a slow line: bytes outweigh the queueing order
    lines.put(_work(1), 8000, 8, CopyClass.CACHE_ONLY)
    lines.put(_work(2), 900, 9, CopyClass.NEEDED_NOW)
    lines.put(_work(3), 400, 4, CopyClass.NEEDED_NOW)
    lines.put(_work(4, "main-b"), 100, 1, CopyClass.CACHE_ONLY)
    first, second = lines.take(), lines.take()
    assert (first.room, second.room) == (3, 4)  # main-a's line is held: main-b's goes meanwhile
    lines.release(first)
    assert lines.take().room == 2
    assert lines.should_yield(second) is False  # nothing needed-now waits on main-b


def test_a_copy_is_a_rooms_chunks_served_together_the_smaller_then_the_first_queued():
    """Chunked prefill queues a copy chunk by chunk: ranking the chunks alone interleaved two
    copies (1a, 2a, 1b, 2b), so both landed as late as the last chunk. A room's deadline is
    its first chunk's, for all its chunks' bytes."""
    clock = Clock()
    lines = WanLines(1e3, clock)  # a slow line: bytes outweigh the queueing order
    for room, chunk in ((1, "a"), (2, "a"), (1, "b"), (2, "b")):
        work = _work(room)
        work.chunk = chunk
        clock.now += 0.001
        lines.put(work, 1000, 1, CopyClass.NEEDED_NOW)
    order = []
    for _ in range(4):
        work = lines.take()
        order.append((work.room, work.chunk))
        lines.release(work)
    assert order == [(1, "a"), (1, "b"), (2, "a"), (2, "b")]
    # The smaller copy goes first, though queued later.
    lines.put(_work(3), 3000, 3, CopyClass.NEEDED_NOW)
    lines.put(_work(4), 1000, 1, CopyClass.NEEDED_NOW)
    lines.put(_work(3), 1000, 1, CopyClass.NEEDED_NOW)
    assert lines.take().room == 4


def test_a_copy_about_as_large_passes_one_queued_before_it_only_within_its_deadline():
    """Least-left alone starved a relay death's first request: its 764-page copy (6.3 MB) waited
    30 s while nine 700-page copies (5.7 MB, one every 2.3 s) queued after it went first, until
    main gave up on it (the quick fault suite at 20 Mbit/s). A deadline (first queued plus twice
    its time alone) lets only the copy that came 0.2 s later pass; the next, 2.5 s later, is due
    after it. A cache-only copy waits behind both."""
    clock = Clock()
    lines = WanLines(20e6 / 8, clock)
    lines.put(_work(1), 6_300_000, 764, CopyClass.NEEDED_NOW)
    lines.put(_work(90), 9_000_000, 900, CopyClass.CACHE_ONLY)
    taken = []
    clock.now += 0.2
    for room in (2, 3, 4):  # a steady stream of smaller needed-now copies, one per copy sent
        lines.put(_work(room), 5_700_000, 700, CopyClass.NEEDED_NOW)
        work = lines.take()
        taken.append(work.room)
        clock.now += 2.3
        lines.release(work)
    assert taken == [2, 1, 3]
    assert [lines.take().room for _ in range(1)] == [4]


def test_a_needed_now_copy_overtakes_a_cache_only_one_between_its_slices():
    lines = WanLines(LINE_BYTES_PER_S)
    lines.put(_work(1), 8000, 8, CopyClass.CACHE_ONLY)
    cache_only = lines.take()
    assert not lines.should_yield(cache_only)
    lines.put(_work(2), 100, 1, CopyClass.NEEDED_NOW)
    assert lines.should_yield(cache_only)
    cache_only.pages_done = 3
    lines.put_back(cache_only)
    assert lines.take().room == 2
    assert lines.queued_by_class()["main-a"] == {"needed_now": 100, "cache_only": 5000,
                                                 "relay_covered": 0}


def test_a_yielding_copy_hands_the_line_over_before_its_window_lands_and_returns_only_then():
    """The overtaking copy starts beside the window the yielding one still has in flight: it
    used to wait for that window to land and be acknowledged (0.14-0.23 s of a P->MD copy's
    wait in the demo's idle-line setup). The yielding copy cannot be taken again, and its line
    stays, until its sender puts it back or releases it."""
    lines = WanLines(LINE_BYTES_PER_S, clock=Clock())
    lines.put(_work(1), 8000, 8, CopyClass.CACHE_ONLY)
    cache_only = lines.take()
    lines.put(_work(2), 100, 1, CopyClass.NEEDED_NOW)
    assert lines.should_yield(cache_only)
    cache_only.pages_done = 3
    lines.hand_over(cache_only)  # its window of 3 pages is still in flight
    needed_now = lines.take()  # no wait: the line is free
    assert needed_now.room == 2
    assert lines.queued_by_class()["main-a"] == {"needed_now": 100, "cache_only": 5000,
                                                 "relay_covered": 0}
    lines.release(needed_now)
    assert "main-a" in lines.queued_by_class()  # the draining copy keeps its line
    lines.put(_work(3), 10**6, 1, CopyClass.CACHE_ONLY)  # due after room 1
    later = lines.take()
    assert later.room == 3  # a draining copy is not taken again, though it ranks first
    lines.release(later)
    lines.put_back(cache_only)  # its window landed
    assert lines.take() is cache_only
    lines.release(cache_only)
    assert lines.queued_by_class() == {}


def test_a_copy_whose_window_failed_while_draining_releases_its_line():
    lines = WanLines(LINE_BYTES_PER_S)
    lines.put(_work(1), 8000, 8, CopyClass.CACHE_ONLY)
    cache_only = lines.take()
    lines.put(_work(2), 100, 1, CopyClass.NEEDED_NOW)
    lines.hand_over(cache_only)
    lines.release(cache_only)  # a block of its window failed: its sender reports it
    needed_now = lines.take()
    lines.release(needed_now)
    assert lines.queued_by_class() == {}


def test_a_smaller_needed_now_copy_takes_the_line_from_a_needed_now_one_until_its_deadline():
    """A P->MD request's 60-token copy waited 7.1 s behind a document's 9.9 MB copy for a
    handoff (the demo's idle-line setup): within needed-now the holder kept the line to its end.
    Then it yielded to a copy of less left at most twice, and a 46-token copy waited 5.05 s
    behind a document two smaller ones had passed (fresh clone of 4d20877). Now it yields
    between slices to every copy due before it (the document is due twice its 11.9 s alone after
    it was queued, however much it has sent: a deadline from its bytes left kept the line from a
    46-token copy 5 s into the document's copy, fresh clone of 74d4114), and to none queued
    after that; its own room's next chunk and a larger copy never take it."""
    clock = Clock()
    lines = WanLines(10e6 / 8, clock)
    lines.put(_work(1), 9_900_000, 1210, CopyClass.NEEDED_NOW)
    document = lines.take()
    clock.now += 0.1
    same_room = _work(1)
    lines.put(same_room, 5_000_000, 600, CopyClass.NEEDED_NOW)
    assert not lines.should_yield(document)     # its own next chunk
    lines.put(_work(2), 30_000_000, 3600, CopyClass.NEEDED_NOW)
    assert not lines.should_yield(document)     # due long after the document's copy
    for room in (3, 4, 5, 6):                   # four P->MD copies, one a second
        clock.now += 1.0
        lines.put(_work(room), 490_000, 60, CopyClass.NEEDED_NOW)
        assert lines.should_yield(document)
        document.pages_done += 50
        lines.put_back(document)
        small = lines.take()
        assert small.room == room
        lines.release(small)
        document = lines.take()
        assert document.room == 1 and document.pages_done == 50 * (room - 2)
    clock.now = 112.0
    document.pages_done = 1100                  # most of it sent: still due at 123.84
    lines.put(_work(8), 490_000, 60, CopyClass.NEEDED_NOW)
    assert lines.should_yield(document)
    lines.put_back(document)
    small = lines.take()
    assert small.room == 8
    lines.release(small)
    document = lines.take()
    assert document.room == 1 and document.pages_done == 1100
    clock.now = 100.0 + 2 * 14_900_000 / (10e6 / 8)  # past the copy's deadline (both chunks)
    lines.put(_work(7), 490_000, 60, CopyClass.NEEDED_NOW)
    assert not lines.should_yield(document)     # queued after the document was due


def test_a_relay_that_finished_makes_its_rooms_copy_cache_only_queued_or_being_written():
    lines = WanLines(LINE_BYTES_PER_S)
    lines.put(_work(7), 1000, 10, CopyClass.NEEDED_NOW)
    lines.put(_work(7), 1000, 10, CopyClass.NEEDED_NOW)
    held = lines.take()
    assert lines.reclassify(7, CopyClass.CACHE_ONLY) == 2
    assert held.copy_class is CopyClass.CACHE_ONLY
    assert lines.queued_by_class()["main-a"] == {"needed_now": 0, "cache_only": 2000,
                                                 "relay_covered": 0}


def test_a_first_token_copy_is_reported_behind_first_token_bytes_and_the_window_in_flight():
    """A P->MD copy goes before a relay-covered one (policy.copy_tier): the router, placing a
    request P->MD, predicts its copy behind ``first_token_bytes_ahead`` (first-token bytes
    queued, and whatever is in flight), not behind the handoffs' copies queued."""
    lines = WanLines(LINE_BYTES_PER_S)
    covered = _work(1)
    covered.relay_covered = True
    lines.put(covered, 4000, 4, CopyClass.NEEDED_NOW)
    lines.put(_work(2), 300, 1, CopyClass.NEEDED_NOW)
    lines.put(_work(3), 500, 1, CopyClass.CACHE_ONLY)
    assert lines.queued_by_class()["main-a"] == {"needed_now": 4300, "cache_only": 500,
                                                 "relay_covered": 4000}
    line = WanLine()
    line.queue_view = lines.queued_by_class
    line.started("main-a", 200)
    row = line.snapshot()["main-a"]
    assert row["first_token_bytes_ahead"] == 300 + 200
    assert row["needed_now_bytes_ahead"] == 4300 + 200
    assert row["bytes_ahead"] == 4800 + 200
    assert lines.uncover(1) == 1  # its relay failed: the room's copy is first-token again
    assert line.snapshot()["main-a"]["first_token_bytes_ahead"] == 4300 + 200


def test_a_copy_with_no_relay_answering_goes_before_a_relay_covered_one_due_first():
    """A P->MD request's 26-token copy waited behind a handoff's 74-token copy queued 1.6 s
    before it and due first (the demo's idle-line setup, fresh clone of c88dcdc): the handoff's
    request had its tokens from the relay, the P->MD one had none."""
    clock = Clock()
    lines = WanLines(LINE_BYTES_PER_S, clock)
    handoff = _work(21)
    handoff.relay_covered = True
    lines.put(handoff, 600_000, 74, CopyClass.NEEDED_NOW)
    assert lines.take() is handoff
    clock.now += 1.6
    lines.put(_work(22), 200_000, 26, CopyClass.NEEDED_NOW)
    assert lines.should_yield(handoff)  # though due first, it gives the line up at its next slice
    lines.put_back(handoff)
    lines.put(_work(23), 100, 1, CopyClass.CACHE_ONLY)  # smaller, due first, but cache-only
    p_md = lines.take()
    assert p_md.room == 22
    lines.release(p_md)
    assert [lines.take().room for _ in range(1)] == [21]  # the relay-covered one, then 23


def test_a_relay_that_failed_uncovers_its_rooms_copy_queued_or_being_written():
    lines = WanLines(LINE_BYTES_PER_S)
    for room in (7, 7, 8):
        work = _work(room)
        work.relay_covered = True
        lines.put(work, 1000, 10, CopyClass.NEEDED_NOW)
    held = lines.take()
    assert held.room == 7 and lines.uncover(7) == 2
    assert not held.relay_covered
    assert [w.relay_covered for w in lines._lines["main-a"].queued] == [False, True]


def test_cancelled_work_counts_no_bytes_ahead_though_it_waits_for_a_sender():
    """Issue 34's hazard: cancelled work stayed counted as queued until a sender popped it, so
    /pdd/line over-reported what was ahead of a new copy."""
    lines = WanLines(LINE_BYTES_PER_S)
    line = WanLine(Clock())
    line.queue_view = lines.queued_by_class
    live, dead = _work(1), _work(2)
    lines.put(live, 300, 3, CopyClass.NEEDED_NOW)
    lines.put(dead, 5000, 5, CopyClass.NEEDED_NOW)
    dead.cancelled = True
    assert line.snapshot()["main-a"]["bytes_ahead"] == 300
    assert lines.take() is dead  # skipped first: its room's conclusion waits for its report


def test_past_the_backlog_bound_the_newest_cache_only_copies_are_dropped():
    lines = WanLines(LINE_BYTES_PER_S)
    for room, cls in ((1, CopyClass.NEEDED_NOW), (2, CopyClass.CACHE_ONLY),
                      (3, CopyClass.CACHE_ONLY), (4, CopyClass.NEEDED_NOW)):
        lines.put(_work(room), 1000, 10, cls)
    dropped = lines.drop_cache_only("main-a", keep_bytes=2500)
    assert [w.room for w in dropped] == [3, 2]  # needed-now bytes are never dropped
    assert lines.drop_cache_only("main-a", keep_bytes=3500) == [_work_of(lines, 3)]


def _work_of(lines, room):
    return next(w for w in lines._lines["main-a"].queued if w.room == room)


def test_stopped_lines_wake_every_sender():
    lines = WanLines(LINE_BYTES_PER_S)
    got = []
    sender = threading.Thread(target=lambda: got.append(lines.take()))
    sender.start()
    lines.stop()
    sender.join(5)
    assert got == [None]


def test_throughput_counts_overlapping_copies_once_and_ignores_idle_gaps():
    clock = Clock()
    line = WanLine(clock)
    assert line.snapshot() == {}
    a = line.started("m", 1000)
    b = line.started("m", 1000)  # both on the line from t=100
    clock.now = 101.0
    line.finished("m", 1000, a, ok=True)
    clock.now = 102.0
    line.finished("m", 1000, b, ok=True)
    clock.now = 200.0  # an idle gap, then one more copy of 1 s
    c = line.started("m", 500)
    clock.now = 201.0
    line.finished("m", 500, c, ok=True)
    assert line.snapshot()["m"]["recent_bytes_per_s"] == pytest.approx(2500 / 3.0)


def test_a_failed_copy_is_not_throughput():
    clock = Clock()
    line = WanLine(clock)
    s = line.started("m", 1000)
    clock.now += 5
    line.finished("m", 1000, s, ok=False)
    snap = line.snapshot()["m"]
    assert snap["recent_bytes_per_s"] is None and snap["failed_batches"] == 1
    assert snap["in_flight_bytes"] == 0


# ---- the real engine: two Mooncake TCP engines in this process ----------------------------------
def _engine_pair(timeout_s=30.0):
    from mooncake.engine import TransferEngine

    from pdd_sglang.prefill.wan_engine import WanTransferEngine

    sender = WanTransferEngine("127.0.0.1", "tcp", None, timeout_s)
    receiver = TransferEngine()
    assert receiver.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    return sender, receiver


def test_an_asynchronous_wan_copy_lands_every_block_and_counts_on_the_line():
    sender, receiver = _engine_pair()
    size = 4 << 20
    src = np.arange(size, dtype=np.uint8)
    dst = np.zeros(size, dtype=np.uint8)
    sender.register_regions([(src.ctypes.data, size)])
    assert receiver.register_memory(dst.ctypes.data, size) == 0
    session = f"127.0.0.1:{receiver.get_rpc_port()}"
    blocks = 16
    step = size // blocks
    offsets = [i * step for i in range(blocks)]
    results = []
    worker = threading.Thread(target=lambda: results.append(sender.batch_transfer_sync(
        session, [src.ctypes.data + o for o in offsets], [dst.ctypes.data + o for o in offsets],
        [step] * blocks)))
    worker.start()
    worker.join(60)
    assert results == [0]
    assert np.array_equal(src, dst)
    snap = sender.line.snapshot()[session]
    assert (snap["sent_bytes"], snap["in_flight_bytes"]) == (size, 0)
    assert snap["recent_bytes_per_s"] > 0
    sender.close()


def test_the_relays_copies_go_through_sglangs_engine_waited_on_without_its_spinning_call(
        monkeypatch):
    """A relay's copy spinning in Mooncake's synchronous call took 0.2-0.8 CPU-seconds of the
    prefill's 0.5-core quota per demo setup. The relays' path now submits to SGLang's own
    engine and polls with a back-off, as the WAN path does; its timeout is Mooncake's."""
    from types import SimpleNamespace

    from mooncake.engine import TransferEngine

    from pdd_sglang.prefill.fanout import PrefillFanout
    from pdd_sglang.prefill.wan_engine import polled_local_engine

    class NoSpinning:
        """SGLang's Mooncake engine, but its synchronous call fails the test."""

        def __init__(self, engine):
            self._engine = engine

        def batch_transfer_sync_write(self, *args):
            pytest.fail("the relay path spun in Mooncake's synchronous call")

        def __getattr__(self, name):
            return getattr(self._engine, name)

    raw, receiver = TransferEngine(), TransferEngine()
    assert raw.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert receiver.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    size = 1 << 20
    src, dst = np.arange(size, dtype=np.uint8), np.zeros(size, dtype=np.uint8)
    assert raw.register_memory(src.ctypes.data, size) == 0  # as SGLang registers its KV
    assert receiver.register_memory(dst.ctypes.data, size) == 0
    sglang_engine = SimpleNamespace(engine=NoSpinning(raw), get_session_id=lambda: "prefill:1")
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "7")
    local = polled_local_engine(SimpleNamespace(engine=sglang_engine))
    assert (local.timeout_s, local.session_id) == (7.0, "prefill:1")
    relay = f"127.0.0.1:{receiver.get_rpc_port()}"
    half = size // 2
    assert local.batch_transfer_sync(relay, [src.ctypes.data, src.ctypes.data + half],
                                     [dst.ctypes.data, dst.ctypes.data + half], [half, half]) == 0
    assert np.array_equal(src, dst)
    fanout = PrefillFanout(SimpleNamespace(engine=sglang_engine), wan_line_bytes_per_s=1e6)
    fanout.wan_engine, fanout.local_engine = object(), local
    fanout.main_sessions.add("main:1")
    assert fanout.engine_for(relay) is local and fanout.engine_for("main:1") is fanout.wan_engine
    local.close()  # registered nothing of its own: SGLang's registration stays
    assert raw.unregister_memory(src.ctypes.data) == 0


def test_a_copy_to_a_session_nobody_serves_fails_without_hanging():
    sender, _ = _engine_pair(timeout_s=5.0)
    buf = np.zeros(4096, dtype=np.uint8)
    sender.register_regions([(buf.ctypes.data, buf.nbytes)])
    assert sender.batch_transfer_sync("127.0.0.1:1", [buf.ctypes.data], [0], [4096]) == -1
    assert sender.line.snapshot()["127.0.0.1:1"]["failed_batches"] == 1
    sender.close()


def test_the_timeout_is_the_engines_own_and_must_be_positive():
    from pdd_sglang.prefill.wan_engine import WanTransferEngine

    with pytest.raises(ValueError, match="timeout"):
        WanTransferEngine("127.0.0.1", "tcp", None, 0)


def test_a_copy_on_the_line_gives_up_when_the_engine_stops_waiting():
    """Shutdown must not wait out a multi-second WAN copy: the waiting worker returns -1."""
    from pdd_sglang.prefill.wan_engine import WanTransferEngine

    stalled = type("Stalled", (), {"transfer_submit_write": lambda self, *a: 7,
                                   "transfer_check_status": lambda self, b: 0})()
    sender = WanTransferEngine.over(stalled, timeout_s=60.0)  # no Mooncake: a scripted engine
    results = []
    worker = threading.Thread(target=lambda: results.append(
        sender.batch_transfer_sync("main", [1], [2], [3])))
    worker.start()
    sender.stop_waiting()
    worker.join(10)
    assert results == [-1] and not worker.is_alive()
    assert sender.abandoned_batches() == [7]  # Mooncake still owns the batch: never freed under it



def scripted_sender(statuses: dict, timeout_s: float):
    """A WanTransferEngine over a scripted Mooncake: ``statuses[batch](seconds since the copy
    began)`` is the batch's status at a poll; every poll is recorded."""
    from pdd_sglang.prefill.wan_engine import WanTransferEngine

    polls, began = [], []
    batches = iter(sorted(statuses))

    def submit(_engine, *args):
        began.append(time.monotonic())
        return next(batches)

    def check(_engine, batch):
        polls.append(batch)
        return statuses[batch](time.monotonic() - began[0])

    scripted = type("Scripted", (), {"transfer_submit_write": submit,
                                     "transfer_check_status": check})()
    return WanTransferEngine.over(scripted, timeout_s), polls


def test_a_timed_out_copy_fails_only_once_mooncake_has_ended_its_blocks():
    """The chaos soak's KV digest mismatch: a copy slow on a congested line failed at the timeout,
    main freed the room's pages on that word, and the copy's blocks, still in Mooncake, wrote on
    into pages main had given to the next request. Now the failure waits (up to another timeout)
    until Mooncake has ended the blocks; before, it returned at the timeout with them pending."""
    timeout_s = 0.2
    ends_late = {7: lambda t: 1 if t > 1.5 * timeout_s else 0,  # done after the timeout
                 8: lambda t: -1 if t > 1.6 * timeout_s else 0}  # failed after it
    sender, polls = scripted_sender(ends_late, timeout_s)
    began = time.monotonic()
    assert sender.batch_transfer_sync("main", [1, 2], [3, 4], [5, 6]) == -1
    assert time.monotonic() - began >= 1.6 * timeout_s  # returned only once both had ended
    assert polls[-1] == 8 and sender.abandoned_batches() == []  # nothing left in Mooncake's hands

    # A block that never ends is abandoned after the second timeout (Mooncake still owns it).
    sender, _ = scripted_sender({9: lambda t: 0}, 0.01)
    assert sender.batch_transfer_sync("main", [1], [2], [3]) == -1
    assert sender.abandoned_batches() == [9]


def test_a_failed_block_waits_for_the_other_blocks_of_its_copy():
    sender, polls = scripted_sender({1: lambda t: -1, 2: lambda t: 1 if t > 0.1 else 0}, 60.0)
    assert sender.batch_transfer_sync("main", [1, 2], [3, 4], [5, 6]) == -1
    assert polls[0] == 1 and polls[-1] == 2 and len(polls) > 2 and sender.abandoned_batches() == []


# ---- the window: a copy keeps bytes in flight across slices (issue 34) -------------------------
def test_slices_are_four_bdps_of_the_declared_line_and_the_window_twelve_more_or_the_flag():
    from pdd_sglang.prefill.wan_engine import (MAX_SLICE_BYTES, MIN_SLICE_BYTES, ONE_SLICE,
                                               CopyWindow, window_for_line)

    # The brief's line: 25 MB BDP, slices of four (capped), twelve BDPs more in flight, and
    # Mooncake requests of half a BDP where a copy can choose them (packed records).
    assert window_for_line(10, 20) == CopyWindow(MAX_SLICE_BYTES, 300_000_000 + MAX_SLICE_BYTES,
                                                 12_500_000)
    assert window_for_line(1, 20) == CopyWindow(10_000_000, 40_000_000, 1_250_000)  # 2.5 MB BDP
    slow = window_for_line(0.02, 40)  # the demo's line: 100 KB BDP
    assert slow == CopyWindow(400_000, 1_600_000, 50_000)
    assert window_for_line(400, 20).block_bytes == 32 << 20  # MAX_BLOCK_BYTES
    assert window_for_line(0.002, 40).slice_bytes == MIN_SLICE_BYTES  # 10 KB BDP
    assert window_for_line(100, 100).slice_bytes == MAX_SLICE_BYTES
    assert window_for_line(10, 20, window_mb=4) == ONE_SLICE  # the old one-slice rule
    with pytest.raises(ValueError, match="positive"):
        window_for_line(0, 20)


def test_a_background_copy_keeps_a_tenth_of_a_second_of_the_declared_line_in_flight():
    """A needed-now copy that takes the line from a background one (cache-only, or a handoff's
    while its relay answers) waits for what it has in flight: the product's 862 KB window is
    0.69 s of the demo's line, and the idle-line setup's P->MD copies over 1.5x alone waited
    about that long behind a document's or a handoff's copy."""
    from pdd_sglang.policy.wan_order import BACKGROUND_IN_FLIGHT_S
    from pdd_sglang.prefill.wan_engine import CopyWindow, background_window, window_for_line

    assert BACKGROUND_IN_FLIGHT_S == 0.1
    demo = window_for_line(0.01, 40)  # 10 Mbit/s x 40 ms: a 50 KB BDP
    assert demo == CopyWindow(262_144, 862_144, 25_000)
    assert background_window(demo, 1.25e6) == CopyWindow(41_666, 125_000, 25_000)
    brief = window_for_line(10, 20)  # 10 Gbit/s x 20 ms: 16 round trips in flight, 5 background
    assert background_window(brief, 1.25e9) == CopyWindow(41_666_666, 125_000_000, 12_500_000)
    small = CopyWindow(4096, 8192, 512)  # already under the bound: kept
    assert background_window(small, 1.25e6) is small
    with pytest.raises(ValueError, match="positive"):
        background_window(demo, 0)


def test_a_copy_that_turns_background_lands_down_to_the_smaller_window_before_its_next_slice():
    from pdd_sglang.prefill.wan_engine import CopyWindow

    wan, events = _windowed(window_bytes=300, done_after_polls=2)
    wan.background_window = CopyWindow(50, 100, 50)
    with wan.copy("main") as copy:
        for _ in range(3):  # needed-now: three slices of two 50-byte blocks, all in flight
            assert copy.window_for_next_slice(background=False).window_bytes == 300
            assert wan.batch_transfer_sync("main", [1, 2], [3, 4], [50, 50]) == 0
        assert copy.in_flight_bytes == 300 and not [e for e in events if e[0] == "poll"]
        # its relay finished: the next slice goes out once no more than its window is in flight
        assert copy.window_for_next_slice(background=True).slice_bytes == 50
        assert wan.batch_transfer_sync("main", [1], [2], [50]) == 0
        before = events[:events.index(("submit", 7))]
        assert {e[1] for e in before if e[0] == "poll"} == {1, 2, 3, 4, 5}
        assert copy.in_flight_bytes == 100
        assert copy.finish()
    assert wan.line.snapshot()["main"]["sent_bytes"] == 350


def _windowed(window_bytes, done_after_polls):
    """A scripted Mooncake whose block N reports done on its ``done_after_polls``-th poll;
    records the order of submissions and polls."""
    from pdd_sglang.prefill.wan_engine import WanTransferEngine

    events, polls = [], {}
    counter = iter(range(1, 10_000))

    def submit(_engine, session, src, dst, length):
        batch = next(counter)
        events.append(("submit", batch))
        return batch

    def check(_engine, batch):
        polls[batch] = polls.get(batch, 0) + 1
        events.append(("poll", batch))
        return 1 if polls[batch] >= done_after_polls else 0

    scripted = type("Scripted", (), {"transfer_submit_write": submit,
                                     "transfer_check_status": check})()
    return WanTransferEngine.over(scripted, 60.0, window_bytes=window_bytes), events


def test_inside_a_copy_slices_go_out_without_waiting_while_they_fit_in_the_window():
    wan, events = _windowed(window_bytes=300, done_after_polls=2)
    with wan.copy("main") as copy:
        for _ in range(3):  # three slices of two 50-byte blocks: 300 bytes, all fit
            assert wan.batch_transfer_sync("main", [1, 2], [3, 4], [50, 50]) == 0
        assert [e for e in events if e[0] == "poll"] == []  # nothing waited for yet
        assert copy.in_flight_bytes == 300
        assert copy.finish()
    assert wan.line.snapshot()["main"]["sent_bytes"] == 300


def test_a_window_of_one_slice_waits_for_each_slice_before_the_next():
    """The old rule is this sender with a window of one slice: slice 2 goes out only once every
    block of slice 1 has landed."""
    wan, events = _windowed(window_bytes=100, done_after_polls=2)
    with wan.copy("main") as copy:
        assert wan.batch_transfer_sync("main", [1, 2], [3, 4], [50, 50]) == 0
        assert wan.batch_transfer_sync("main", [1, 2], [3, 4], [50, 50]) == 0
        assert copy.finish()
    second_submit = events.index(("submit", 3))
    assert ("poll", 1) in events[:second_submit] and ("poll", 2) in events[:second_submit]
    assert events[:second_submit].count(("poll", 2)) == 2  # block 2 reported done first


def test_a_copy_left_early_waits_out_its_blocks_in_flight():
    """A cancelled copy (the sender leaves the copy before finish) must not return while a block
    could still land: main frees the room's pages on the sender's word."""
    wan, events = _windowed(window_bytes=1000, done_after_polls=3)
    with wan.copy("main") as copy:
        assert wan.batch_transfer_sync("main", [1], [2], [50]) == 0
    assert copy.in_flight_bytes == 0 and events[-1] == ("poll", 1)
    assert wan.line.snapshot()["main"]["in_flight_bytes"] == 0


def test_a_call_outside_a_copy_or_for_another_session_waits_for_its_own_blocks():
    wan, events = _windowed(window_bytes=1000, done_after_polls=2)
    with wan.copy("main"):
        assert wan.batch_transfer_sync("other", [1], [2], [50]) == 0  # aux to another main
        assert events[-1] == ("poll", 1)  # waited for before it returned


def test_a_batch_of_thousands_of_blocks_lands_with_the_prefills_mooncake_queue(monkeypatch):
    """A fragmented relay pool (page size 1, long answers) gets SGLang's chunk as one batch of
    thousands of blocks; Mooncake's TCP transport queues 1,024 a lane by default and failed the
    whole batch (a 10-minute chaos soak lost 116 of 232 answers to it). The prefill sets
    MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER; an engine made after it takes such a batch."""
    from mooncake.engine import TransferEngine

    from pdd_sglang.server_args import MOONCAKE_TCP_QUEUE_ENV

    monkeypatch.setenv(*MOONCAKE_TCP_QUEUE_ENV)
    sender, receiver = TransferEngine(), TransferEngine()
    for engine in (sender, receiver):
        assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    blocks, size = 6000, 64
    src = np.arange(blocks * size, dtype=np.uint8)
    dst = np.zeros(blocks * size, dtype=np.uint8)
    assert sender.register_memory(src.ctypes.data, src.nbytes) == 0
    assert receiver.register_memory(dst.ctypes.data, dst.nbytes) == 0
    offsets = [i * size for i in range(blocks)]
    assert sender.batch_transfer_sync_write(
        f"127.0.0.1:{receiver.get_rpc_port()}", [src.ctypes.data + o for o in offsets],
        [dst.ctypes.data + o for o in offsets], [size] * blocks) == 0
    assert np.array_equal(src, dst)


def test_a_coded_line_reports_its_ratio_and_its_queue_in_wire_bytes():
    """Issue 36: coded records count their wire bytes in flight and sent (the engine's blocks);
    the line reports KV bytes per wire byte, and queued KV at that ratio."""
    line = WanLine()
    assert WanLine().snapshot() == {}
    line.queue_view = lambda: {"m": {"needed_now": 1200, "cache_only": 0}}
    assert line.snapshot()["m"]["kv_codec_ratio"] == 1.0
    assert line.snapshot()["m"]["needed_now_bytes_ahead"] == 1200
    assert line.snapshot()["m"]["first_token_bytes_ahead"] == 1200  # no tier split: all of it
    line.coded("m", 3000, 2500)
    row = line.snapshot()["m"]
    assert row["kv_codec_ratio"] == pytest.approx(1.2)
    assert (row["coded_kv_bytes"], row["coded_wire_bytes"]) == (3000, 2500)
    assert row["needed_now_bytes_ahead"] == 1000  # 1200 B of KV, 1000 on the wire
