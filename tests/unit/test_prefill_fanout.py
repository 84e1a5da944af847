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
    for chunk in chunks_of(total, chunk_pages):
        view = skip_prefix_pages(chunk, skip_pages * page_size, page_size)
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


# ---- the fan-out's fault handling, on a stand-in for SGLang's Mooncake KV manager -------------
from types import SimpleNamespace  # noqa: E402

from pdd_sglang.protocol.messages import DestinationHello, encode  # noqa: E402
from pdd_sglang.prefill.fanout import HELLO_FRAME_INDEX, PrefillFanout  # noqa: E402


class FakeKvManager:
    def __init__(self, page_size=1):
        self.kv_args = SimpleNamespace(page_size=page_size, kv_item_lens=[100, 100])
        self.transfer_infos = {}
        self.req_to_decode_prefix_len = {}
        self.status = {}
        self.sent = []
        self.failures = []
        self.concluded = []
        self._staging_outstanding = {}

    def update_status(self, room, status):
        self.status[room] = status

    def send_kv_status_message(self, *, targets, bootstrap_room, status, failure_reason=None):
        self.sent.append((tuple(targets), bootstrap_room, status))

    def conclude_failure(self, *, bootstrap_room, failure_reason):
        self.failures.append((bootstrap_room, failure_reason))

    def conclude_transfer(self, *, bootstrap_room, status, targets=None, failure_reason=None):
        self.concluded.append((bootstrap_room, status, tuple(targets or ())))


def register(fanout, kv, room, session, role, destinations=2, prefix=0, port=1):
    info = SimpleNamespace(decode_prefix_len=prefix, endpoint="127.0.0.1", dst_port=port,
                           mooncake_session_id=session)
    kv.transfer_infos.setdefault(room, {})[session] = info
    frames = [b""] * HELLO_FRAME_INDEX + [encode(DestinationHello(
        room=room, role=role, destinations=destinations, prefix_tokens=prefix))]
    fanout.on_destination_registered(room, session, frames)
    return info


def test_silent_relay_is_dropped_and_a_late_one_refused():
    from sglang.srt.disaggregation.base.conn import KVPoll

    kv = FakeKvManager()
    fanout = PrefillFanout(kv)
    fanout.relay_bootstrap_timeout_s = 2.0
    register(fanout, kv, room=9, session="main", role="main", prefix=32)
    assert fanout.drop_silent_relays(now=fanout._rooms[9].first_hello_at + 1.0) == []
    assert fanout.drop_silent_relays(now=fanout._rooms[9].first_hello_at + 3.0) == [9]
    assert kv.status[9] == KVPoll.WaitingForInput
    assert kv.req_to_decode_prefix_len[9] == 32  # the main's own prefix: only it is served
    assert fanout._rooms[9].expected == 1
    register(fanout, kv, room=9, session="relay", role="relay", prefix=0, port=2)
    assert "relay" not in kv.transfer_infos[9]  # out before SGLang counts destinations
    assert kv.sent == [((("127.0.0.1", 2),), 9, KVPoll.Failed)]


def test_mismatched_and_repeated_hellos_are_refused():
    kv = FakeKvManager()
    fanout = PrefillFanout(kv)
    info = SimpleNamespace(decode_prefix_len=16, endpoint="h", dst_port=1)
    kv.transfer_infos[5] = {"main": info}
    frames = [b""] * HELLO_FRAME_INDEX + [encode(DestinationHello(
        room=5, role="main", destinations=1, prefix_tokens=64))]
    fanout.on_destination_registered(5, "main", frames)
    assert fanout.refused_hellos == 1 and not fanout.is_pdd_room(5)
    register(fanout, kv, room=6, session="main", role="main", destinations=1)
    register(fanout, kv, room=6, session="main", role="main", destinations=1)
    assert len(fanout._rooms[6].hellos) == 1


def test_prefix_claim_beyond_the_prompt_fails_the_room_cleanly():
    kv = FakeKvManager(page_size=1)
    fanout = PrefillFanout(kv)
    register(fanout, kv, room=3, session="relay", role="relay", prefix=0)
    main = register(fanout, kv, room=3, session="main", role="main", prefix=500, port=2)
    last = Chunk(3, np.arange(100, dtype=np.int32), slice(0, 100))
    last.is_last_chunk = True
    view = fanout.chunk_for_destination(last, main)
    assert len(view.prefill_kv_indices) == 0
    assert kv.failures and "beyond the 100 tokens" in kv.failures[0][1]


def test_rooms_sglang_forgot_are_pruned():
    kv = FakeKvManager()
    fanout = PrefillFanout(kv)
    register(fanout, kv, room=11, session="relay", role="relay")
    register(fanout, kv, room=11, session="main", role="main", port=2)
    del kv.transfer_infos[11]  # failed and cleared by SGLang, never concluded through us
    fanout.drop_silent_relays(now=fanout._rooms[11].first_hello_at + 601)
    assert 11 not in fanout._rooms


