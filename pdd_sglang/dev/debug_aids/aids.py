"""The aids the ``--pdd-debug-*`` flags ask for, at the points of :mod:`pdd_sglang.seam`."""

from __future__ import annotations

import time
from typing import Any, Optional

from pdd_sglang import seam
from pdd_sglang.dev.debug_aids.controls import controls_for
from pdd_sglang.dev.debug_aids.handoff_hold import HandoffHold


class DebugAids(seam.Aids):
    """Each aid on only when asked; a point whose aid is off is the seam's no-op."""

    def __init__(self, handoff_hold: bool = False, corrupt_wan_kv: bool = False,
                 wan_delay_s: float = 0.0, wan_blocking_wait: bool = False):
        self.hold = HandoffHold() if handoff_hold else None
        self.corrupt_wan_kv = corrupt_wan_kv
        self.wan_delay_s = wan_delay_s
        self.wan_blocking_wait = wan_blocking_wait

    @classmethod
    def from_args(cls, args: Any) -> Optional["DebugAids"]:
        """The aids ``args`` ask for; None when they ask for none."""
        from pdd_sglang.dev.debug_aids.flags import check

        check(args)
        aids = cls(handoff_hold=bool(getattr(args, "pdd_debug_handoff_hold", False)),
                   corrupt_wan_kv=bool(getattr(args, "pdd_debug_corrupt_wan_kv", False)),
                   wan_delay_s=float(getattr(args, "pdd_debug_wan_delay_ms", 0) or 0) / 1e3,
                   wan_blocking_wait=bool(getattr(args, "pdd_debug_wan_blocking_wait", False)))
        return aids if aids.asked() else None

    def asked(self) -> list[str]:
        return [name for name, on in (
            ("handoff hold", self.hold is not None), ("corrupt WAN KV", self.corrupt_wan_kv),
            (f"WAN delay {self.wan_delay_s * 1e3:.0f} ms", self.wan_delay_s > 0),
            ("WAN blocking wait", self.wan_blocking_wait)) if on]

    def __str__(self) -> str:
        return ", ".join(self.asked()) or "none"

    # ---- relay: the handoff hold ----------------------------------------------------------
    def relay_hand_off(self, relay: Any, running_batch: Any, now: float, hand_off) -> Any:
        if self.hold is None:
            return hand_off(running_batch, now)
        return self.hold.around_hand_off(relay, running_batch, now, hand_off)

    # ---- main: a damaged WAN copy -----------------------------------------------------------
    def main_wan_kv_landed(self, main: Any, req: Any, start: int) -> None:
        if (self.corrupt_wan_kv and controls_for(req).corrupt_wan_kv
                and start < len(req.origin_input_ids)):
            corrupt_one_value(main.scheduler, req, start)

    def main_staged_kv(self, req: Any, view: Any) -> None:
        if self.corrupt_wan_kv and req is not None and controls_for(req).corrupt_wan_frame:
            corrupt_last_record(view)

    # ---- prefill: a slow WAN path, Mooncake's own wait ---------------------------------------
    def before_send(self, work: Any) -> None:
        # Every chunk to a main waits, so the relay reliably runs ahead of main (forced handoff
        # points, the singular filter): the delay counts from when it was queued on its main's
        # line, whose one sender takes chunks one after another, so concurrent requests' chunks
        # are each late by the delay, not by the delays of every chunk ahead of them.
        if self.wan_delay_s > 0 and work.role == "main":
            queued_at = getattr(work, "queued_at", 0.0) or time.monotonic()
            time.sleep(max(0.0, queued_at + self.wan_delay_s - time.monotonic()))

    def wan_engine_opened(self, engine: Any) -> None:
        if self.wan_blocking_wait:
            wait_inside_mooncake(engine)


def corrupt_one_value(scheduler: Any, req: Any, position: int) -> None:
    """Change the first K value of one prompt position in place (a flipped WAN byte)."""
    slot = int(scheduler.req_to_token_pool.req_to_token[req.kv.req_pool_idx, position])
    pool = scheduler.token_to_kv_pool_allocator.get_kvcache()
    pool.get_key_buffer(pool.start_layer)[slot].view(-1)[0] += 1.0


def corrupt_last_record(frame: Any) -> None:
    """Flip the last byte of a packed record's frame (its payload: a flipped WAN bit)."""
    if len(frame):
        frame[len(frame) - 1] ^= 0xFF


def wait_inside_mooncake(engine: Any) -> None:
    """Make a WAN engine (:class:`pdd_sglang.prefill.wan_engine.WanTransferEngine`) write each
    batch SGLang's transfer code hands it with Mooncake's synchronous call, which polls without
    sleeping: the wait before the asynchronous, windowed WAN path, for the benchmark that compares
    the two (``scripts/bench_wan_cpu.py``). The line's accounting stays as the engine keeps it."""
    mooncake, line = engine.engine, engine.line

    def batch_transfer_sync(session_id: str, buffers, peer_addresses, lengths) -> int:
        nbytes = int(sum(lengths))
        started_at = line.started(session_id, nbytes)
        ok = mooncake.batch_transfer_sync_write(session_id, list(buffers), list(peer_addresses),
                                                list(lengths)) == 0
        line.finished(session_id, nbytes, started_at, ok)
        return 0 if ok else -1

    engine.batch_transfer_sync = batch_transfer_sync
