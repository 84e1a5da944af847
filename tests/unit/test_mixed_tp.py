"""Prefill, relay and main at different TP sizes (issue 37), on one prefill rank's fan-out.

A decode at a larger TP than prefill's registers ``decode TP // prefill TP`` ranks with each
prefill rank, one session each: the room waits for every rank of a role, sends each rank its own
heads, tells each rank apart, and fails the ranks of a role dropped half-registered. Sizes SGLang's
PD cannot pair are refused naming both. The senders write head slices with SGLang's own
``send_kvcache_slice`` (installed, patched: 0019), a main's layers on the sender thread inside its
windowed WAN copy, a relay's on the executor within the request's ledger scope.
"""

from __future__ import annotations

import concurrent.futures
import threading
from types import SimpleNamespace

import numpy as np
import pytest

import pdd_sglang.hooks as hooks
from fanout_harness import Kv, chunk, drain, make_fanout, poll_name, send_all
from pdd_sglang.prefill import tp_slices
from pdd_sglang.protocol.messages import (DestinationHello, encode, sessions_per_prefill_rank,
                                          tp_refusal)

RELAY = "127.0.0.1:1001"
MAIN_RANKS = ("127.0.0.1:2002", "127.0.0.1:2003")  # one main at TP 2: two sessions here


@pytest.fixture(autouse=True)
def prefill_role(monkeypatch):
    monkeypatch.setattr(hooks, "_role", "prefill")


def frames(kv, room, session, role, *, tp=1, rank=0, prefix=0, destinations=2, dummy=False):
    """A decode rank's registration at decode TP ``tp`` (its rank ``rank``), as SGLang's
    bootstrap thread hands it to the fan-out, and its KV args registration."""
    port = int(session.rsplit(":", 1)[1])
    kv.decode_kv_args_table[session] = SimpleNamespace(
        dst_kv_ptrs=[0], dst_aux_ptrs=[0], dst_attn_tp_size=tp, dst_kv_layer_ids=None,
        dst_kv_item_len=None, dst_tp_rank=rank)
    indices = b"" if dummy else np.arange(4096, dtype=np.int32).tobytes()
    return [str(room).encode(), b"127.0.0.1", str(port).encode(), session.encode(), indices,
            b"" if dummy else b"0", b"", str(destinations).encode(), str(prefix).encode(), b"",
            encode(DestinationHello(room=room, role=role, destinations=destinations,
                                    prefix_tokens=prefix, tp_size=tp))]


def register(fanout, kv, room, session, role, **kwargs):
    assert fanout.claim_registration(room, session, frames(kv, room, session, role, **kwargs))
    drain(fanout)


def opened(kv, room):
    from sglang.srt.disaggregation.base.conn import KVPoll

    kv.update_status(room, KVPoll.Bootstrapping)


def main_works(fanout, room) -> list:
    """The main-bound work of ``room`` routed so far and not yet reported (whatever queues the
    harness gives the WAN senders)."""
    return [work for work in fanout._rooms[room].in_flight if work.role == "main"]


class SlicingKv(Kv):
    """The harness's KV manager with SGLang's sliced send recorded (the executor it got too)."""

    def __init__(self, attn_tp_size=1):
        super().__init__()
        self.attn_tp_size = attn_tp_size
        self.kv_args.total_kv_head_num, self.kv_args.engine_rank = 2, 0
        self.sliced: list = []  # (session, dst rank, pages, executor)

    def send_kvcache_slice(self, session, src, dst_ptrs, dst, dst_tp_rank, dst_tp, item_len,
                           executor, layer_ids=None):
        self.sliced.append((session, dst_tp_rank, len(src), executor))
        return 0


def test_sglangs_pairing_rules():
    assert [sessions_per_prefill_rank(d, p) for d, p in ((2, 1), (4, 1), (4, 2), (1, 2),
                                                          (2, 2), (1, 1))] == [2, 4, 2, 1, 1, 1]
    assert tp_refusal("main", 2, 1) is None and tp_refusal("relay", 1, 4) is None
    assert tp_refusal("main", 3, 2) == (
        "the main runs --tp-size 3, this prefill --tp-size 2: SGLang's PD pairs prefill and "
        "decode ranks by whole ratios, so one TP size must divide the other (e.g. 1, 2, 4, 8)")


