"""Measurements across a running :class:`WanLine`: bulk rate, round trip, one-way delay.

All probes run in this process: sockets are created inside each namespace (see
``WanLine.socket``), and both ends share this machine's clock, so one-way delays are
measured directly rather than inferred from round trips.
"""

from __future__ import annotations

import socket
import statistics
import struct
import threading
import time

PORT_BULK = 5201
PORT_ECHO = 5202
PORT_PROBE = 5203
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)  # Linux value; absent from some builds
# Linux's TX timestamps (Documentation/networking/timestamping.rst): a software stamp when the
# datagram reaches the device, numbered (OPT_ID), without the payload (OPT_TSONLY).
SO_TIMESTAMPING = getattr(socket, "SO_TIMESTAMPING", 37)
SOF_TIMESTAMPING_TX_SOFTWARE, SOF_TIMESTAMPING_SOFTWARE = 1 << 1, 1 << 4
SOF_TIMESTAMPING_OPT_ID, SOF_TIMESTAMPING_OPT_TSONLY = 1 << 7, 1 << 11
TX_STAMP_FLAGS = (SOF_TIMESTAMPING_TX_SOFTWARE | SOF_TIMESTAMPING_SOFTWARE
                  | SOF_TIMESTAMPING_OPT_ID | SOF_TIMESTAMPING_OPT_TSONLY)
IP_RECVERR = getattr(socket, "IP_RECVERR", 11)
# struct sock_extended_err: errno, origin, type, code, pad, info, data (the stamp's id)
SOCK_EXTENDED_ERR = struct.Struct("=IBBBBII")


def _listen(line, side: str, port: int) -> socket.socket:
    server = line.socket(side)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind((line.address(side), port))
    server.listen(4)
    server.settimeout(10)
    return server


def bulk_rate(line, seconds: float = 4.0, warmup_s: float = 1.0, src: str = "a",
              dst: str = "b") -> dict:
    """Push TCP data from ``src`` to ``dst`` for ``seconds``; report goodput in Mbit/s over the
    whole transfer and over the steady part after ``warmup_s`` (slow start excluded).

    Each receive is dated by the kernel (SO_TIMESTAMPNS: arrival of the last segment read),
    so a receiving thread that is descheduled for a while does not inflate the rate."""
    server = _listen(line, dst, PORT_BULK)
    received: list[tuple[float, int]] = []  # (arrival time, cumulative bytes)
    done = threading.Event()

    def receive():
        conn, _ = server.accept()
        conn.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        with conn:
            total = 0
            view = memoryview(bytearray(1 << 20))
            while True:
                n, ancillary, _, _ = conn.recvmsg_into([view], socket.CMSG_SPACE(16))
                if n == 0:
                    break
                total += n
                stamps = [_kernel_time(c) for c in ancillary
                          if c[0] == socket.SOL_SOCKET and c[1] == SO_TIMESTAMPNS]
                received.append((stamps[-1] if stamps else time.time(), total))
        done.set()

    receiver = threading.Thread(target=receive, daemon=True)
    receiver.start()
    client = line.socket(src)
    client.connect((line.address(dst), PORT_BULK))
    chunk = b"\0" * (256 * 1024)
    start = time.time()  # CLOCK_REALTIME, like the kernel's receive stamps
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        client.sendall(chunk)
    client.shutdown(socket.SHUT_WR)
    done.wait(30)
    client.close()
    server.close()
    if not received:
        raise RuntimeError("bulk transfer received nothing")
    end_t, total = received[-1]
    steady_from = start + warmup_s
    base = next(((t, b) for t, b in received if t >= steady_from), received[0])
    steady_bytes = total - base[1]
    steady_s = end_t - base[0]
    return {
        "bytes": total,
        "seconds": end_t - start,
        "goodput_mbit": total * 8 / (end_t - start) / 1e6,
        "steady_goodput_mbit": steady_bytes * 8 / steady_s / 1e6 if steady_s > 0 else 0.0,
    }


def round_trips(line, count: int = 50, size: int = 64, interval_s: float = 0.01,
                client_side: str = "a", server_side: str = "b") -> list[float]:
    """Small-message TCP ping-pong; returns each round trip in ms (connection setup excluded)."""
    server = _listen(line, server_side, PORT_ECHO)

    def echo():
        try:
            conn, _ = server.accept()
            with conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                while True:
                    data = _recv_exact(conn, size)
                    if not data:
                        return
                    conn.sendall(data)
        except OSError:  # the line went down under it (the join below timed out)
            return

    echoer = threading.Thread(target=echo, daemon=True)
    echoer.start()
    client = line.socket(client_side)
    client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    # The reply is dated by the kernel on arrival, so a late wake-up of this thread does not
    # count; the echo thread's turnaround still does (it is what a real peer would add).
    client.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    client.connect((line.address(server_side), PORT_ECHO))
    message = b"x" * size
    rtts = []
    try:
        for _ in range(count):
            t0 = time.time()
            client.sendall(message)
            got, arrived = 0, time.time()
            while got < size:
                data, ancillary, _, _ = client.recvmsg(size - got, socket.CMSG_SPACE(16))
                if not data:
                    raise RuntimeError("echo connection closed early")
                got += len(data)
                for level, kind, payload in ancillary:
                    if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
                        arrived = _kernel_time((level, kind, payload))
            rtts.append((arrived - t0) * 1000)
            time.sleep(interval_s)
    finally:
        client.close()
        # Until the echo side has read the close: a line stopped before the FIN crossed it
        # would leave that thread in recv() until TCP gives up, about 15 minutes later.
        echoer.join(5)
        server.close()
    return rtts


