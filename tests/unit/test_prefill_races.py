"""Issue #22's races in the prefill fan-out, each with a deterministic test.

On the fan-out of four threads (commit c07d3c0) every test marked "failed before" here had an
``xfail(strict=True)`` twin that reproduced its race; the one-owner fan-out passes them. Where the
rewrite makes a race impossible, the test shows the mechanism is gone (the table is never written
by PDD, or only on the owner's thread), and says why.
"""

import threading

import numpy as np
import pytest

import pdd_sglang.hooks as hooks
from fanout_harness import (LINE_BYTES_PER_S, MAIN, RELAY, Kv, chunk, drain, hello_frames, make_fanout, poll_name,
                            register, send_all)
from pdd_sglang.prefill.events import ChunkSent, ProbeAnswered
from pdd_sglang.prefill.wan_lines import WanLines


@pytest.fixture(autouse=True)
def prefill_role(monkeypatch):
    monkeypatch.setattr(hooks, "_role", "prefill")


def status_name(kv, room):
    status = kv.request_status.get(room)
    return None if status is None else poll_name(status)


def open_room(kv, room):
    """SGLang's sender, created when prefill admits the request: Bootstrapping."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    kv.update_status(room, KVPoll.Bootstrapping)


def test_race1_a_rooms_chunks_for_one_destination_keep_one_queue_and_order():
    """Failed before: SGLang's add_transfer_request sharded by the sum of the destinations'
    ports, so the main registering mid-room moved the last chunk to another queue."""
    kv = Kv()
    fanout = make_fanout(kv, local=2)
    open_room(kv, 5)
    register(fanout, kv, 5, RELAY, "relay")
    kv.add_transfer_request(5, np.arange(0, 8, dtype=np.int32), slice(0, 8), False)
    drain(fanout)
    register(fanout, kv, 5, MAIN, "main")
    kv.add_transfer_request(5, np.arange(8, 16, dtype=np.int32), slice(8, 16), True, aux_index=0)
    drain(fanout)
    assert not any(q.items for q in kv.transfer_queues)  # SGLang's queues never see a PDD room
    relay_queues = [i for i, q in enumerate(fanout.local_queues) if q]
    assert len(relay_queues) == 1
    assert [w.chunk.index_slice.start for w in fanout.wan_lines] == [0, 8]


def test_race1_a_last_chunk_that_lands_first_does_not_conclude_the_room():
    """The relay is told Success, and the room concluded, only once every chunk landed."""
    kv = Kv()
    fanout = make_fanout(kv, local=1)
    open_room(kv, 6)
    register(fanout, kv, 6, RELAY, "relay", destinations=1)
    for c in (chunk(6, 0, 8), chunk(6, 8, 16, last=True)):
        fanout.take_chunk(c)
    drain(fanout)
    first, last = list(fanout.local_queues[0])
    fanout.local_queues[0].clear()
    fanout.handle(ChunkSent(last, True))  # the last chunk reports first
    assert kv.messages == [] and status_name(kv, 6) == "WaitingForInput"
    fanout.handle(ChunkSent(first, True))
    assert status_name(kv, 6) == "Success"
    assert [m[2] for m in kv.messages] == ["Success"]


def test_race1b_replay_and_the_forwarded_last_chunk_reach_main_in_order():
    """Failed before: the bootstrap thread replayed early chunks after releasing the lock, and a
    local worker forwarded the last chunk to main's queue ahead of them. Now the registration and
    the chunk are two events for one thread, in whatever order they were posted."""
    for main_first in (True, False):
        kv = Kv()
        fanout = make_fanout(kv, local=1)
        open_room(kv, 7)
        register(fanout, kv, 7, RELAY, "relay")
        fanout.take_chunk(chunk(7, 0, 8))
        drain(fanout)
        both_posted = threading.Barrier(2)

        def bootstrap():
            if not main_first:
                both_posted.wait()
            register(fanout, kv, 7, MAIN, "main", pump=False)
            if main_first:
                both_posted.wait()

        thread = threading.Thread(target=bootstrap)
        thread.start()
        if main_first:
            both_posted.wait()
        fanout.take_chunk(chunk(7, 8, 16, last=True))
        if not main_first:
            both_posted.wait()
        thread.join(5)
        drain(fanout)
        assert [w.chunk.index_slice.start for w in fanout.wan_lines] == [0, 8], main_first


def test_race2_and_3_pdd_rooms_never_enter_sglangs_destination_table():
    """Failed before: transfer_infos[room] was iterated by workers while the bootstrap thread
    grew it (RuntimeError), and popped by the housekeeping thread between the bootstrap thread's
    insert and its len() (KeyError, a dead bootstrap thread). Now patch 0006 hands the
    registration to the owner before SGLang's insert, and a PDD room is never in the table."""
    kv = Kv()
    fanout = make_fanout(kv)
    fanout.main_bootstrap_timeout_s = 0.0
    open_room(kv, 8)
    register(fanout, kv, 8, RELAY, "relay")
    fanout.take_chunk(chunk(8, 0, 8, last=True))
    drain(fanout)
    send_all(fanout, kv, fanout.local_queues[0])
    fanout.tick(now=fanout.clock() + 1)  # the main is dropped; the relay answers alone
    assert status_name(kv, 8) == "Success"
    register(fanout, kv, 8, MAIN, "main")  # a restarted main, late
    assert kv.messages[-1] == ((("127.0.0.1", 2002),), 8, "Failed")
    assert 8 not in kv.transfer_infos and not [w for w in kv.writes if w[0] == "transfer_infos"]