def test_the_wan_path_gets_its_own_counted_copy_of_a_chunk():
    kv = FakeKvManager()
    fanout = PrefillFanout(kv)
    register(fanout, kv, room=4, session="relay", role="relay")
    register(fanout, kv, room=4, session="main", role="main", port=2)
    queue = wan_queue(fanout)
    chunk = CountedChunk(4, np.arange(8, dtype=np.int32), slice(0, 8))
    relay_req = SimpleNamespace(mooncake_session_id="relay")
    main_req = SimpleNamespace(mooncake_session_id="main")
    assert fanout.destinations_on_this_path(chunk, [relay_req, main_req], LOCAL_QUEUE) == [relay_req]
    (wan_chunk,) = queue
    assert wan_chunk is not chunk and wan_chunk.staging_counted is False


@dataclasses.dataclass
class CountedChunk(Chunk):
    staging_counted: bool = True


LOCAL_QUEUE = object()  # a local transfer worker's queue: not one of the WAN path's


def wan_queue(fanout, charges=None):
    queue = []

    def put(item, item_charges=()):
        queue.append(item)
        if charges is not None:
            charges.extend(item_charges)

    fanout.wan_queues.append(SimpleNamespace(put=put))
    return queue


def test_prefill_starts_on_the_relay_and_replays_earlier_chunks_to_a_late_main():
    from sglang.srt.disaggregation.base.conn import KVPoll

    kv = FakeKvManager()
    fanout = PrefillFanout(kv)
    queue = wan_queue(fanout)
    register(fanout, kv, room=7, session="relay", role="relay")
    # Started without the main: SGLang alone would wait for both destinations.
    assert kv.status[7] == KVPoll.WaitingForInput and kv.req_to_decode_prefix_len[7] == 0
    relay_req = SimpleNamespace(mooncake_session_id="relay")
    first = CountedChunk(7, np.arange(8, dtype=np.int32), slice(0, 8))
    assert fanout.destinations_on_this_path(first, [relay_req], LOCAL_QUEUE) == [relay_req]
    assert queue == []  # no main yet: kept, not sent
    # The main registers while a second chunk is on its way: SGLang's table already lists it,
    # but this chunk's decision saw no main hello, so only the relay gets it here...
    second = CountedChunk(7, np.arange(8, 16, dtype=np.int32), slice(8, 16))
    main_req = SimpleNamespace(mooncake_session_id="main")
    assert fanout.destinations_on_this_path(second, [relay_req], LOCAL_QUEUE) == [relay_req]
    register(fanout, kv, room=7, session="main", role="main", prefix=8, port=2)
    # ...and both chunks reach main once, by replay, each counted afresh on the WAN path.
    assert [c.index_slice for c in queue] == [slice(0, 8), slice(8, 16)]
    assert not any(c.staging_counted for c in queue)
    # From now on chunks go to both paths as usual.
    third = CountedChunk(7, np.arange(16, 24, dtype=np.int32), slice(16, 24))
    assert fanout.destinations_on_this_path(third, [relay_req, main_req], LOCAL_QUEUE) == [relay_req]
    assert [c.index_slice for c in queue][-1] == slice(16, 24) and len(queue) == 3
    assert fanout._rooms[7].unsent_to_main == []


def test_a_main_that_registered_first_waits_for_its_relay_as_before():
    kv = FakeKvManager()
    fanout = PrefillFanout(kv)
    register(fanout, kv, room=8, session="main", role="main", prefix=16)
    assert 8 not in kv.status  # SGLang's own count starts the room once the relay is in
    register(fanout, kv, room=8, session="relay", role="relay", port=2)
    assert 8 not in kv.status


def test_silent_main_is_dropped_after_the_relay_has_its_kv_and_a_late_one_refused():
    from sglang.srt.disaggregation.base.conn import KVPoll

    kv = FakeKvManager()
    fanout = PrefillFanout(kv)
    wan_queue(fanout)
    fanout.main_bootstrap_timeout_s = 3.0
    relay = register(fanout, kv, room=12, session="relay", role="relay")
    relay.room = 12
    relay_req = SimpleNamespace(mooncake_session_id="relay")
    fanout.destinations_on_this_path(CountedChunk(12, np.arange(4, dtype=np.int32), slice(0, 4)),
                                     [relay_req], LOCAL_QUEUE)
    start = fanout._rooms[12].first_hello_at
    # Past the deadline but the relay's copy is not done: prefill must keep the KV.
    assert fanout.drop_silent_mains(now=start + 10) == []
    fanout.destination_sent(relay, True)
    assert kv.sent == [((("127.0.0.1", 1),), 12, KVPoll.Success)]  # the relay starts decoding
    assert fanout.drop_silent_mains(now=start + 2) == []
    assert fanout.drop_silent_mains(now=start + 4) == [12]
    assert kv.concluded == [(12, KVPoll.Success, ())]  # prefill frees the room's KV
    assert 12 not in kv.transfer_infos and fanout.mains_dropped == 1
    assert fanout._rooms[12].unsent_to_main == []
    kv.transfer_infos[12] = {}
    register(fanout, kv, room=12, session="main", role="main", port=2)
    assert "main" not in kv.transfer_infos[12]
    assert kv.sent[-1] == ((("127.0.0.1", 2),), 12, KVPoll.Failed)


