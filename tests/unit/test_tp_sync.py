"""TP > 1 on a decode server (issue 23): only TP rank 0 opens the control channel, and each
handoff step's inputs are rank 0's on every rank (:mod:`pdd_sglang.decode.tp_sync`).

The TP group is a stand-in and SGLang's ``broadcast_pyobj`` is replaced by a function that hands
every rank what rank 0 passed, as it does over the TP CPU group; the two real ranks run in
``tests/integration/test_tp.py``.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from pdd_sglang.decode.tp_sync import FollowerLoop, RankInputs
from pdd_sglang.protocol.messages import HandoffReady

from test_handoff_lifecycle import ARGS, control_threads


class Loop:
    def __init__(self, messages):
        self.messages, self.alive = list(messages), True

    def received(self):
        got, self.messages = self.messages, []
        return got


def group(rank: int) -> SimpleNamespace:
    return SimpleNamespace(world_size=2, rank_in_group=rank, rank=10 + rank, ranks=[10, 11],
                           cpu_group="cpu-group")


@pytest.fixture
def wire(monkeypatch):
    """A broadcast over two ranks: rank 0's data, recorded; every rank gets it."""
    import sglang.srt.utils as utils

    sent = []

    def broadcast_pyobj(data, rank, dist_group, src=0, force_cpu_device=True):
        assert dist_group == "cpu-group" and src == 10
        if rank == src:
            sent.append(data)
            return data
        assert data == []  # a follower brings nothing
        return sent[-1]

    monkeypatch.setattr(utils, "broadcast_pyobj", broadcast_pyobj)
    return sent


def test_at_tp_1_the_step_reads_its_own_loop_and_clock():
    ranks = RankInputs()
    assert ranks.size == 1 and ranks.leader
    messages, now, alive = ranks.share(Loop([("peer", HandoffReady(room=1))]))
    assert messages == [("peer", HandoffReady(room=1))] and now > 0 and alive


def test_every_rank_gets_rank_0s_messages_clock_and_channel_state(wire):
    leader, follower = RankInputs(group(0)), RankInputs(group(1))
    assert leader.leader and not follower.leader and follower.size == 2
    loop = Loop([(b"main-1", HandoffReady(room=7))])
    loop.alive = False
    got0 = leader.share(loop)
    got1 = follower.share(FollowerLoop())
    assert got0 == got1 and got1[0] == [(b"main-1", HandoffReady(room=7))] and got1[2] is False
    assert loop.messages == []  # drained once, by rank 0


def test_a_follower_loop_receives_and_sends_nothing():
    loop = FollowerLoop()
    loop.send(b"peer", HandoffReady(room=1))
    assert loop.received() == [] and loop.alive and loop.address is None
    assert dict(loop.refusals) == {}
    loop.close()


def test_only_rank_0_of_a_relay_binds_the_control_channel(monkeypatch):
    from pdd_sglang.decode import tp_sync
    from pdd_sglang.decode.relay import RelayHandoff

    before = threading.active_count()
    monkeypatch.setattr(tp_sync, "_tp_group", lambda: group(1))
    relay = RelayHandoff(SimpleNamespace(), SimpleNamespace(**ARGS))
    assert isinstance(relay.loop, FollowerLoop) and control_threads() == 0
    assert relay.state()["control_address"] is None
    relay.close()
    assert threading.active_count() <= before


def test_a_decode_rank_declares_its_tp_size_and_logs_a_size_prefill_refuses(monkeypatch, caplog):
    from pdd_sglang.decode import destination
    from pdd_sglang.protocol.messages import DestinationHello, decode

    monkeypatch.setattr(destination, "this_server_role", lambda: "main")
    receiver = SimpleNamespace(
        pdd_route=SimpleNamespace(destinations=2), bootstrap_room=3, required_dst_info_num=1,
        kv_mgr=SimpleNamespace(attn_tp_size=2), prefill_info=SimpleNamespace(attn_tp_size=2))
    count, frames = destination.receiver_metadata(receiver, 16)
    hello = decode(frames[0], expect=DestinationHello)
    assert count == 2 and hello.tp_size == 2 and hello.prefix_tokens == 16
    assert "will fail" not in caplog.text
    receiver.prefill_info = SimpleNamespace(attn_tp_size=1)  # SGLang pairs 2 with 1 (issue 37)
    destination.receiver_metadata(receiver, 16)
    assert "will fail" not in caplog.text
    receiver.prefill_info = SimpleNamespace(attn_tp_size=3)
    destination.receiver_metadata(receiver, 16)
    assert "will fail: the main runs --tp-size 2, this prefill --tp-size 3" in caplog.text


class Hashes:
    """A room's ``kv_digest.PendingHashes`` on one rank: its part, ready or not."""

    def __init__(self, part: bytes, ready: bool = True):
        self._part, self._ready = part, ready

    def ready(self):
        return self._ready

    def part(self):
        return self._part


def test_the_whole_kvs_hashes_wait_for_every_rank_and_combine_their_heads(monkeypatch):
    """Each rank's parts of each room's hashes are gathered; a room is ready once every rank
    has hashed it, and its hashes are every rank's parts combined (issue 37)."""
    import torch.distributed as dist

    from pdd_sglang.diagnostics.kv_digest import combine

    other_rank = {}  # what rank 1 contributes this step

    def all_gather_object(out, obj, group=None):
        assert group == "cpu-group"
        out[0], out[1] = obj, other_rank

    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    mine, theirs = bytes(range(16)), bytes(range(16, 32))
    ranks = RankInputs(group(0))
    other_rank.update({5: None, 6: theirs})
    got = ranks.whole_kv_hashes({5: Hashes(mine), 6: Hashes(mine)})
    assert got == {6: combine([mine, theirs])}  # room 5: rank 1 is still hashing
    other_rank.update({5: theirs})
    assert ranks.whole_kv_hashes({5: Hashes(mine, ready=False)}) == {}
    assert RankInputs().whole_kv_hashes({5: Hashes(mine)}) == {5: combine([mine])}  # TP 1
    assert ranks.whole_kv_hashes({}) == {}  # nothing awaited: no collective