def test_race3_a_registration_after_the_room_was_forgotten_is_refused():
    kv = Kv()
    fanout = make_fanout(kv)
    open_room(kv, 9)
    register(fanout, kv, 9, RELAY, "relay", destinations=1)
    fanout.take_chunk(chunk(9, 0, 4, last=True))
    drain(fanout)
    send_all(fanout, kv, fanout.local_queues[1])
    kv.request_status.pop(9)  # SGLang's sender.clear(), which tells the fan-out (patch 0006)
    fanout.sender_cleared(9)
    drain(fanout)
    assert fanout.published["rooms_tracked"] == 0
    register(fanout, kv, 9, MAIN, "main")
    assert kv.messages[-1][2] == "Failed" and fanout.published["rooms_tracked"] == 0


def test_race4_and_5_pdd_senders_never_touch_sglangs_worker_bookkeeping():
    """Failed before (5): a chunk for relay and main was counted in _staging_outstanding by a
    local and a WAN worker (two threads, one read-modify-write), and both tore the room down
    with check-then-pop (4, the next test). PDD's senders count nothing of SGLang's and tear
    nothing down: the owner concludes the room once every chunk is reported."""
    kv = Kv()
    fanout = make_fanout(kv)
    open_room(kv, 10)
    register(fanout, kv, 10, RELAY, "relay")
    register(fanout, kv, 10, MAIN, "main")
    for c in (chunk(10, 0, 8), chunk(10, 8, 16, last=True)):
        fanout.take_chunk(c)
    drain(fanout)
    send_all(fanout, kv, fanout.local_queues[0])
    send_all(fanout, kv, fanout.wan_lines)
    assert status_name(kv, 10) == "Success"
    assert dict(kv._staging_outstanding) == {}
    assert {w[0] for w in kv.writes} == {"request_status", "req_to_decode_prefix_len"}


