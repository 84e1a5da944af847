"""The delay line: a user-space forwarder between the two TUN devices of a WAN line.

Every IP packet that cluster A's kernel routes to wan0 is read here, held, and written into
cluster B's wan0 (and the reverse). Each direction is modelled as a serial link:

  * transmission: a packet occupies the link for len*8/rate seconds, after the previous one
    (this is the rate limit; a backlog beyond ``queue_bytes`` is tail-dropped, like a router
    buffer, so TCP sees loss instead of unbounded queueing);
  * propagation: then it travels RTT/2 plus a uniform jitter in [-jitter/2, +jitter/2], so a
    round trip stays within RTT +- jitter;
  * FIFO: a packet never leaves before its predecessor (release times are clamped to be
    non-decreasing), because a real line does not reorder and reordering would make TCP
    retransmit. When packets come closer together than the jitter (bulk traffic), the clamp
    biases their delay towards the upper jitter bound, never past it.

Capacity, measured on the 2-core dev VM (scripts/wan_check.py): a set rate up to 400 Mbit/s
is held (TCP goodput 96.5% of it, which is exactly the IP+TCP header share at MTU 1500); at
600 Mbit/s goodput falls to ~83%. With no rate limit the forwarder carries ~0.55 Gbit/s at
40 ms RTT and ~0.9-1.4 Gbit/s at 2 ms. Forwarding adds ~0.3-0.6 ms per round trip. It runs
under SCHED_RR so that busy servers on the same cores do not stretch the line.

Run as ``python -m pdd_sglang.dev.wan_emulator.forwarder``; it creates the namespaces itself (their names
carry its pid, which makes the forwarder their owner), prints one JSON "ready" line and
forwards until SIGTERM/SIGINT, or until its lifeline (stdin) reaches EOF because the process
that started it died. On any of these exits it deletes both namespaces and whatever still runs
in them.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import random
import select
import signal
import sys
import time

from pdd_sglang.dev.wan_emulator import netns

DEVICE = "wan0"
MAX_BATCH = 256


class DelayLine:
    """One direction of the line: rate pacing, propagation delay, bounded jitter, FIFO."""

    def __init__(self, rate_bps: float, one_way_s: float, jitter_s: float, queue_bytes: int,
                 rng: random.Random):
        self.rate_bps = rate_bps
        self.one_way_s = one_way_s
        self.half_jitter_s = jitter_s / 2.0
        self.queue_bytes = queue_bytes
        self.rng = rng
        self.link_free_at = 0.0
        self.last_release = 0.0
        self.pending: collections.deque[tuple[float, bytes]] = collections.deque()
        self.packets = self.bytes = self.drops = 0
        # How late packets left versus their due time: the forwarder's own error, kept apart
        # from whatever noise the measuring processes add.
        self.max_late_s = 0.0
        self.late_over_1ms = 0
        # Per release round (one wake-up that releases packets), by how late its oldest packet
        # left: a forwarder held off the CPU once makes every packet due meanwhile late, a
        # burst of them, in one round.
        self.release_rounds = self.rounds_late_over_1ms = self.rounds_late_over_5ms = 0

    def admit(self, packet: bytes, now: float) -> bool:
        size = len(packet)
        start = max(now, self.link_free_at)
        if self.rate_bps > 0:
            backlog_bytes = (start - now) * self.rate_bps / 8.0
            if backlog_bytes + size > self.queue_bytes:
                self.drops += 1
                return False
            self.link_free_at = start + size * 8.0 / self.rate_bps
        else:
            self.link_free_at = start
        jitter = self.rng.uniform(-self.half_jitter_s, self.half_jitter_s) if self.half_jitter_s else 0.0
        release = max(self.link_free_at + max(0.0, self.one_way_s + jitter), self.last_release)
        self.last_release = release
        self.pending.append((release, packet))
        self.packets += 1
        self.bytes += size
        return True

    def next_release(self) -> float | None:
        return self.pending[0][0] if self.pending else None

    def release_due(self, now: float, out_fd: int) -> None:
        pending = self.pending
        if pending and pending[0][0] <= now:
            self.release_rounds += 1
            round_late = now - pending[0][0]  # the oldest packet due is the latest
            self.rounds_late_over_1ms += round_late > 0.001
            self.rounds_late_over_5ms += round_late > 0.005
        while pending and pending[0][0] <= now:
            due, packet = pending.popleft()
            late = now - due
            if late > self.max_late_s:
                self.max_late_s = late
            if late > 0.001:
                self.late_over_1ms += 1
            try:
                os.write(out_fd, packet)
            except OSError:
                # The receiving device is gone or full; a lost packet is what a line does.
                self.drops += 1


def forward(fd_a: int, fd_b: int, a_to_b: DelayLine, b_to_a: DelayLine, lifeline: int | None,
            wakeup: int, stop: list[bool]) -> None:
    routes = {fd_a: (a_to_b, fd_b), fd_b: (b_to_a, fd_a)}
    # ``wakeup`` is the signal wakeup pipe: select() restarts itself after a signal handler
    # (PEP 475), so without it SIGTERM would wait for the next packet to be noticed.
    watched = [fd_a, fd_b, wakeup] + ([lifeline] if lifeline is not None else [])
    clock = time.monotonic
    while not stop[0]:
        due = [t for t in (a_to_b.next_release(), b_to_a.next_release()) if t is not None]
        timeout = max(0.0, min(due) - clock()) if due else None
        try:
            readable, _, _ = select.select(watched, [], [], timeout)
        except InterruptedError:
            continue
        for fd in readable:
            if fd == lifeline:
                if not os.read(lifeline, 4096):
                    return
                continue
            if fd == wakeup:
                _drain(wakeup)
                continue
            line = routes[fd][0]
            for _ in range(MAX_BATCH):
                try:
                    packet = os.read(fd, 65536)
                except BlockingIOError:
                    break
                line.admit(packet, clock())
        now = clock()
        a_to_b.release_due(now, fd_b)
        b_to_a.release_due(now, fd_a)


def _raise_priority() -> None:
    """On 2 cores the demo's servers keep every core busy, and a starved forwarder adds delay
    and cuts rate that the line was not set to have (measured with 4 busy loops: RTT max 72 ms
    at normal priority vs 51 ms with SCHED_RR on a 40 ms line). The forwarder sleeps in
    select() when idle, and the kernel's RT throttling bounds it even if it did not."""
    try:
        # RESET_ON_FORK: the `ip` commands it runs must not inherit real-time priority.
        os.sched_setscheduler(0, os.SCHED_RR | os.SCHED_RESET_ON_FORK, os.sched_param(10))
    except OSError:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, -10)
        except OSError:
            pass


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 512):
            pass
    except BlockingIOError:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate-mbit", type=float, required=True, help="0 = unlimited")
    parser.add_argument("--rtt-ms", type=float, required=True)
    parser.add_argument("--jitter-ms", type=float, default=0.0)
    parser.add_argument("--queue-bytes", type=int, required=True)
    parser.add_argument("--mtu", type=int, default=1500)
    parser.add_argument("--addr-a", required=True)
    parser.add_argument("--addr-b", required=True)
    parser.add_argument("--prefix-len", type=int, default=30)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--realtime", action="store_true", help="run under SCHED_RR (see _raise_priority)")
    parser.add_argument("--lifeline", action="store_true",
                        help="exit and clean up when stdin reaches EOF (the starter died)")
    args = parser.parse_args(argv)

    stop = [False]

    def on_signal(signum, frame):
        stop[0] = True

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    wakeup_r, wakeup_w = os.pipe()
    os.set_blocking(wakeup_r, False)
    os.set_blocking(wakeup_w, False)
    signal.set_wakeup_fd(wakeup_w)

    if args.realtime:
        _raise_priority()
    pid = os.getpid()
    names = {"a": f"pddA-{pid}", "b": f"pddB-{pid}"}
    addrs = {"a": args.addr_a, "b": args.addr_b}
    fds: list[int] = []
    try:
        for side in ("a", "b"):
            netns.create(names[side])
            fds.append(netns.open_tun(names[side], DEVICE))
            netns.run_ip("-n", names[side], "link", "set", DEVICE, "mtu", str(args.mtu), "up")
            netns.run_ip("-n", names[side], "addr", "add", f"{addrs[side]}/{args.prefix_len}",
                         "dev", DEVICE)
        rng = random.Random(args.seed)
        rate_bps = args.rate_mbit * 1e6
        one_way_s = args.rtt_ms / 2000.0
        jitter_s = args.jitter_ms / 1000.0
        a_to_b = DelayLine(rate_bps, one_way_s, jitter_s, args.queue_bytes, rng)
        b_to_a = DelayLine(rate_bps, one_way_s, jitter_s, args.queue_bytes, rng)
        # Every queued packet is a (time, bytes) tuple: cyclic GC passes over thousands of
        # them would stall forwarding for milliseconds, and the loop creates no cycles.
        gc.disable()
        print(json.dumps({"ready": True, "pid": pid, "namespaces": names, "addresses": addrs,
                          "device": DEVICE}), flush=True)

        def report(kind: str) -> None:
            stats = {"a_to_b": vars_of(a_to_b), "b_to_a": vars_of(b_to_a)}
            print(json.dumps({kind: True, "stats": stats}), file=sys.stderr, flush=True)

        # SIGUSR1 asks for the counters while running (WanLine.stats()).
        signal.signal(signal.SIGUSR1, lambda signum, frame: report("running"))
        forward(fds[0], fds[1], a_to_b, b_to_a, 0 if args.lifeline else None, wakeup_r, stop)
        report("stopped")
    finally:
        for fd in fds:
            os.close(fd)
        for name in names.values():
            netns.destroy(name)
    return 0


def vars_of(line: DelayLine) -> dict[str, float]:
    return {"packets": line.packets, "bytes": line.bytes, "drops": line.drops,
            "max_late_ms": round(line.max_late_s * 1000, 3), "late_over_1ms": line.late_over_1ms,
            "release_rounds": line.release_rounds,
            "rounds_late_over_1ms": line.rounds_late_over_1ms,
            "rounds_late_over_5ms": line.rounds_late_over_5ms}


if __name__ == "__main__":
    sys.exit(main())
