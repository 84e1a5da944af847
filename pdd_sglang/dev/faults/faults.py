"""The faults the suite injects: what load shows the fault, how to inject it, how to recover, and
what a request caught in it must see. One class per kind of fault (a server dies, the line stalls).

Servers die by SIGKILL to their whole process group (no clean shutdown, as in a crash or an OOM
kill) and come back on the same ports, so the router's health check returns them to rotation. The
WAN stall freezes the line's forwarder (SIGSTOP): packets stop both ways, connections stay open,
as on a leased line that stalls; SIGCONT ends it.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Any

from pdd_sglang.dev.faults.load import LoadProfile

# A low-hit prompt: its KV copy to main crosses the line for seconds, so the relay decodes
# while main waits (the window before the handoff).
LOW_HIT = LoadProfile(shared_tokens=64, unique_tokens=700, output_tokens=48)
# A high-hit prompt with a long answer: the copy is short, the handoff early, and main decodes
# most of the answer (the window after the handoff).
HIGH_HIT_LONG = LoadProfile(shared_tokens=700, unique_tokens=24, output_tokens=160)


def kill_group(server: Any) -> None:
    if server.process is not None and server.process.poll() is None:
        os.killpg(server.process.pid, signal.SIGKILL)
        server.process.wait(timeout=30)


def restart(server: Any, timeout_s: float = 300.0) -> None:
    server.stop(grace_s=5.0)  # reaps what is left of the killed group
    server.start()
    server.wait_ready(timeout_s)


@dataclass
class Fault:
    name: str = ""
    expectation: str = ""
    profile: LoadProfile = LOW_HIT
    hold_s: float = 5.0  # how long the fault lasts before recovery starts

    def inject(self, cluster: Any) -> None:
        raise NotImplementedError

    def recover(self, cluster: Any) -> None:
        raise NotImplementedError


@dataclass
class ServerDies(Fault):
    """SIGKILL to one server's process group; it comes back on the same ports."""

    role: str = "relay"  # the FaultCluster attribute: prefill, relay or main

    def inject(self, cluster):
        kill_group(getattr(cluster, self.role))

    def recover(self, cluster):
        restart(getattr(cluster, self.role))


RELAY_DIES = ServerDies(
    name="relay_dies", role="relay",
    expectation=("requests on the relay before their handoff go on at main from the first token "
                 "(a pause, not an error); new requests take P->MD until the relay is back"))
MAIN_DIES_BEFORE_HANDOFF = ServerDies(
    name="main_dies_before_handoff", role="main",
    expectation=("requests still before their handoff complete at the relay; requests on P->MD "
                 "are re-sent (the router's retry), and new ones go to the relay alone until main "
                 "is back"))
MAIN_DIES_AFTER_HANDOFF = ServerDies(
    name="main_dies_after_handoff", role="main", profile=HIGH_HIT_LONG,
    expectation=("requests main was decoding go on from the last token the client has (the "
                 "router's --retry-after-first-token), on the relay alone until main is back; "
                 "none hangs"))
PREFILL_DIES = ServerDies(
    name="prefill_dies", role="prefill",
    expectation=("requests in prefill or in transfer fail with a clear error; relay and main free "
                 "every slot they reserved for them"))


@dataclass
class WanStall(Fault):
    name: str = "wan_stall"
    expectation: str = ("main's copies stalled past --pdd-wan-transfer-timeout fail and are "
                        "cancelled; requests on the relay complete there; nothing hangs")
    hold_s: float = 20.0

    def inject(self, cluster):
        os.kill(cluster.line.forwarder_pid, signal.SIGSTOP)

    def recover(self, cluster):
        os.kill(cluster.line.forwarder_pid, signal.SIGCONT)


WAN_STALL = WanStall()

ALL = (RELAY_DIES, MAIN_DIES_BEFORE_HANDOFF, MAIN_DIES_AFTER_HANDOFF, PREFILL_DIES, WAN_STALL)
QUICK = (RELAY_DIES, MAIN_DIES_BEFORE_HANDOFF, WAN_STALL)


def wait_for(condition, timeout_s: float, interval_s: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval_s)
    return condition()
