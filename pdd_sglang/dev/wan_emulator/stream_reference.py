"""The best a TCP transport can do for one copy on an emulated line: a reference for the WAN
line bench (issue 34), not a transport of the product.

One copy goes as a stream of frames over one persistent, warm ZMQ TCP connection (pyzmq, a
dependency already), with no acknowledgement but one at the copy's end: the receiver copies
each frame into a staging buffer, as main's staging range takes a packed record, and answers
once it holds every byte. Nothing waits per request, so what it leaves of the line is the
line's and the congestion control's: the copy's own last round trip (a copy of C BDPs moves at
most C / (C + 1) of the line) and how the flow's rate moves while it runs. Mooncake's TCP
transport, the product's, completes each request on the receiver's acknowledgement and runs
one request per lane (``prefill/wan_engine.py``); what the bench's rules miss beside this
reference is that.

    python -m pdd_sglang.dev.wan_emulator.stream_reference receiver --host B --copy-bytes N
    python -m pdd_sglang.dev.wan_emulator.stream_reference sender --host A --peer B ...

The receiver prints ``{"ready": true}`` once bound; the sender prints ``{"copy_s": [...]}`` (the
timed copies, after ``--warm-copies`` untimed ones).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

DATA_PORT = 6101  # receiver's PULL: the copy's frames
ACK_PORT = 6102  # sender's PULL: one acknowledgement per copy
FRAME_BYTES = 4 << 20
READY_TIMEOUT_S = 60.0


def run_receiver(args) -> None:
    import numpy as np
    import zmq

    ctx = zmq.Context()
    data = ctx.socket(zmq.PULL)
    data.bind(f"tcp://{args.host}:{DATA_PORT}")
    ack = ctx.socket(zmq.PUSH)
    ack.connect(f"tcp://{args.peer}:{ACK_PORT}")
    staging = np.empty(args.copy_bytes, dtype=np.uint8)
    print(json.dumps({"ready": True}), flush=True)
    try:
        while True:
            held = 0
            while held < args.copy_bytes:
                frame = data.recv(copy=False).buffer
                staging[held:held + len(frame)] = np.frombuffer(frame, dtype=np.uint8)
                held += len(frame)
            ack.send(b"landed")
    finally:
        ctx.destroy(linger=0)


def run_sender(args) -> None:
    import numpy as np
    import zmq

    ctx = zmq.Context()
    ack = ctx.socket(zmq.PULL)
    ack.bind(f"tcp://{args.host}:{ACK_PORT}")
    data = ctx.socket(zmq.PUSH)
    data.connect(f"tcp://{args.peer}:{DATA_PORT}")
    source = memoryview(np.random.default_rng(0).integers(0, 256, args.copy_bytes,
                                                          dtype=np.uint8))
    seconds = []
    try:
        for k in range(args.warm_copies + args.copies):
            began = time.perf_counter()
            for offset in range(0, args.copy_bytes, FRAME_BYTES):
                data.send(source[offset:offset + FRAME_BYTES], copy=False)
            ack.recv()
            if k >= args.warm_copies:
                seconds.append(time.perf_counter() - began)
    finally:
        ctx.destroy(linger=0)
    print(json.dumps({"copy_s": seconds}), flush=True)


def measure(line, copy_bytes: int, copies: int, warm_copies: int, log_dir: Path, tag: str,
            env: dict | None = None) -> list[float]:
    """Seconds of each timed copy across the started ``line`` (A sends to B)."""
    from pdd_sglang.dev.wan_emulator.handoff_bench import _read_json_line
    from pdd_sglang.dev.wan_emulator.line import stop_process

    module = [sys.executable, "-m", "pdd_sglang.dev.wan_emulator.stream_reference"]
    common = ["--copy-bytes", str(copy_bytes)]
    receiver = sender = None
    logs = [open(log_dir / f"stream_reference_{tag}_{side}.log", "ab") for side in ("b", "a")]
    try:
        receiver = line.popen("b", [*module, "receiver", "--host", line.address("b"),
                                    "--peer", line.address("a"), *common],
                              stdout=subprocess.PIPE, stderr=logs[0], text=True, env=env)
        _read_json_line(receiver, "stream receiver", READY_TIMEOUT_S)
        sender = line.popen("a", [*module, "sender", "--host", line.address("a"),
                                  "--peer", line.address("b"), *common,
                                  "--copies", str(copies), "--warm-copies", str(warm_copies)],
                            stdout=subprocess.PIPE, stderr=logs[1], text=True, env=env)
        rate_mbit = line.rate_mbit or 1000.0  # unlimited: the forwarder's ceiling, about 1.3 Gbit/s
        budget = 3 * (warm_copies + copies) * copy_bytes * 8 / (rate_mbit * 1e6) + 60
        return _read_json_line(sender, "stream sender", budget)["copy_s"]
    finally:
        stop_process(sender)
        stop_process(receiver)
        for handle in logs:
            handle.close()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("role", choices=("receiver", "sender"))
    parser.add_argument("--host", required=True)
    parser.add_argument("--peer", required=True)
    parser.add_argument("--copy-bytes", type=int, required=True)
    parser.add_argument("--copies", type=int, default=3)
    parser.add_argument("--warm-copies", type=int, default=1)
    args = parser.parse_args(argv)
    (run_receiver if args.role == "receiver" else run_sender)(args)


if __name__ == "__main__":
    main()
