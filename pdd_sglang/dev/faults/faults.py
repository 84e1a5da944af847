"""The faults the suite injects: what load shows the fault, how to inject it, how to recover, and
what a request caught in it must see. One class per kind of fault (a server dies, the line stalls).

Servers die by SIGKILL to their whole process group (no clean shutdown, as in a crash or an OOM
kill) and come back on the same ports, so the router's health check returns them to rotation. The
WAN stall freezes the line's forwarder (SIGSTOP): packets stop both ways, connections stay open,
as on a leased line that stalls; SIGCONT ends it. A frozen server (SIGSTOP to its process group)
is alive but silent, as a server stuck in a long GC pause or swapped out.

The soak's faults (``soak.py``) add clients that hang up mid-stream and a burst of long prompts
while the line is stalled; both send their own requests through the router while they last
(``seed``: set per injection, so a soak's run is repeatable).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import random
import signal
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from pdd_sglang.dev.faults.load import LoadProfile, SteadyLoad

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

    def ready(self, cluster: Any) -> bool:
        """Whether the moment this fault needs has come (the soak waits a while for it)."""
        return True

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
    during_copy: bool = False  # wait for KV bytes on the prefill's WAN path to main first

    def ready(self, cluster):
        return not self.during_copy or wan_bytes_ahead(cluster) > 0

    def inject(self, cluster):
        os.kill(cluster.line.forwarder_pid, signal.SIGSTOP)

    def recover(self, cluster):
        os.kill(cluster.line.forwarder_pid, signal.SIGCONT)


def wan_line(cluster: Any) -> dict:
    """The prefill's WAN line per main (``/server_info``'s ``pdd.wan_line``)."""
    return cluster.prefill.pdd_state().get("wan_line") or {}


def wan_bytes_ahead(cluster: Any) -> int:
    return sum(line.get("bytes_ahead", 0) for line in wan_line(cluster).values())


WAN_STALL = WanStall()
# The same stall struck while a copy to main is queued or in flight: it fails at the timeout.
WAN_BATCH_FAILS = WanStall(
    name="wan_batch_fails", during_copy=True,
    expectation=("the copies on the line fail at --pdd-wan-transfer-timeout and main is probed "
                 "until it answers; the relay answers their requests; nothing hangs"))
# Under every timeout (the suite's WAN transfer timeout is 10 s): copies resume where they were.
WAN_SHORT_STALL = WanStall(
    name="wan_short_stall", hold_s=4.0,
    expectation="a pause: every copy resumes and completes, no request fails")


@dataclass
class ServerFreezes(Fault):
    """SIGSTOP to one server's process group, SIGCONT after ``hold_s``: no restart."""

    role: str = "main"

    def inject(self, cluster):
        os.killpg(getattr(cluster, self.role).process.pid, signal.SIGSTOP)

    def recover(self, cluster):
        os.killpg(getattr(cluster, self.role).process.pid, signal.SIGCONT)


# Past the suite's --pdd-main-bootstrap-timeout (15 s): main registers for the rooms of requests
# sent to it while frozen only after prefill gave up on it.
MAIN_REGISTERS_LATE = ServerFreezes(
    name="main_registers_late", role="main", hold_s=20.0,
    expectation=("requests whose main is late complete at the relay; prefill refuses the late "
                 "main, which frees what it reserved; new requests go to the relay alone while "
                 "main fails its health checks"))


def _hang_up(conn: http.client.HTTPConnection) -> None:
    with contextlib.suppress(OSError, AttributeError):
        conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()


@dataclass
class ClientsDisconnect(Fault):
    """Clients that send a streamed request and hang up before its end (after 0-8 chunks)."""

    name: str = "clients_disconnect"
    expectation: str = ("every server aborts the abandoned requests and frees their KV; the "
                        "other clients see nothing")
    hold_s: float = 8.0
    clients: int = 2
    seed: int = 0

    def inject(self, cluster):
        self.abandoned = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, daemon=True,
                                          name=f"fault-hang-up-{i}",
                                          args=(i, cluster.router, cluster.client()))
                         for i in range(self.clients)]
        for thread in self._threads:
            thread.start()

    def _client(self, index: int, router, setup) -> None:
        rng = random.Random(f"{self.seed}-hang-up-{index}")
        with setup():
            while not self._stop.is_set():
                prompt = [rng.randrange(10, 1000) for _ in range(rng.randint(200, 900))]
                body = {"input_ids": prompt, "stream": True,
                        "sampling_params": {"max_new_tokens": 200, "temperature": 0.0,
                                            "ignore_eos": True}}
                chunks = rng.randint(0, 8)  # 0: before the first token
                conn = http.client.HTTPConnection(router.host, router.port, timeout=60)
                try:
                    conn.request("POST", "/generate", body=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **router.headers})
                    resp = conn.getresponse()
                    while chunks > 0 and resp.status == 200:
                        line = resp.readline()
                        if not line:
                            break
                        chunks -= line.startswith(b"data:")
                except (OSError, http.client.HTTPException):
                    pass
                finally:
                    _hang_up(conn)
                    with self._lock:
                        self.abandoned += 1
                self._stop.wait(rng.uniform(0.2, 1.0))

    def recover(self, cluster):
        self._stop.set()
        for thread in self._threads:
            thread.join(90)


@dataclass
class LongPromptsBackedUp(Fault):
    """The line stalls (under the WAN transfer timeout) while clients send prompts longer than
    prefill's --chunked-prefill-size: chunks pile up in the WAN path's queues, then drain."""

    name: str = "chunked_prefill_backed_up"
    expectation: str = ("the relay answers from its local copy; main's copies resume when the "
                        "line does; every long prompt completes")
    hold_s: float = 6.0
    profile: LoadProfile = LoadProfile(shared_tokens=64, unique_tokens=1400, output_tokens=32,
                                       concurrency=2)
    seed: int = 0

    def inject(self, cluster):
        os.kill(cluster.line.forwarder_pid, signal.SIGSTOP)
        self.load = SteadyLoad(cluster.router.host, cluster.router.port, self.profile,
                               seed=self.seed, thread_setup=cluster.client(),
                               headers=cluster.router.headers)
        self.load.start()

    def recover(self, cluster):
        os.kill(cluster.line.forwarder_pid, signal.SIGCONT)
        self.load.stop()  # every request it sent has ended


CLIENTS_DISCONNECT = ClientsDisconnect()
CHUNKED_PREFILL_BACKED_UP = LongPromptsBackedUp()

ALL = (RELAY_DIES, MAIN_DIES_BEFORE_HANDOFF, MAIN_DIES_AFTER_HANDOFF, PREFILL_DIES, WAN_STALL)
QUICK = (RELAY_DIES, MAIN_DIES_BEFORE_HANDOFF, WAN_STALL)
# The soak draws from these.
SOAK = (RELAY_DIES, MAIN_DIES_BEFORE_HANDOFF, MAIN_DIES_AFTER_HANDOFF, WAN_SHORT_STALL, WAN_STALL,
        WAN_BATCH_FAILS, MAIN_REGISTERS_LATE, CLIENTS_DISCONNECT, CHUNKED_PREFILL_BACKED_UP)


def wait_for(condition, timeout_s: float, interval_s: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval_s)
    return condition()
