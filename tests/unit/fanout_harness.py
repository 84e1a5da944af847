"""A stand-in for SGLang's Mooncake KV manager, and helpers to drive the prefill fan-out's owner.

The stand-in keeps SGLang's own tables and runs SGLang's own ``update_status`` /
``conclude_transfer`` / ``add_transfer_request`` (the installed, patched code), and records which
thread wrote each table. Sends succeed unless a test says otherwise.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from types import SimpleNamespace

import numpy as np

from pdd_sglang.prefill.fanout import HELLO_FRAME_INDEX, PrefillFanout
from pdd_sglang.prefill.wan_engine import WanTransferEngine
from pdd_sglang.prefill.wan_lines import WanLines
from pdd_sglang.protocol.messages import DestinationHello, encode

LINE_BYTES_PER_S = 10e9 / 8  # the declared line the harness's WAN lines order copies by

RELAY, MAIN = "127.0.0.1:1001", "127.0.0.1:2002"


class WriteLog(dict):
    """A dict that records the thread of every write (SGLang's tables, watched)."""

    def __init__(self, log, name):
        super().__init__()
        self._log, self._name = log, name

    def __setitem__(self, key, value):
        self._log.append((self._name, threading.current_thread().name))
        super().__setitem__(key, value)

    def pop(self, *args):
        self._log.append((self._name, threading.current_thread().name))
        return super().pop(*args)


class Kv:
    """SGLang's MooncakeKVManager as far as the fan-out, its senders and patches touch it."""

    def __init__(self, queues=4, page_size=1):
        from sglang.srt.disaggregation.utils import DisaggregationMode

        self.writes: list = []
        self.kv_args = SimpleNamespace(page_size=page_size, kv_item_lens=[100, 100],
                                       kv_data_ptrs=[1, 2], aux_data_ptrs=[3])
        self.transfer_infos = WriteLog(self.writes, "transfer_infos")
        self.req_to_decode_prefix_len = WriteLog(self.writes, "req_to_decode_prefix_len")
        self.request_status = WriteLog(self.writes, "request_status")
        self._staging_outstanding = defaultdict(int)
        self.failure_records, self.failure_lock = {}, threading.Lock()
        self.deferred_bootstrap = None
        self._deferred_ack_targets, self._deferred_ack_poisoned_rooms = {}, set()
        self.transfer_queues = [SimpleNamespace(items=[]) for _ in range(queues)]
        for q in self.transfer_queues:
            q.put = q.items.append
        self.disaggregation_mode = DisaggregationMode.PREFILL
        self.is_mla_backend, self.attn_tp_size = False, 1
        self.decode_kv_args_table = {}
        self.messages: list = []  # (targets, room, status name)
        self.sent_kv: list = []  # (session, first source page, pages)
        self.fail_kv, self.fail_aux = set(), set()  # sessions whose sends fail
        self.engine = SimpleNamespace(name="sglang-engine")
        self.enable_deferred_decode_kv_release = True
        self.abort_acks: list = []  # (room, decode ip, decode port, generation) sent

    def handle_abort(self, room, session, generation=1):
        """A decode's ABORT of ``room`` (it registered as ``session``), as SGLang's bootstrap
        thread handles it: the installed, patched ``_handle_abort_notification``."""
        from sglang.srt.disaggregation.common.conn import AbortNotification
        from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

        ip, port = session.rsplit(":", 1)
        msg = AbortNotification(room=room, decode_ip=ip, decode_port=int(port),
                                generation=generation).to_zmq()
        assert MooncakeKVManager._handle_abort_notification(self, msg)

    def _send_abort_ack(self, room, target):
        self.abort_acks.append((room, target.ip, target.port, target.generation))

    def __getattr__(self, name):
        # SGLang's deferred-ack bookkeeping, run as the installed code has it.
        from sglang.srt.disaggregation.common.conn import CommonKVManager

        if name in ("_handle_deferred_abort_notification", "_handle_legacy_abort_notification",
                    "register_deferred_ack_target", "_maybe_ack_drained_abort",
                    "_send_abort_acks", "poison_deferred_ack_room"):
            from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

            return getattr(MooncakeKVManager, name).__get__(self)
        raise AttributeError(name)

    # SGLang's own logic, from the installed (patched) wheel.
    def update_status(self, room, status):
        from sglang.srt.disaggregation.common.conn import CommonKVManager

        return CommonKVManager.update_status(self, room, status)

    def conclude_transfer(self, **kwargs):
        from sglang.srt.disaggregation.common.conn import CommonKVManager

        return CommonKVManager.conclude_transfer(self, **kwargs)

    def add_transfer_request(self, *args, **kwargs):
        from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

        return MooncakeKVManager.add_transfer_request(self, *args, **kwargs)

    def check_status(self, room):
        return self.request_status[room]

    def send_kv_status_message(self, *, targets, bootstrap_room, status, failure_reason=None):
        if targets:  # as SGLang's: nothing to send to nobody
            self.messages.append((tuple(targets), bootstrap_room, poll_name(status)))

    def send_kvcache(self, session, src, dst_ptrs, dst, executor, **kwargs):
        self.sent_kv.append((session, int(src[0]) if len(src) else None, len(src)))
        return -1 if session in self.fail_kv else 0

    def send_aux(self, info, aux_index, dst_aux_ptrs):
        return -1 if info.mooncake_session_id in self.fail_aux else 0


def poll_name(status) -> str:
    """SGLang's KVPoll is a class of int constants: the constant's name."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    return next(k for k, v in vars(KVPoll).items() if v == status and not k.startswith("_"))


def make_fanout(kv, local=2):
    """A fan-out whose queues are lists and whose peer jobs run inline."""
    fanout = PrefillFanout(kv, LINE_BYTES_PER_S)
    fanout.local_queues = [ListQueue() for _ in range(local)]
    fanout.wan_lines = ListLines()
    fanout.wan_line.queue_view = fanout.wan_lines.queued_by_class
    # The WAN engine's windowed copy over no Mooncake: the harness's send_kvcache records what
    # it was asked to send and hands the engine nothing, so each copy ends with nothing in flight.
    fanout.wan_engine = WanTransferEngine.over(engine=None, timeout_s=60.0)
    kv.pdd_fanout = fanout
    return fanout


class ListLines(list):
    """The fan-out's WanLines, with its works also in one list in arrival order, which tests pop
    and send by hand (a popped work leaves the real lines' queue too)."""

    def __init__(self):
        super().__init__()
        self.lines = WanLines(LINE_BYTES_PER_S)

    def put(self, work, nbytes, pages, copy_class):
        self.lines.put(work, nbytes, pages, copy_class)
        self.append(work)

    def pop(self, index=-1):
        work = super().pop(index)
        self.lines._lines[work.session].queued.remove(work)
        return work

    def reclassify(self, room, copy_class):
        return self.lines.reclassify(room, copy_class)

    def uncover(self, room):
        return self.lines.uncover(room)

    def drop_cache_only(self, session, keep_bytes):
        return self.lines.drop_cache_only(session, keep_bytes)

    def queued_by_class(self):
        return self.lines.queued_by_class()

    def stop(self):
        self.lines.stop()


class ListQueue(list):
    def put(self, item, charges=()):
        self.append(item)


def hello_frames(kv, room, session, role, prefix=0, destinations=2):
    port = int(session.rsplit(":", 1)[1])
    kv.decode_kv_args_table[session] = SimpleNamespace(
        dst_kv_ptrs=[0], dst_aux_ptrs=[0], dst_attn_tp_size=1, dst_kv_layer_ids=None,
        dst_kv_item_len=None, dst_tp_rank=0)
    frames = [str(room).encode(), b"127.0.0.1", str(port).encode(), session.encode(),
              np.arange(4096, dtype=np.int32).tobytes(), b"0", b"", str(destinations).encode(),
              str(prefix).encode(), b""]
    return frames + [encode(DestinationHello(room=room, role=role, destinations=destinations,
                                             prefix_tokens=prefix))]


def register(fanout, kv, room, session, role, prefix=0, destinations=2, pump=True):
    """What SGLang's bootstrap thread does with a PDD destination's registration (patch 0006)."""
    assert len(hello_frames(kv, room, session, role)) == HELLO_FRAME_INDEX + 1
    claimed = fanout.claim_registration(room, session,
                                        hello_frames(kv, room, session, role, prefix, destinations))
    assert claimed
    if pump:
        drain(fanout)


def drain(fanout):
    """Run the owner until no event is left (the test thread plays the owner thread)."""
    import queue as queue_module

    while True:
        try:
            event = fanout.events.get_nowait()
        except queue_module.Empty:
            return
        fanout.handle(event)


def chunk(room, start, stop, last=False):
    from sglang.srt.disaggregation.common.utils import TransferKVChunk

    return TransferKVChunk(room=room, prefill_kv_indices=np.arange(start, stop, dtype=np.int32),
                           index_slice=slice(start, stop), is_last_chunk=last,
                           prefill_aux_index=0 if last else None, state_indices=None)


def send_all(fanout, kv, queue):
    """A sender's work, one item at a time, reported back to the owner."""
    from pdd_sglang.prefill.events import ChunkSent
    from pdd_sglang.prefill.senders import send_work

    while queue:
        work = queue.pop(0)
        ok, reason = send_work(kv, work, None)
        fanout.events.put(ChunkSent(work, ok, reason))
    drain(fanout)
