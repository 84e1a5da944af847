"""The reason a PDD prefill tells a destination reaches that decode's error (issue 23).

SGLang's Mooncake KV manager leaves the reason frame out of its status message, so a decode told
Failed reported "Failed to get kvcache from prefill instance, it might be dead" whatever the
prefill said (a refused hello of another TP size, a dropped main). The fan-out turns the frame on
for its prefill; SGLang's own decode-side parser and failure record (the installed code) read it.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

from fanout_harness import MAIN, Kv, drain, hello_frames, make_fanout

from pdd_sglang.protocol.messages import DestinationHello, encode


class WireKv(Kv):
    """The harness KV manager, but its status messages are encoded as SGLang encodes them."""

    attn_tp_rank, attn_cp_rank, attn_cp_size, pp_rank, pp_size = 0, 0, 1, 0, 1
    kv_status_msg_tag = None

    def __init__(self):
        from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

        super().__init__()
        self.kv_status_msg_carries_reason = MooncakeKVManager.kv_status_msg_carries_reason
        self.wire: list = []

    def _prefill_unique_rank(self):
        from sglang.srt.disaggregation.common.conn import CommonKVManager

        return CommonKVManager._prefill_unique_rank(self)

    def send_kv_status_message(self, *, targets, bootstrap_room, status, failure_reason=None):
        from sglang.srt.disaggregation.common.conn import CommonKVManager

        super().send_kv_status_message(targets=targets, bootstrap_room=bootstrap_room,
                                       status=status, failure_reason=failure_reason)
        self.wire.append(CommonKVManager._encode_kv_status_message(
            self, bootstrap_room=bootstrap_room, status=status, failure_reason=failure_reason))


def decode_side_error(parts: list, room: int) -> str:
    """What SGLang's decode (its status parser, failure record and receiver) makes of ``parts``:
    the message of the KVTransferError its request is aborted with."""
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.common.conn import CommonKVManager
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

    decode = SimpleNamespace(request_status={room: KVPoll.WaitingForInput}, failure_records={},
                             failure_lock=threading.Lock(), defer_decode_allocation=False,
                             deferred_bootstrap=None, kv_status_msg_tag=None,
                             DEFAULT_PREFILL_FAILURE_REASON=(
                                 MooncakeKVManager.DEFAULT_PREFILL_FAILURE_REASON))
    decode.record_failure = lambda r, why: CommonKVManager.record_failure(decode, r, why)
    decode.update_status = lambda r, s: CommonKVManager.update_status(decode, r, s)
    room_, status, rank, reason = CommonKVManager.parse_kv_status_message(decode, parts)
    CommonKVManager.apply_prefill_status(decode, bootstrap_room=room_, status=status,
                                         prefill_rank=rank, failure_reason=reason)
    assert decode.request_status[room] == KVPoll.Failed
    return decode.failure_records[room]


def refuse_a_tp_3_main(kv) -> list:
    """A TP 3 main against a TP 2 prefill: neither size divides the other (issue 37)."""
    kv.attn_tp_size = 2
    fanout = make_fanout(kv)
    frames = hello_frames(kv, 7, MAIN, "main")
    frames[-1] = encode(DestinationHello(room=7, role="main", destinations=2, prefix_tokens=0,
                                         tp_size=3))
    assert fanout.claim_registration(7, MAIN, frames)
    drain(fanout)
    assert fanout.published["refused_hellos"] == 1
    return kv.wire[-1]


def test_a_refused_hello_reaches_the_decode_with_its_reason():
    parts = refuse_a_tp_3_main(WireKv())
    assert decode_side_error(parts, 7) == (
        "PDD: hello refused: tp_size_incompatible: the main runs --tp-size 3, this prefill "
        "--tp-size 2: SGLang's PD pairs prefill and decode ranks by whole ratios, so one TP size "
        "must divide the other (e.g. 1, 2, 4, 8)")


def test_without_the_fan_out_mooncake_drops_the_reason():
    """Why the fan-out sets the flag: SGLang's Mooncake manager alone loses the reason."""
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.common.conn import CommonKVManager
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

    kv = WireKv()
    parts = CommonKVManager._encode_kv_status_message(
        kv, bootstrap_room=7, status=KVPoll.Failed, failure_reason="PDD: hello refused: why")
    assert decode_side_error(parts, 7) == MooncakeKVManager.DEFAULT_PREFILL_FAILURE_REASON


def test_a_success_message_still_parses_with_the_empty_reason_frame():
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.common.conn import CommonKVManager

    kv = WireKv()
    make_fanout(kv)
    parts = CommonKVManager._encode_kv_status_message(
        kv, bootstrap_room=9, status=KVPoll.Success, failure_reason=None)
    assert len(parts) == 4 and parts[3] == b""
    assert CommonKVManager.parse_kv_status_message(kv, parts) == (9, KVPoll.Success, 0, None)
