"""Real copies through the real WAN engine across the emulated line (issue 34: a copy fills the
line whatever its bandwidth-delay product).

The sender (cluster A) is the prefill's own :class:`~pdd_sglang.prefill.wan_engine.WanTransferEngine`
(Mooncake TCP), driven as a WAN sender drives it: a copy is a run of slices, each one
``batch_transfer_sync`` call of ``blocks_per_slice`` blocks (the KV of a slice's pages, per
layer, K and V), inside :meth:`WanTransferEngine.copy`. The receiver
(cluster B) is a plain Mooncake TCP engine with one registered buffer, as main's KV pool is. Per
point the sender runs one copy, then ``concurrent`` copies at once (one thread each, as the
prefill's WAN senders run), under each slice rule:

- ``one_slice``: 4 MiB slices and a window of one, the rule before: each slice waited for
  before the next (:data:`~pdd_sglang.prefill.wan_engine.ONE_SLICE`);
- ``window``: the slices and window :func:`~pdd_sglang.prefill.wan_engine.window_for_line` gives
  for the line as set (slices of four bandwidth-delay products, twelve more in flight).

The same sender, the same code path; only its slice and window differ. Before the timed copies, one
small copy warms the session (Mooncake's handshake, the first connection), and ``warm_copies``
untimed copies of each rule open its lanes' congestion windows (a serving prefill's pooled lanes
are warm).
"""

from __future__ import annotations

import argparse
import ctypes
import os

import numpy as np
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from pdd_sglang.dev.wan_emulator import WanLine, stream_reference
from pdd_sglang.dev.wan_emulator.handoff_peers import _mooncake, _report, _stdin_closed
from pdd_sglang.dev.wan_emulator.line import stop_process

if TYPE_CHECKING:
    from pdd_sglang.prefill.wan_engine import CopyWindow

PEER_READY_TIMEOUT_S = 120.0
RULES = ("one_slice", "window", "packed")
STREAM_COPIES = 3  # timed copies of the stream reference (stream_reference.py), after one warm
PAGE_BYTES = 64 << 10  # the notional page a packed record names (its header's page ids)


def run_receiver(args) -> None:
    engine, buffer, ptr, session = _mooncake(args.host, args.buffer_bytes)
    _report({"ready": True, "session_id": session, "buffer_ptr": ptr})
    _stdin_closed().wait()
    del engine, buffer


def _slices(copy_bytes: int, slice_bytes: int, blocks: int, offset: int):
    """Each slice's (offsets, lengths) within [offset, offset + copy_bytes)."""
    for start in range(0, copy_bytes, slice_bytes):
        size = min(slice_bytes, copy_bytes - start)
        step, extra = divmod(size, blocks)
        lengths = [step + (1 if i < extra else 0) for i in range(blocks) if step or i < extra]
        offsets = [offset + start + sum(lengths[:i]) for i in range(len(lengths))]
        yield offsets, lengths


def _one_copy(wan, session: str, src_ptr: int, dst_ptr: int, copy_bytes: int, offset: int,
              slice_bytes: int, blocks: int) -> float:
    """One-sided, as a sender writes into main's pages: each slice one request per KV buffer."""
    began = time.perf_counter()
    with wan.copy(session) as copy:
        for offsets, lengths in _slices(copy_bytes, slice_bytes, blocks, offset):
            if wan.batch_transfer_sync(session, [src_ptr + o for o in offsets],
                                       [dst_ptr + o for o in offsets], lengths) != 0:
                raise RuntimeError("a slice of the copy failed")
        if not copy.finish():
            raise RuntimeError("the copy failed")
    return time.perf_counter() - began