def test_a_relay_whose_transfer_fails_drops_out_and_the_room_goes_on_to_main():
    from sglang.srt.disaggregation.base.conn import KVPoll

    kv = FakeKvManager()
    fanout = PrefillFanout(kv)
    queue = wan_queue(fanout)
    relay = register(fanout, kv, room=21, session="relay", role="relay")
    relay.room = 21
    relay_req = SimpleNamespace(mooncake_session_id="relay")
    first = CountedChunk(21, np.arange(8, dtype=np.int32), slice(0, 8))
    fanout.destinations_on_this_path(first, [relay_req], LOCAL_QUEUE)
    # The relay dies while its copy is in flight: PDD takes it out instead of failing the room.
    assert fanout.destination_failed(relay) is True
    assert "relay" not in kv.transfer_infos[21] and fanout.relays_dropped == 1
    # The relay, if still up, is told its room failed: it frees the slots now.
    assert kv.sent == [((("127.0.0.1", 1),), 21, KVPoll.Failed)]
    assert fanout.destination_failed(relay) is False  # once
    assert len(kv.sent) == 1
    # Main registers later and still gets every chunk, then the room concludes on main alone.
    main = register(fanout, kv, room=21, session="main", role="main", port=2)
    main.room = 21
    assert [c.index_slice for c in queue] == [slice(0, 8)]
    fanout.destination_sent(main, True)
    assert kv.concluded and kv.concluded[-1][0] == 21


def test_a_failed_main_is_left_to_sglang():
    kv = FakeKvManager()
    fanout = PrefillFanout(kv)
    register(fanout, kv, room=22, session="relay", role="relay")
    main = register(fanout, kv, room=22, session="main", role="main", port=2)
    main.room = 22
    assert fanout.destination_failed(main) is False  # SGLang fails the room as usual
    plain = SimpleNamespace(room=23, mooncake_session_id="x")
    assert fanout.destination_failed(plain) is False


def test_a_wan_workers_chunk_goes_to_mains_only_and_is_charged_to_the_line():
    kv = FakeKvManager()  # page_size 1, 200 bytes a page over both layers
    fanout = PrefillFanout(kv)
    charges = []
    queue = wan_queue(fanout, charges)
    register(fanout, kv, room=30, session="relay", role="relay")
    register(fanout, kv, room=30, session="main", role="main", prefix=8, port=2)
    relay_req = SimpleNamespace(mooncake_session_id="relay")
    main_req = SimpleNamespace(mooncake_session_id="main")
    cached = CountedChunk(30, np.arange(8, dtype=np.int32), slice(0, 8))  # main holds these
    fresh = CountedChunk(30, np.arange(8, 20, dtype=np.int32), slice(8, 20))
    for chunk in (cached, fresh):
        assert fanout.destinations_on_this_path(chunk, [relay_req, main_req], LOCAL_QUEUE) == [relay_req]
    # Main's part only: nothing of the chunk under its prefix, 12 pages of the next.
    assert charges == [("main", 0), ("main", 12 * 200)]
    # The path is told by the queue the chunk came from, not by the thread that runs it.
    wan = fanout.wan_queues[0]
    assert fanout.destinations_on_this_path(queue[1], [relay_req, main_req], wan) == [main_req]


def test_a_failed_relay_is_told_off_sglangs_session_lock():
    from sglang.srt.disaggregation.base.conn import KVPoll

    kv = FakeKvManager()
    fanout = PrefillFanout(kv)
    jobs = []
    fanout.defer = jobs.append  # WanPath's housekeeping thread, in production
    wan_queue(fanout)
    relay = register(fanout, kv, room=40, session="relay", role="relay")
    relay.room = 40
    assert fanout.destination_failed(relay) is True
    assert "relay" not in kv.transfer_infos[40]  # out of SGLang's table at once...
    assert kv.sent == []  # ...but nothing sent while SGLang holds its session_lock
    (job,) = jobs
    job()
    assert kv.sent == [((("127.0.0.1", 1),), 40, KVPoll.Failed)]
