"""Issue #22's races in the prefill fan-out, reproduced deterministically on the fan-out of four
threads (before the one-owner rewrite). Each test is marked ``xfail(strict=True)``: it passes only
while the race reproduces, so this file shows, commit by commit, that every race was real.

The pauses are injected where the named threads interleave: a dict whose read hands control to
"the other thread" at the named point, or a barrier between two statements. No sleeps.
"""

import threading
from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import pytest

from pdd_sglang.prefill.fanout import HELLO_FRAME_INDEX, PrefillFanout
from pdd_sglang.protocol.messages import DestinationHello, encode

RACE = pytest.mark.xfail(strict=True, raises=(AssertionError, RuntimeError, KeyError),
                         reason="race reproduced on the pre-owner fan-out")


class Kv:
    """The parts of SGLang's MooncakeKVManager that the fan-out and its patches touch."""

    def __init__(self, queues=4):
        from sglang.srt.disaggregation.base.conn import KVPoll

        self.kv_args = SimpleNamespace(page_size=1, kv_item_lens=[100, 100])
        self.transfer_infos = {}
        self.req_to_decode_prefix_len = {}
        self.request_status = {}
        self._staging_outstanding = defaultdict(int)
        self.transfer_queues = [SimpleNamespace(items=[], put=None) for _ in range(queues)]
        for q in self.transfer_queues:
            q.put = q.items.append
        self.sent, self.concluded = [], []
        self.disaggregation_mode = __import__(
            "sglang.srt.disaggregation.utils", fromlist=["DisaggregationMode"]).DisaggregationMode.PREFILL
        self.KVPoll = KVPoll

    def check_status(self, room):
        return self.request_status[room]

    def update_status(self, room, status):
        self.request_status[room] = status

    def send_kv_status_message(self, *, targets, bootstrap_room, status, failure_reason=None):
        self.sent.append((tuple(targets), bootstrap_room, status))

    def conclude_transfer(self, *, bootstrap_room, status, targets=None, failure_reason=None):
        self.concluded.append((bootstrap_room, status))
        self.request_status[bootstrap_room] = status

    def conclude_failure(self, *, bootstrap_room, failure_reason, targets=None):
        self.conclude_transfer(bootstrap_room=bootstrap_room, status=self.KVPoll.Failed)

    def add_transfer_request(self, *args, **kwargs):  # SGLang's own, unpatched logic
        from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

        return MooncakeKVManager.add_transfer_request(self, *args, **kwargs)


def register(fanout, kv, room, session, role, prefix=0):
    info = SimpleNamespace(room=room, decode_prefix_len=prefix, endpoint="127.0.0.1",
                           dst_port=int(session.rsplit(":", 1)[1]), mooncake_session_id=session)
    kv.transfer_infos.setdefault(room, {})[session] = info  # SGLang's bootstrap thread
    frames = [b""] * HELLO_FRAME_INDEX + [encode(DestinationHello(
        room=room, role=role, destinations=2, prefix_tokens=prefix))]
    fanout.on_destination_registered(room, session, frames)
    return info


def chunk(room, start, stop, last=False):
    from sglang.srt.disaggregation.common.utils import TransferKVChunk

    return TransferKVChunk(room=room, prefill_kv_indices=np.arange(start, stop, dtype=np.int32),
                           index_slice=slice(start, stop), is_last_chunk=last,
                           prefill_aux_index=0 if last else None, state_indices=None,
                           staging_counted=True)


RELAY, MAIN = "127.0.0.1:1001", "127.0.0.1:2002"


@RACE
def test_race1_one_rooms_chunks_land_on_one_transfer_queue():
    """SGLang shards a room's chunks by the sum of its destinations' ports: a main registering
    mid-room moves the room's later chunks to another queue than its earlier ones."""
    kv = Kv()
    fanout = PrefillFanout(kv)
    register(fanout, kv, 5, RELAY, "relay")  # prefill starts on the relay alone
    kv.add_transfer_request(5, np.arange(0, 8, dtype=np.int32), slice(0, 8), False)
    register(fanout, kv, 5, MAIN, "main", prefix=0)
    kv.add_transfer_request(5, np.arange(8, 16, dtype=np.int32), slice(8, 16), True, aux_index=0)
    used = [i for i, q in enumerate(kv.transfer_queues) if q.items]
    assert len(used) == 1, f"room 5's chunks went to queues {used}"


@RACE
def test_race1b_replay_to_a_late_main_keeps_chunk_order():
    """The early chunks replayed to a late main (bootstrap thread) and the room's last chunk
    forwarded by a local worker reach main's WAN queue in the order prefill made them."""
    kv = Kv()
    fanout = PrefillFanout(kv)
    wan = []
    fanout.wan_queues.append(SimpleNamespace(put=lambda item, charges=(): wan.append(item)))
    register(fanout, kv, 6, RELAY, "relay")
    relay_req = kv.transfer_infos[6][RELAY]
    fanout.destinations_on_this_path(chunk(6, 0, 8), [relay_req], object())  # kept for main
    replay_taken, forwarded = threading.Event(), threading.Event()
    real = fanout._to_wan_path

    def to_wan_path(c):  # the bootstrap thread's replay: paused after it took the list
        if threading.current_thread().name == "bootstrap":
            replay_taken.set()
            forwarded.wait(5)
        real(c)

    fanout._to_wan_path = to_wan_path
    boot = threading.Thread(target=register, args=(fanout, kv, 6, MAIN, "main"), name="bootstrap")
    boot.start()
    replay_taken.wait(5)
    infos = list(kv.transfer_infos[6].values())
    fanout.destinations_on_this_path(chunk(6, 8, 16, last=True), infos, object())  # local worker
    forwarded.set()
    boot.join(5)
    assert [c.index_slice.start for c in wan] == [0, 8], "main's last chunk overtook its first"