def _recv_exact(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        part = conn.recv(size - len(data))
        if not part:
            return data
        data += part
    return data


def one_way_probes(line, count: int = 400, burst: int = 20, gap_s: float = 0.005,
                   src: str = "a", dst: str = "b") -> dict:
    """Send numbered UDP datagrams in bursts; return one-way delays (ms) in arrival order and
    how many arrived out of order or not at all.

    Both ends are the kernel's timestamps: departure when the datagram enters the line's device
    (SO_TIMESTAMPING, software TX), arrival at the receiving socket (SO_TIMESTAMPNS). Neither is
    the moment a Python thread got round to it: on a busy machine a thread can wait for the GIL
    or the CPU for milliseconds between taking a stamp and the system call, which would show up
    as delay the line did not add. ``kernel_sent``: datagrams dated so (the rest, if the kernel
    dropped a stamp, are dated by the sender just before sending)."""
    receiver = line.socket(dst, type=socket.SOCK_DGRAM)
    receiver.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    receiver.bind((line.address(dst), PORT_PROBE))
    receiver.settimeout(2.0)
    sender = line.socket(src, type=socket.SOCK_DGRAM)
    # OPT_ID numbers the stamps 0, 1, ... in send order: the probes' own sequence numbers.
    sender.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPING, TX_STAMP_FLAGS)
    arrivals: list[tuple[int, float, float]] = []  # (seq, arrival, sender's own stamp)
    departures: dict[int, float] = {}

    def receive():
        while len(arrivals) < count:
            try:
                data, ancillary, _, _ = receiver.recvmsg(64, socket.CMSG_SPACE(16))
            except socket.timeout:
                return
            seq, sent = struct.unpack("!Id", data[:12])
            arrived = next(_kernel_time(c) for c in ancillary
                           if c[0] == socket.SOL_SOCKET and c[1] == SO_TIMESTAMPNS)
            arrivals.append((seq, arrived, sent))

    thread = threading.Thread(target=receive, daemon=True)
    thread.start()
    for seq in range(count):
        # CLOCK_REALTIME, like the kernel's stamps; a clock step within one probe run would
        # show up as an outlier, and none is expected on a test machine.
        sender.sendto(struct.pack("!Id", seq, time.time()), (line.address(dst), PORT_PROBE))
        if (seq + 1) % burst == 0:
            _read_departures(sender, departures)  # the error queue holds a few hundred
            time.sleep(gap_s)
    thread.join(10)
    _read_departures(sender, departures)
    sender.close()
    receiver.close()
    seqs = [s for s, _, _ in arrivals]
    reordered = sum(1 for prev, cur in zip(seqs, seqs[1:]) if cur < prev)
    delays = [(arrived - departures.get(seq, sent)) * 1000 for seq, arrived, sent in arrivals]
    return {"delays_ms": delays, "sent": count, "received": len(arrivals),
            "reordered": reordered, "kernel_sent": sum(seq in departures for seq in seqs)}


def _read_departures(sock: socket.socket, into: dict[int, float]) -> None:
    """Drain the socket's error queue of TX timestamps: ``into[stamp id] = departure time``."""
    while True:
        try:
            _, ancillary, _, _ = sock.recvmsg(1, 512, socket.MSG_ERRQUEUE | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        stamp = stamp_id = None
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPING:
                stamp = _kernel_time((level, kind, payload))  # [0]: the software stamp
            elif (level, kind) == (socket.IPPROTO_IP, IP_RECVERR):
                stamp_id = SOCK_EXTENDED_ERR.unpack(payload[:SOCK_EXTENDED_ERR.size])[-1]
        if stamp is not None and stamp_id is not None:
            into[stamp_id] = stamp


def _kernel_time(cmsg) -> float:
    seconds, nanos = struct.unpack("qq", cmsg[2][:16])
    return seconds + nanos / 1e9


def summarize(values: list[float]) -> dict:
    ordered = sorted(values)
    return {"n": len(values), "mean": statistics.fmean(values), "min": ordered[0],
            "p50": ordered[len(ordered) // 2], "max": ordered[-1],
            "std": statistics.pstdev(values)}