def test_race4_a_room_whose_relay_and_main_land_at_once_is_concluded_once(caplog):
    """Failed before, on c07d3c0's fan-out: the relay's last chunk on SGLang's transfer worker and
    main's copy of it on the WAN worker (SGLang's transfer_worker on a WAN queue) each ran
    SGLang's teardown, ``if room in transfer_infos: transfer_infos.pop(room)``; with both past the
    test before either popped, the second pop raised KeyError and killed its worker ("Transfer
    thread failed ... Prefill instance ... is dead"). The housekeeping thread's drop_silent_mains
    popped the same entry under the relay's worker the same way. Now, with the real threads and
    both senders inside their last write at once, the owner concludes the room exactly once,
    nothing raises, and both senders live to send the next room."""
    import logging

    from pdd_sglang.prefill.wan_path import WanPath

    kv = Kv()
    kv.executors = [None]
    fanout = make_fanout(kv)
    fanout.local_queues, fanout.wan_lines = [], WanLines(LINE_BYTES_PER_S)
    fanout.wan_line.queue_view = fanout.wan_lines.queued_by_class
    both_writing = threading.Barrier(2, timeout=10)
    send_aux, concluded = kv.send_aux, []

    def last_write(info, aux_index, dst_aux_ptrs):  # both senders in it before either reports
        if info.room == 16:
            both_writing.wait()
        return send_aux(info, aux_index, dst_aux_ptrs)

    def conclude(**kwargs):
        concluded.append((kwargs["bootstrap_room"], threading.current_thread().name))
        return Kv.conclude_transfer(kv, **kwargs)

    kv.send_aux, kv.conclude_transfer = last_write, conclude
    path = WanPath(fanout)
    path.start(kv, workers=1, local_workers=1)
    try:
        for room in (16, 17):
            open_room(kv, room)
            for session, role in ((RELAY, "relay"), (MAIN, "main")):
                assert fanout.claim_registration(room, session, hello_frames(kv, room, session, role))
            assert _wait(lambda: room in fanout.pdd_rooms)
            assert fanout.take_chunk(chunk(room, 0, 16, last=True))
            assert _wait(lambda: status_name(kv, room) == "Success"), status_name(kv, room)
        alive = {t.name for t in path.threads if t.is_alive()}
    finally:
        assert path.close() == []
    assert concluded == [(16, "pdd-fanout"), (17, "pdd-fanout")]
    assert {"pdd-local-xfer-0", "pdd-wan-xfer-0", "pdd-fanout"} <= alive
    assert sorted(s for s, first, n in kv.sent_kv) == [RELAY, RELAY, MAIN, MAIN]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_race6_only_the_owner_thread_writes_sglangs_status_for_a_pdd_room():
    """Failed before (the next test: the housekeeping thread's read-modify-write of
    request_status lost a Failed written by another thread). Now, with the real threads of
    WanPath, every write PDD makes to request_status and
    req_to_decode_prefix_len comes from ``pdd-fanout``. (SGLang's own scheduler still writes the
    status of its requests, Bootstrapping and an abort's Failed; an abort that meets the owner's
    Success is kept by the sender's conclude_state, SGLang's own rule.)"""
    from pdd_sglang.prefill.wan_path import WanPath

    kv = Kv()
    kv.executors = [None]
    fanout = make_fanout(kv)
    fanout.local_queues, fanout.wan_lines = [], WanLines(LINE_BYTES_PER_S)
    fanout.wan_line.queue_view = fanout.wan_lines.queued_by_class
    path = WanPath(fanout)
    path.start(kv, workers=1, local_workers=1)
    try:
        open_room(kv, 11)
        for session, role in ((RELAY, "relay"), (MAIN, "main")):
            assert fanout.claim_registration(11, session, hello_frames(kv, 11, session, role))
        assert _wait(lambda: 11 in fanout.pdd_rooms)
        assert fanout.take_chunk(chunk(11, 0, 16, last=True))
        assert _wait(lambda: status_name(kv, 11) == "Success")
    finally:
        assert path.close() == []
    writers = {thread for table, thread in kv.writes if table != "transfer_infos"}
    assert writers == {"MainThread", "pdd-fanout"}  # MainThread: the test's open_room
    assert [t for table, t in kv.writes if t != "pdd-fanout"] == [("MainThread")]