def test_a_main_at_twice_prefills_tp_gets_each_rank_its_heads_and_each_rank_is_told_apart():
    kv = SlicingKv(attn_tp_size=1)
    fanout = make_fanout(kv)
    opened(kv, 5)
    register(fanout, kv, 5, RELAY, "relay")  # the relay at prefill's TP: the room starts
    assert poll_name(kv.request_status[5]) == "WaitingForInput"
    register(fanout, kv, 5, MAIN_RANKS[0], "main", tp=2, rank=0, prefix=4)
    fanout.take_chunk(chunk(5, 0, 10, last=True))
    drain(fanout)
    assert fanout._rooms[5].awaits_main()  # one of main's two ranks: its chunks are kept
    register(fanout, kv, 5, MAIN_RANKS[1], "main", tp=2, rank=1, prefix=4)  # replayed to it
    assert not fanout._rooms[5].awaits_main()
    assert sorted(w.session for w in main_works(fanout, 5)) == sorted(MAIN_RANKS)
    for work in main_works(fanout, 5):
        assert work.chunk.prefill_kv_indices.tolist() == list(range(4, 10))  # past its prefix
    send_all(fanout, kv, fanout.local_queues[1])
    send_all(fanout, kv, main_works(fanout, 5))
    assert kv.sent_kv == [(RELAY, 0, 10)]  # the relay: whole pages, SGLang's send_kvcache
    assert sorted((s, rank, pages) for s, rank, pages, _ in kv.sliced) == [
        (MAIN_RANKS[0], 0, 6), (MAIN_RANKS[1], 1, 6)]
    assert all(executor is tp_slices.SAME_THREAD for *_, executor in kv.sliced)
    told = sorted((targets[0][1], status) for targets, room, status in kv.messages)
    assert told == [(1001, "Success"), (2002, "Success"), (2003, "Success")]
    assert poll_name(kv.request_status[5]) == "Success"


def test_a_relay_at_twice_prefills_tp_starts_the_room_only_with_both_ranks():
    kv = SlicingKv(attn_tp_size=1)
    fanout = make_fanout(kv)
    opened(kv, 6)
    register(fanout, kv, 6, "127.0.0.1:1001", "relay", tp=2, rank=0)
    assert poll_name(kv.request_status[6]) == "Bootstrapping"
    register(fanout, kv, 6, "127.0.0.1:1002", "relay", tp=2, rank=1)
    assert poll_name(kv.request_status[6]) == "WaitingForInput"
    register(fanout, kv, 6, "127.0.0.1:1003", "relay", tp=2, rank=1)  # a third: refused
    assert kv.messages[-1] == ((("127.0.0.1", 1003),), 6, "Failed")
    assert len(fanout._rooms[6].destinations) == 2
    fanout.take_chunk(chunk(6, 0, 4, last=True))
    drain(fanout)
    relay_work = fanout.local_queues[0]
    send_all(fanout, kv, relay_work)
    layers = {type(executor) for *_, executor in kv.sliced}
    assert layers == {tp_slices.LedgerScoped} and len(kv.sliced) == 2


def test_a_main_dropped_with_one_rank_registered_fails_that_rank_too():
    kv = SlicingKv(attn_tp_size=1)
    fanout = make_fanout(kv)
    fanout.main_bootstrap_timeout_s = 3.0
    opened(kv, 7)
    register(fanout, kv, 7, RELAY, "relay")
    register(fanout, kv, 7, MAIN_RANKS[0], "main", tp=2, rank=0)
    fanout.take_chunk(chunk(7, 0, 4, last=True))
    drain(fanout)
    send_all(fanout, kv, fanout.local_queues[1])
    send_all(fanout, kv, main_works(fanout, 7))  # main's rank 0 has its KV, rank 1 never came
    assert kv.messages == [((("127.0.0.1", 1001),), 7, "Success")]  # only the relay is told
    fanout.tick(now=fanout._rooms[7].first_hello_at + 4)
    assert kv.messages[-1] == ((("127.0.0.1", 2002),), 7, "Failed")  # not Success for a half
    assert poll_name(kv.request_status[7]) == "Success"  # the relay answers alone
    assert fanout.published["mains_dropped"] == 1