class _InsertsWhileRead(SimpleNamespace):
    """A TransferInfo whose read lets the bootstrap thread register another destination."""

    def __getattribute__(self, name):
        if name == "decode_prefix_len" and object.__getattribute__(self, "hook"):
            hook, self.hook = object.__getattribute__(self, "hook"), None
            hook()
        return object.__getattribute__(self, name)


@RACE
def test_race2_a_destination_table_iterated_while_it_grows():
    """A transfer worker walks ``transfer_infos[room]`` (chunk_for_destination) while the
    bootstrap thread adds a late main to it."""
    kv = Kv()
    fanout = PrefillFanout(kv)
    register(fanout, kv, 7, RELAY, "relay")
    relay = kv.transfer_infos[7][RELAY]
    late = SimpleNamespace(decode_prefix_len=0, mooncake_session_id=MAIN)
    kv.transfer_infos[7][RELAY] = _InsertsWhileRead(
        **vars(relay), hook=lambda: kv.transfer_infos[7].__setitem__(MAIN, late))
    fanout.chunk_for_destination(chunk(7, 0, 8), relay)  # RuntimeError: changed size


@RACE
def test_race3_bootstrap_thread_keyerror_when_a_main_is_dropped_meanwhile():
    """SGLang's bootstrap thread inserts a late main, then reads ``len(transfer_infos[room])``;
    in between, the housekeeping thread's drop_silent_mains pops the room."""
    kv = Kv()
    fanout = PrefillFanout(kv)
    fanout.main_bootstrap_timeout_s = 0.0
    wan = []
    fanout.wan_queues.append(SimpleNamespace(put=lambda item, charges=(): wan.append(item)))
    relay = register(fanout, kv, 8, RELAY, "relay")
    fanout.destination_sent(relay, True)
    # Bootstrap thread, for the restarted main: SGLang's two statements, the drop between them.
    kv.transfer_infos.setdefault(8, {})[MAIN] = SimpleNamespace(decode_prefix_len=0)
    fanout.drop_silent_mains(now=fanout._rooms[8].first_hello_at + 1)
    assert len(kv.transfer_infos[8]) >= 1  # conn.py: KeyError kills the bootstrap thread


@RACE
def test_race3b_a_main_refused_after_the_drop_leaves_no_entry_behind():
    kv = Kv()
    fanout = PrefillFanout(kv)
    fanout.main_bootstrap_timeout_s = 0.0
    fanout.wan_queues.append(SimpleNamespace(put=lambda item, charges=(): None))
    relay = register(fanout, kv, 9, RELAY, "relay")
    fanout.destination_sent(relay, True)
    fanout.drop_silent_mains(now=fanout._rooms[9].first_hello_at + 1)
    register(fanout, kv, 9, MAIN, "main")  # refused as late
    assert 9 not in kv.transfer_infos, f"left behind: {kv.transfer_infos.get(9)!r}"


@RACE
def test_race5_one_rooms_chunk_is_counted_by_two_threads():
    """A chunk for relay and main is counted in ``_staging_outstanding`` by the local worker and
    again, as an uncounted copy, by a WAN worker: two threads read-modify-write one counter."""
    kv = Kv()
    fanout = PrefillFanout(kv)
    wan = []
    fanout.wan_queues.append(SimpleNamespace(put=lambda item, charges=(): wan.append(item)))
    register(fanout, kv, 10, RELAY, "relay")
    register(fanout, kv, 10, MAIN, "main")
    fanout.destinations_on_this_path(chunk(10, 0, 8), list(kv.transfer_infos[10].values()), object())
    counted_by = {"local"} | {"wan" for c in wan if not c.staging_counted}
    assert counted_by == {"local"}, f"room 10 is counted on {sorted(counted_by)} threads"


@RACE
def test_race7_an_aux_write_failure_concludes_the_room():
    """SGLang's worker reports a failed aux write through destination_sent(ok=False); the
    fan-out assumes SGLang concluded the room, which it did not: nobody frees the KV."""
    kv = Kv()
    fanout = PrefillFanout(kv)
    relay = register(fanout, kv, 11, RELAY, "relay")
    register(fanout, kv, 11, MAIN, "main")
    fanout.destination_sent(relay, False)
    assert kv.concluded, "room 11 was never concluded: its KV stays allocated"


@RACE
def test_race9_a_main_out_after_a_wan_failure_is_published_and_probed_back():
    """A failed WAN batch puts a main in SGLang's failed_sessions; the fan-out neither says so
    in /server_info nor probes it over the WAN engine."""
    kv = Kv()
    fanout = PrefillFanout(kv)
    assert hasattr(fanout, "mains_out"), "no record of mains taken out after a WAN failure"