@pytest.mark.parametrize("abort_first", [False, True])
def test_race6_mains_abort_during_the_relay_wait_stands_against_the_relay_deadline(abort_first):
    """Failed before, on c07d3c0's fan-out: main registered, the relay did not; past
    --pdd-relay-bootstrap-timeout the housekeeping thread's drop_silent_relays ran
    ``update_status(room, WaitingForInput)`` (read the status, write ``max(read, ...)``) while
    SGLang's bootstrap thread handled main's ABORT (``update_status(room, Failed)``, then the ack at
    once: nothing was in flight, so main freed the pages). The Failed landed between that read and
    that write and was lost: the room went WaitingForInput, and prefill would have written its KV
    into pages main had freed. Now main's ABORT of a PDD room is the owner's event (patch 0006
    claims it) and the relay deadline is the owner's tick: the bootstrap thread writes no status,
    and in either order the room ends Failed, main acked once, nothing sent. With the abort first,
    the relay deadline once started the room with no destination left, and it never concluded
    (prefill's KV held for good): that order failed before the deadline concluded such a room."""
    kv = Kv()
    fanout = make_fanout(kv)
    fanout.relay_bootstrap_timeout_s = 0.0
    open_room(kv, 25)
    register(fanout, kv, 25, MAIN, "main")  # the relay never comes
    bootstrap = threading.Thread(target=kv.handle_abort, args=(25, MAIN), name="bootstrap")
    if not abort_first:
        fanout.tick(now=fanout.clock() + 1)  # the relay deadline
    bootstrap.start()
    bootstrap.join(5)
    drain(fanout)
    if abort_first:
        fanout.tick(now=fanout.clock() + 1)
    fanout.take_chunk(chunk(25, 0, 8, last=True))  # prefill's chunk, had the room started
    drain(fanout)
    for queue in fanout.local_queues + [fanout.wan_lines]:
        send_all(fanout, kv, queue)
    fanout.tick(now=fanout.clock() + 400)
    drain(fanout)
    assert not [w for w in kv.writes if w[1] == "bootstrap"]
    assert kv.abort_acks == [(25, "127.0.0.1", 2002, 1)] and kv.sent_kv == []
    assert status_name(kv, 25) == "Failed"


def _wait(condition, timeout_s=10.0):
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return False


def test_race7_an_aux_write_failure_concludes_the_room():
    """Failed before: a failed aux write on a PDD room was never concluded, so prefill never
    freed its KV. Now a failed relay drops out (main goes on), and a failed main fails the room."""
    kv = Kv()
    fanout = make_fanout(kv)
    kv.fail_aux = {RELAY}
    open_room(kv, 12)
    register(fanout, kv, 12, RELAY, "relay")
    register(fanout, kv, 12, MAIN, "main")
    fanout.take_chunk(chunk(12, 0, 8, last=True))
    drain(fanout)
    send_all(fanout, kv, fanout.local_queues[0])
    assert kv.messages == [((("127.0.0.1", 1001),), 12, "Failed")]
    send_all(fanout, kv, fanout.wan_lines)
    assert status_name(kv, 12) == "Success"  # main had it all; prefill frees the KV
    kv.fail_aux = {MAIN}
    open_room(kv, 13)
    register(fanout, kv, 13, MAIN, "main", destinations=1)
    fanout.take_chunk(chunk(13, 0, 8, last=True))
    drain(fanout)
    send_all(fanout, kv, fanout.wan_lines)
    assert status_name(kv, 13) == "Failed"


def test_race9_a_main_out_after_a_wan_failure_comes_back_on_a_wan_probe():
    """Failed before: a failed WAN batch blacklisted the main in SGLang's failed_sessions, which
    SGLang's own engine probed (not the WAN engine), and nothing told the router."""
    kv = Kv()
    fanout = make_fanout(kv)
    probes = []
    fanout.wan_engine.probe = lambda session: probes.append(session) or len(probes) > 1
    kv.fail_kv = {MAIN}
    open_room(kv, 14)
    register(fanout, kv, 14, MAIN, "main", destinations=1)
    fanout.take_chunk(chunk(14, 0, 8, last=True))
    drain(fanout)
    send_all(fanout, kv, fanout.wan_lines)
    assert status_name(kv, 14) == "Failed"
    assert fanout.published["mains_out"] == [MAIN]  # /server_info: the router keeps off it
    fanout.tick(now=fanout.clock() + 60)
    drain(fanout)  # the first probe fails
    assert fanout.published["mains_out"] == [MAIN]
    fanout.mains_out[MAIN] = 0
    fanout.tick(now=fanout.clock() + 60)
    drain(fanout)
    assert probes == [MAIN, MAIN] and fanout.published["mains_out"] == []
    fanout.handle(ProbeAnswered(MAIN, True))  # a stale answer changes nothing
    # Out again at once (Mooncake's probe reached it, its line still stalls data): back off.
    open_room(kv, 15)
    register(fanout, kv, 15, MAIN, "main", destinations=1)
    fanout.take_chunk(chunk(15, 0, 8, last=True))
    drain(fanout)
    send_all(fanout, kv, fanout.wan_lines)
    assert fanout.mains_out[MAIN] - fanout.clock() > 3.0  # twice PROBE_INTERVAL_S