def test_sizes_sglang_cannot_pair_are_refused_naming_both(caplog):
    kv = SlicingKv(attn_tp_size=2)
    fanout = make_fanout(kv)
    register(fanout, kv, 8, MAIN_RANKS[0], "main", tp=3, destinations=1)
    assert fanout.published["refused_hellos"] == 1 and 8 not in fanout.pdd_rooms
    assert kv.messages[-1] == ((("127.0.0.1", 2002),), 8, "Failed")
    assert "tp_size_incompatible: the main runs --tp-size 3, this prefill --tp-size 2" in caplog.text
    register(fanout, kv, 9, MAIN_RANKS[0], "main", tp=1, destinations=1)  # half of prefill's
    assert len(fanout._rooms[9].destinations) == 1 and 9 in fanout.pdd_rooms


def test_an_mla_dummy_registration_gets_no_kv_and_is_told_nothing():
    """MLA with prefill TP above the decode's: SGLang's decode rank pulls from one prefill rank
    and registers as a dummy with the others; this prefill rank then only concludes the room."""
    kv = SlicingKv(attn_tp_size=2)
    kv.is_mla_backend = True
    fanout = make_fanout(kv)
    opened(kv, 10)
    register(fanout, kv, 10, RELAY, "relay", tp=1, dummy=True)
    register(fanout, kv, 10, MAIN_RANKS[0], "main", tp=1, dummy=True)
    assert poll_name(kv.request_status[10]) == "WaitingForInput"
    fanout.take_chunk(chunk(10, 0, 4))
    drain(fanout)
    assert poll_name(kv.request_status[10]) == "WaitingForInput"
    fanout.take_chunk(chunk(10, 4, 8, last=True))
    drain(fanout)
    assert not fanout.local_queues[0] and not fanout.local_queues[1]
    assert not fanout._rooms[10].in_flight  # nothing for any sender
    assert kv.messages == [] and poll_name(kv.request_status[10]) == "Success"


def test_a_page_carries_the_destination_ranks_heads():
    kv = SimpleNamespace(is_mla_backend=False, attn_tp_size=1, kv_args=SimpleNamespace(
        kv_item_lens=[256] * 4, total_kv_head_num=2, kv_head_num=2, engine_rank=0))
    half = SimpleNamespace(dst_attn_tp_size=2, dst_tp_rank=1)
    assert tp_slices.page_bytes_to(kv, half) == 512 and tp_slices.page_bytes_to(kv, None) == 1024
    assert tp_slices.page_bytes_to(kv, SimpleNamespace(dst_attn_tp_size=1, dst_tp_rank=0)) == 1024
    quarter = SimpleNamespace(dst_attn_tp_size=4, dst_tp_rank=3)  # 2 heads, 4 ranks: replicas
    assert tp_slices.page_bytes_to(kv, quarter) == 512  # one whole head each
    prefill_rank = SimpleNamespace(is_mla_backend=False, attn_tp_size=2, kv_args=SimpleNamespace(
        kv_item_lens=[128] * 4, total_kv_head_num=2, kv_head_num=1, engine_rank=1))
    assert tp_slices.page_bytes_to(prefill_rank, SimpleNamespace(dst_attn_tp_size=1,
                                                                 dst_tp_rank=0)) == 512