def _packed_copy(wan, session: str, src, dst_ptr: int, copy_bytes: int, offset: int) -> float:
    """Packed, as a sender writes an uncoded copy into main's staging range: records of the
    engine's ``block_bytes`` framed by the raw codec, written from the prefill's real send pool
    (:mod:`pdd_sglang.prefill.send_pool`), each a single request. ``dst_ptr + offset`` must
    hold the records' headers too (:func:`packed_bytes`)."""
    from pdd_sglang.kv_codec import RawCodec
    from pdd_sglang.kv_codec.wire import pack_record
    from pdd_sglang.prefill import wan_coded

    began = time.perf_counter()
    step, raw = wan_coded.record_bytes(wan), RawCodec()
    place_at, pool = dst_ptr + offset, wan_coded._pool(wan)
    with wan.copy(session) as copy:
        for seq, start in enumerate(range(offset, offset + copy_bytes, step)):
            data = src[start // 2:min(start + step, offset + copy_bytes) // 2]  # 2-byte elements
            frame = raw.encode(data)
            record = pack_record(1, seq, np.arange(len(data) // PAGE_BYTES), len(frame)) + frame
            if not pool.write(copy, record, place_at):
                raise RuntimeError("a record of the copy failed")
            place_at += len(record)
        if not copy.finish():
            raise RuntimeError("the copy failed")
    return time.perf_counter() - began


def packed_bytes(copy_bytes: int, block_bytes: int) -> int:
    """What a packed copy of ``copy_bytes`` puts on the wire at most: records' headers and
    page ids on top (one page a record at worst)."""
    from pdd_sglang.kv_codec.wire import record_overhead

    return (copy_bytes // PAGE_BYTES + 1) * (PAGE_BYTES + record_overhead(1))


def _rules(args) -> list:
    from pdd_sglang.prefill.wan_engine import ONE_SLICE, CopyWindow

    window = CopyWindow(args.slice_bytes, args.window_bytes, args.block_bytes)
    return [("one_slice", ONE_SLICE), ("window", window), ("packed", window)]


def run_sender(args) -> None:
    import torch

    from pdd_sglang.prefill import wan_coded
    from pdd_sglang.prefill.wan_engine import ONE_SLICE, WanTransferEngine

    wan = WanTransferEngine(args.host, "tcp", None, timeout_s=600.0)
    src = ctypes.create_string_buffer(args.buffer_bytes)
    src_ptr = ctypes.addressof(src)
    src_elements = torch.frombuffer(src, dtype=torch.float16)  # a KV dtype the raw frame carries
    wan.register_regions([(src_ptr, args.buffer_bytes)])
    session, dst_ptr = args.target_session, args.target_ptr
    _one_copy(wan, session, src_ptr, dst_ptr, 1 << 20, 0, ONE_SLICE.slice_bytes, args.blocks)
    span = packed_bytes(args.copy_bytes, args.block_bytes)  # a copy's room at the receiver
    runs = []
    for rule, window in _rules(args):
        wan.window_bytes, wan.slice_bytes = window.window_bytes, window.slice_bytes
        wan.block_bytes = window.block_bytes

        def copy_at(i: int) -> float:
            if rule == "packed":
                return _packed_copy(wan, session, src_elements, dst_ptr, args.copy_bytes, i * span)
            return _one_copy(wan, session, src_ptr, dst_ptr, args.copy_bytes, i * span,
                             window.slice_bytes, args.blocks)
        for _ in range(args.warm_copies):
            copy_at(0)
        for concurrent in sorted({1, args.concurrent}):
            seconds: list[float] = [0.0] * concurrent
            start = threading.Barrier(concurrent + 1)

            def timed(i: int) -> None:
                start.wait()
                seconds[i] = copy_at(i)
            threads = [threading.Thread(target=timed, args=(i,)) for i in range(concurrent)]
            for thread in threads:
                thread.start()
            start.wait()
            began = time.perf_counter()
            for thread in threads:
                thread.join()
            wall = time.perf_counter() - began
            runs.append({"rule": rule, "window_bytes": window.window_bytes,
                         "slice_bytes": window.slice_bytes,
                         "request_bytes": (wan_coded.record_bytes(wan) if rule == "packed"
                                           else window.slice_bytes // args.blocks),
                         "concurrent": concurrent, "copy_bytes": args.copy_bytes,
                         "wall_s": wall, "copy_s": seconds,
                         "achieved_mbit": concurrent * args.copy_bytes * 8 / wall / 1e6})
            time.sleep(args.pause_s)  # the line's queue drains between runs
    wan.close()
    _report({"runs": runs})


def tune(line: WanLine, sysctls: dict | None) -> None:
    """Set ``sysctls`` in both namespaces of a started line."""
    for side in ("a", "b"):
        for key, value in (sysctls or {}).items():
            subprocess.run([*line.exec_prefix(side), "sysctl", "-q", "-w", f"{key}={value}"],
                           check=True)


def line_goodput(line: WanLine, rtt_ms: float) -> float:
    """One bulk TCP stream's steady goodput (Mbit/s): slow start excluded, which takes about
    ten round trips to open a window of a long fat line's BDP, so the warm-up and the run scale
    with the RTT (a 1 s warm-up under-reads a 200 ms line)."""
    from pdd_sglang.dev.wan_emulator import measure

    warmup_s = max(1.0, 15 * rtt_ms / 1e3)
    seconds = warmup_s + max(3.0, 20 * rtt_ms / 1e3)
    return measure.bulk_rate(line, seconds=seconds, warmup_s=warmup_s)["steady_goodput_mbit"]


def run_point(out_dir: Path, *, rate_mbit: float, rtt_ms: float, copy_bytes: int,
              window: "CopyWindow", concurrent: int = 4, blocks: int = 8,
              sysctls: dict | None = None, log: Callable[[str], None] = print,
              warm_copies: int = 0) -> dict:
    """One grid point: a fresh line (``sysctls`` set in both namespaces), its bulk TCP goodput
    (the forwarder's own figure, as ``scripts/wan_check.py`` measures it), then a receiver in B
    and the sender in A, then the stream reference (:mod:`stream_reference`: the same copy over
    one warm ZMQ TCP stream, acknowledged once); returns ``{"goodput_mbit", "runs",
    "stream_copy_s"}``."""
    from pdd_sglang.dev.wan_emulator.handoff_bench import REPO, _read_json_line

    out_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                                     os.environ.get("PYTHONPATH")]))}
    buffer_bytes = packed_bytes(copy_bytes, window.block_bytes) * concurrent
    common = ["--buffer-bytes", str(buffer_bytes)]
    line = WanLine(rate_mbit, rtt_ms, 0.0, seed=3)
    receiver = sender = None
    tag = f"{rate_mbit:g}mbit_{rtt_ms:g}ms"
    logs = {name: open(out_dir / f"line_bench_{tag}_{name}.log", "ab")
            for name in ("receiver", "sender")}
    try:
        line.start(log_path=str(out_dir / f"line_bench_{tag}_line.log"))
        tune(line, sysctls)
        goodput_mbit = line_goodput(line, rtt_ms)
        module = [sys.executable, "-m", "pdd_sglang.dev.wan_emulator.line_bench"]
        receiver = line.popen("b", [*module, "receiver", "--host", line.address("b"), *common],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=logs["receiver"], env=env, text=True)
        target = _read_json_line(receiver, "receiver", PEER_READY_TIMEOUT_S)
        sender = line.popen("a", [*module, "sender", "--host", line.address("a"), *common,
                                  "--target-session", target["session_id"],
                                  "--target-ptr", str(target["buffer_ptr"]),
                                  "--copy-bytes", str(copy_bytes),
                                  "--window-bytes", str(window.window_bytes),
                                  "--block-bytes", str(window.block_bytes),
                                  "--slice-bytes", str(window.slice_bytes),
                                  "--concurrent", str(concurrent), "--blocks", str(blocks),
                                  "--warm-copies", str(warm_copies)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=logs["sender"], env=env, text=True)
        # The old rule at a long RTT is the slow one: a slice per round trip.
        copied = copy_bytes * (concurrent + 1 + warm_copies)  # per rule
        slices = copied / (4 << 20)
        budget = 3 * (2 * copied * 8 / (rate_mbit * 1e6)
                      + 2 * slices * (rtt_ms / 1e3 + 0.05)) + 120
        report = _read_json_line(sender, "sender", budget)
        stop_process(sender)
        stop_process(receiver)
        stream_s = stream_reference.measure(line, copy_bytes, STREAM_COPIES, 1, out_dir, tag, env)
    finally:
        stop_process(sender)
        stop_process(receiver)
        line.stop()
        for handle in logs.values():
            handle.close()
    for run in report["runs"]:
        log(f"  {rate_mbit:g} Mbit/s {rtt_ms:g} ms {run['rule']:>9} x{run['concurrent']}: "
            f"{run['achieved_mbit']:.1f} Mbit/s of {goodput_mbit:.1f} ({run['wall_s']:.1f} s)")
    log(f"  {rate_mbit:g} Mbit/s {rtt_ms:g} ms stream reference: "
        + ", ".join(f"{copy_bytes * 8 / s / 1e6:.1f}" for s in stream_s) + " Mbit/s")
    return {"goodput_mbit": goodput_mbit, "runs": report["runs"], "stream_copy_s": stream_s}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("role", choices=("receiver", "sender"))
    parser.add_argument("--host", required=True)
    parser.add_argument("--buffer-bytes", type=int, required=True)
    parser.add_argument("--target-session", default="")
    parser.add_argument("--target-ptr", type=int, default=0)
    parser.add_argument("--copy-bytes", type=int, default=64 << 20)
    parser.add_argument("--window-bytes", type=int, default=16 << 20)
    parser.add_argument("--slice-bytes", type=int, default=4 << 20)
    parser.add_argument("--concurrent", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--block-bytes", type=int, default=1 << 20)
    parser.add_argument("--pause-s", type=float, default=1.0)
    parser.add_argument("--warm-copies", type=int, default=0)
    args = parser.parse_args(argv)
    (run_receiver if args.role == "receiver" else run_sender)(args)


if __name__ == "__main__":
    main()