def _room_with_main_chunk_in_a_sender(kv, fanout, room):
    """Relay and main registered, two chunks routed to each; main's sender is writing the first."""
    open_room(kv, room)
    register(fanout, kv, room, RELAY, "relay")
    register(fanout, kv, room, MAIN, "main")
    for c in (chunk(room, 0, 8), chunk(room, 8, 16, last=True)):
        fanout.take_chunk(c)
    drain(fanout)
    writing = fanout.wan_lines.pop(0)
    writing.started_at = fanout.clock()
    return writing


def test_race10_sglangs_own_abort_path_acks_a_pdd_room_at_once_and_fails_the_relay(monkeypatch):
    """The race as it was (the claim off): SGLang acks main's ABORT while a PDD sender still
    writes main's pages (its worker never held them, so nothing is outstanding), main frees and
    reuses them, and the room is marked Failed under the relay too. The soak's three token
    mismatches (main copies aborted during a relay outage) came from here."""
    monkeypatch.setattr(hooks, "claim_abort", lambda kv_mgr, notification: False)
    kv = Kv()
    fanout = make_fanout(kv)
    writing = _room_with_main_chunk_in_a_sender(kv, fanout, 20)
    kv.handle_abort(20, MAIN)
    assert kv.abort_acks == [(20, "127.0.0.1", 2002, 1)]  # while main's chunk is being written
    assert status_name(kv, 20) == "Failed"
    fanout.tick()
    fanout.handle(ChunkSent(writing, True))
    for queue in (fanout.wan_lines, fanout.local_queues[0]):
        send_all(fanout, kv, queue)
    assert ((("127.0.0.1", 1001),), 20, "Failed") in kv.messages  # the relay failed with it


def test_race10_a_mains_abort_is_acked_once_no_sender_writes_its_pages_and_the_relay_goes_on():
    """Failed before (the test above is that code): the fan-out claims a PDD room's ABORT
    (patch 0006), cancels main's queued chunk and acks only on the report of the one being
    written; the relay is neither failed nor held."""
    kv = Kv()
    fanout = make_fanout(kv)
    writing = _room_with_main_chunk_in_a_sender(kv, fanout, 21)
    kv.handle_abort(21, MAIN)
    drain(fanout)
    assert kv.abort_acks == [] and status_name(kv, 21) == "WaitingForInput"
    assert kv._deferred_ack_targets == {}  # SGLang's own table never held it
    queued = list(fanout.wan_lines)
    assert [w.cancelled for w in queued] == [True]
    fanout.handle(ChunkSent(writing, True))  # the write in progress lands
    assert kv.abort_acks == []  # the queued one is still in a sender
    send_all(fanout, kv, fanout.wan_lines)  # skipped: cancelled
    assert kv.abort_acks == [(21, "127.0.0.1", 2002, 1)]
    assert not [s for s, first, n in kv.sent_kv if s == MAIN and first == 8]
    send_all(fanout, kv, fanout.local_queues[1])
    assert status_name(kv, 21) == "Success"
    assert kv.messages == [((("127.0.0.1", 1001),), 21, "Success")]  # main is told nothing
    assert fanout.published["destinations_aborted"] == 1