def test_the_same_thread_executor_and_the_ledger_scope():
    from pdd_sglang.prefill.ledger import LEDGER, TransferLedger

    future = tp_slices.SAME_THREAD.submit(lambda x: (x, threading.current_thread()), 3)
    assert future.done() and future.result() == (3, threading.current_thread())
    failed = tp_slices.SAME_THREAD.submit(lambda: 1 / 0)
    assert isinstance(failed.exception(), ZeroDivisionError)
    assert list(concurrent.futures.as_completed([future, failed])) != []

    ledger = TransferLedger()
    ledger.set_role("s", "relay")
    ledger.begin(77, "s", 3)
    scope = ledger.scope()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # a worker thread has no scope ...
        pool.submit(ledger.record_batch, "s", [5]).result()
        pool.submit(ledger.run_in_scope, scope, ledger.record_batch, "s", [7]).result()
    row = next(r for r in ledger.snapshot()["by_request"] if r["room"] == 77)
    assert row["bytes"] == 7 and ledger.snapshot()["by_destination"]["s"]["bytes"] == 12
    assert isinstance(LEDGER, TransferLedger)


class Mooncake:
    """Mooncake's asynchronous API, as the WAN engine uses it: every block lands at once."""

    def __init__(self):
        self.writes: list = []  # (thread, session, length)
        self.synchronous = 0

    def transfer_submit_write(self, session, src, dst, length):
        self.writes.append((threading.current_thread().name, session, length))
        return len(self.writes)

    def transfer_check_status(self, batch):
        return 1

    def batch_transfer_sync_write(self, *args):
        self.synchronous += 1
        return 0


def test_sglangs_sliced_send_to_a_main_joins_the_senders_windowed_wan_copy():
    """SGLang's ``send_kvcache_slice`` (installed, patched by 0019) with the senders' executor:
    every token slot of every layer goes to the WAN engine as part of the sender thread's copy
    (asynchronous submissions within the window), none as a synchronous batch of its own, and
    the ledger has every byte for the request."""
    from sglang.srt.disaggregation.common.conn import CommonKVManager
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

    from pdd_sglang.prefill.ledger import LEDGER
    from pdd_sglang.prefill.wan_engine import WanTransferEngine

    mooncake = Mooncake()
    wan = WanTransferEngine.over(mooncake, timeout_s=5.0, window_bytes=1 << 20)
    relay_engine = SimpleNamespace(batch_transfer_sync=lambda *a: pytest.fail("relay engine"))
    layers, heads, head_bytes = 2, 2, 64
    kv = SimpleNamespace(
        kv_args=SimpleNamespace(kv_item_lens=[heads * head_bytes] * 2 * layers, page_size=1,
                                total_kv_head_num=heads, kv_head_num=heads, engine_rank=0,
                                kv_data_ptrs=[(i + 1) << 20 for i in range(2 * layers)],
                                kv_layer_ids=None, prefill_start_layer=0),
        attn_tp_size=1, pp_size=1, engine=relay_engine,
        pdd_fanout=SimpleNamespace(engine_for=lambda s: wan if s == "main-1" else relay_engine))
    kv.get_mha_kv_ptrs_with_pp = CommonKVManager.get_mha_kv_ptrs_with_pp.__get__(kv)
    kv._await_transfer_futures = MooncakeKVManager._await_transfer_futures.__get__(kv)
    kv.enable_deferred_decode_kv_release = False
    tokens = 5
    LEDGER.set_role("main-1", "main")
    LEDGER.begin(4242, "main-1", tokens)
    with wan.copy("main-1") as copy:
        ret = MooncakeKVManager.send_kvcache_slice(
            kv, "main-1", np.arange(tokens, dtype=np.int32), [1 << 30] * 2 * layers,
            np.arange(tokens, dtype=np.int32), 1, 2, head_bytes, tp_slices.SAME_THREAD)
        assert ret == 0 and copy.finish()
    me = threading.current_thread().name
    assert mooncake.synchronous == 0
    assert mooncake.writes == [(me, "main-1", head_bytes)] * (tokens * 2 * layers)
    row = next(r for r in LEDGER.snapshot()["by_request"] if r["room"] == 4242)
    assert row["bytes"] == tokens * 2 * layers * head_bytes  # half the heads of every slot