def test_race10_an_abort_after_the_destination_has_all_its_kv_is_acked_at_once():
    kv = Kv()
    fanout = make_fanout(kv)
    open_room(kv, 22)
    register(fanout, kv, 22, MAIN, "main", destinations=1)
    fanout.take_chunk(chunk(22, 0, 8, last=True))
    drain(fanout)
    send_all(fanout, kv, fanout.wan_lines)
    assert status_name(kv, 22) == "Success"
    kv.handle_abort(22, MAIN, generation=3)
    drain(fanout)
    assert kv.abort_acks == [(22, "127.0.0.1", 2002, 3)]
    kv.handle_abort(99, MAIN)  # a room this prefill never saw: SGLang's own path
    assert 99 in kv._deferred_ack_targets or kv.abort_acks[-1][0] == 99


def test_race10_when_every_destination_aborts_the_room_fails_and_prefill_frees_its_kv():
    kv = Kv()
    fanout = make_fanout(kv)
    writing = _room_with_main_chunk_in_a_sender(kv, fanout, 23)
    kv.handle_abort(23, RELAY)
    kv.handle_abort(23, MAIN)
    drain(fanout)
    assert status_name(kv, 23) == "WaitingForInput"  # a chunk is still being written
    send_all(fanout, kv, fanout.local_queues[1])
    fanout.handle(ChunkSent(writing, True))
    send_all(fanout, kv, fanout.wan_lines)
    assert status_name(kv, 23) == "Failed"
    assert sorted(a[2] for a in kv.abort_acks) == [1001, 2002]
    assert kv.messages == []  # neither is told anything: both let the request go


def test_race10_an_abort_is_acked_when_prefill_cleared_the_room_before_its_sender_reported():
    """Failed before its fix (ci run of 13:30, the singular filter's teardown waited SGLang's
    30 s release timeout): the client's abort reaches prefill too, SGLang clears the room, and
    the owner forgot it with main's ack still waiting on a sender, so the ack never went."""
    kv = Kv()
    fanout = make_fanout(kv)
    writing = _room_with_main_chunk_in_a_sender(kv, fanout, 24)
    kv.handle_abort(24, MAIN)
    drain(fanout)
    kv.request_status.pop(24)  # prefill's own abort: SGLang's sender.clear()
    fanout.sender_cleared(24)
    drain(fanout)
    assert kv.abort_acks == []
    fanout.handle(ChunkSent(writing, True))
    send_all(fanout, kv, fanout.wan_lines)
    assert kv.abort_acks == [(24, "127.0.0.1", 2002, 1)]
    send_all(fanout, kv, fanout.local_queues[0])
    assert fanout.published["rooms_tracked"] == 0 and 24 not in fanout.pdd_rooms


@pytest.mark.parametrize("registration_posted_first", [True, False],
                         ids=["registration_queued", "registration_after"])
def test_race11_a_request_sglang_ends_before_the_owner_saw_its_registration_never_starts(
        registration_posted_first):
    """SGLang clears a room's sender on the scheduler thread; whether the owner knows the room
    is the owner's to answer. Failed before, both orders: the scheduler thread tested the owner's
    ``_rooms`` (a read against the owner rule), which does not yet hold a room whose registration
    is still queued or not yet sent, so no clear was posted; the room was created afterwards,
    started at the relay's deadline and re-created the status SGLang had cleared (a leak)."""
    kv = Kv()
    fanout = make_fanout(kv)
    fanout.relay_bootstrap_timeout_s = 1.0
    open_room(kv, 31)
    if registration_posted_first:  # the bootstrap thread posted it; the owner has not run
        register(fanout, kv, 31, MAIN, "main", pump=False)
    kv.request_status.pop(31)  # the client left: SGLang's sender.clear() (patch 0006)
    fanout.sender_cleared(31)
    if not registration_posted_first:  # main's hello arrives after the request ended
        drain(fanout)
        register(fanout, kv, 31, MAIN, "main", pump=False)
    drain(fanout)
    fanout.tick(now=fanout.clock() + 5)  # past the relay's deadline: nothing starts
    assert status_name(kv, 31) is None and 31 not in fanout.pdd_rooms
    assert kv.messages == [((("127.0.0.1", 2002),), 31, "Failed")]  # main lets go of its slots
    assert fanout.published["rooms_tracked"] == 0 and fanout.published["rooms_open"] == 0
