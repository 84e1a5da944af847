"""``WanLine``: start, use and stop one emulated WAN line between cluster A and cluster B."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Optional, Sequence

from pdd_sglang.dev.wan_emulator import netns
from pdd_sglang.dev.wan_emulator.forwarder import DEVICE

SIDES = ("a", "b")
DEFAULT_ADDR_A = "10.77.0.1"
DEFAULT_ADDR_B = "10.77.0.2"
UNLIMITED_LINE_GBPS = 1.0
START_TIMEOUT_S = 60.0  # generous: `ip` calls crawl when other servers load both cores

_live_lines: "set[WanLine]" = set()  # strong refs: atexit must reach unreferenced lines
_handlers_installed = False


class WanLine:
    """An emulated WAN line: namespace ``pddA-<pid>`` (cluster A: P, RLD, router, clients) and
    namespace ``pddB-<pid>`` (cluster B: MD), joined only through the delay-line forwarder.

    ``rate_mbit`` limits each direction (0 = unlimited), ``rtt_ms`` is the round-trip
    propagation delay, ``jitter_ms`` bounds how far a round trip may stray from it (+-).
    ``queue_ms`` sizes the line's buffer in time at the set rate (default: one RTT, i.e. one
    bandwidth-delay product). ``realtime`` runs the forwarder under SCHED_RR so busy servers
    on the same cores do not stretch the line's delay. Use as a context manager; :meth:`stop` is idempotent.
    """

    def __init__(self, rate_mbit: float, rtt_ms: float, jitter_ms: float = 0.0, *,
                 queue_ms: float | None = None, mtu: int = 1500,
                 addr_a: str = DEFAULT_ADDR_A, addr_b: str = DEFAULT_ADDR_B,
                 seed: int | None = None, detached: bool = False, realtime: bool = True):
        if rate_mbit < 0 or rtt_ms < 0 or jitter_ms < 0:
            raise ValueError("rate, RTT and jitter must be >= 0")
        if jitter_ms > rtt_ms:
            raise ValueError("jitter_ms must not exceed rtt_ms (delays cannot go negative)")
        self.rate_mbit = rate_mbit
        self.rtt_ms = rtt_ms
        self.jitter_ms = jitter_ms
        self.queue_ms = max(rtt_ms, 10.0) if queue_ms is None else queue_ms
        self.mtu = mtu
        self.addresses = {"a": addr_a, "b": addr_b}
        self.seed = seed
        self.detached = detached
        self.realtime = realtime
        self.namespaces: dict[str, str] = {}
        self.proc: subprocess.Popen | None = None
        self._stderr = None
        self.last_stats: dict | None = None
        self._lock = threading.RLock()  # a signal handler may stop() while stop() runs

    # -- lifecycle ---------------------------------------------------------------------------
    def queue_bytes(self) -> int:
        if self.rate_mbit <= 0:
            return 1 << 30
        return max(64 * 1024, int(self.rate_mbit * 1e6 / 8 * self.queue_ms / 1000))

    def forwarder_argv(self) -> list[str]:
        argv = [sys.executable, "-m", "pdd_sglang.dev.wan_emulator.forwarder",
                "--rate-mbit", str(self.rate_mbit), "--rtt-ms", str(self.rtt_ms),
                "--jitter-ms", str(self.jitter_ms), "--queue-bytes", str(self.queue_bytes()),
                "--mtu", str(self.mtu), "--addr-a", self.addresses["a"],
                "--addr-b", self.addresses["b"]]
        if self.seed is not None:
            argv += ["--seed", str(self.seed)]
        if not self.detached:
            argv.append("--lifeline")
        if self.realtime:
            argv.append("--realtime")
        return argv

    def start(self, log_path: str | None = None) -> "WanLine":
        check_prerequisites()
        _install_exit_handlers()
        repo_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo_root, env.get("PYTHONPATH")]))
        # Without a log file, keep stderr in an anonymous temp file so a failed start can say why.
        stderr = open(log_path, "ab") if log_path else tempfile.TemporaryFile()
        self._stderr = stderr
        # The lifeline: the forwarder holds the read end of this pipe as stdin and tears the
        # line down at EOF, i.e. as soon as this process dies, however it dies (even SIGKILL).
        self.proc = subprocess.Popen(
            self.forwarder_argv(), stdin=subprocess.DEVNULL if self.detached else subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=stderr, env=env, start_new_session=self.detached,
            text=True)
        # Names are fixed by the forwarder's pid, so stop() can clean up even a failed start.
        self.namespaces = {"a": f"pddA-{self.proc.pid}", "b": f"pddB-{self.proc.pid}"}
        if not self.detached:
            _live_lines.add(self)  # a detached line (CLI "up") must outlive this process
        try:
            ready = self._await_ready()
        except BaseException:
            self.stop()
            raise
        if ready["namespaces"] != self.namespaces:
            self.stop()
            raise RuntimeError(f"unexpected forwarder namespaces {ready['namespaces']}")
        return self

    def _await_ready(self) -> dict:
        assert self.proc is not None and self.proc.stdout is not None
        box: list[str] = []
        reader = threading.Thread(target=lambda: box.append(self.proc.stdout.readline()),
                                  daemon=True)
        reader.start()
        reader.join(START_TIMEOUT_S)
        line = box[0] if box else ""
        if not line.startswith("{"):
            code = self.proc.poll()
            raise RuntimeError(f"WAN forwarder did not start within {START_TIMEOUT_S:g} s (exit code "
                               f"{code}): {self.forwarder_stderr()[-2000:]!r}; command: "
                               f"{' '.join(self.forwarder_argv())}")
        return json.loads(line)

    def stop(self) -> None:
        with self._lock:
            proc, self.proc = self.proc, None
            if proc is not None:
                stop_process(proc)
                self.last_stats = _parse_exit_stats(self.forwarder_stderr())
                for stream in (proc.stdin, proc.stdout, self._stderr):
                    if stream is not None:
                        with contextlib.suppress(OSError):
                            stream.close()
            # The forwarder deletes its namespaces on the way out; if it was killed it could
            # not, so do it here (destroy() is idempotent).
            for name in self.namespaces.values():
                netns.destroy(name)
            _live_lines.discard(self)

    def __enter__(self) -> "WanLine":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def forwarder_stderr(self) -> str:
        """What the forwarder wrote to stderr so far (its exit stats line comes last)."""
        stream = getattr(self, "_stderr", None)
        if stream is None or stream.closed:
            return ""
        stream.flush()
        with open(f"/proc/self/fd/{stream.fileno()}", "rb") as reader:
            return reader.read().decode(errors="replace")

    def stats(self, timeout_s: float = 5.0) -> dict:
        """The forwarder's counters per direction now: packets, bytes, drops (line buffer
        overflow) and lateness (how far it fell behind its schedule, e.g. when starved)."""
        if not self.is_up():
            raise RuntimeError("the line is not running")
        before = self.forwarder_stderr().count('{"running"')
        os.kill(self.proc.pid, signal.SIGUSR1)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            text = self.forwarder_stderr()
            if text.count('{"running"') > before:
                return _parse_exit_stats(text, "running")
            time.sleep(0.01)
        raise TimeoutError("the forwarder did not report its counters")

    @property
    def forwarder_pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def is_up(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    # -- using the line ----------------------------------------------------------------------
    def exec_prefix(self, side: str) -> list[str]:
        """argv prefix that runs a command in cluster ``side`` ("a" or "b")."""
        return ["ip", "netns", "exec", self.namespace(side)]

    def namespace(self, side: str) -> str:
        if side not in SIDES:
            raise ValueError(f"side must be one of {SIDES}, not {side!r}")
        if not self.namespaces:
            raise RuntimeError("the line is not started")
        return self.namespaces[side]

    def address(self, side: str) -> str:
        if side not in SIDES:
            raise ValueError(f"side must be one of {SIDES}, not {side!r}")
        return self.addresses[side]

    def prefill_flags(self) -> tuple[str, ...]:
        """A prefill's declaration of this line, which sizes its WAN copies' window
        (``--pdd-wan-bandwidth-gbps``, ``--pdd-wan-rtt-ms``), and a main's across it, which sizes
        its staging rings; a line with no rate limit is declared at the forwarder's ceiling,
        about 1 Gbit/s (``scripts/wan_check.py``)."""
        gbps = self.rate_mbit / 1e3 if self.rate_mbit > 0 else UNLIMITED_LINE_GBPS
        return ("--pdd-wan-bandwidth-gbps", repr(gbps),
                "--pdd-wan-rtt-ms", repr(max(self.rtt_ms, 0.1)))

    def popen(self, side: str, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen([*self.exec_prefix(side), *argv], **kwargs)

    def socket(self, side: str, family: int = socket.AF_INET,
               type: int = socket.SOCK_STREAM) -> socket.socket:
        """A socket that lives in cluster ``side``'s namespace (usable from any thread)."""
        with netns.entered(self.namespace(side)):
            return socket.socket(family, type)

    def counters(self, side: str) -> dict[str, int]:
        """Kernel counters of this side's end of the line (tx = bytes sent into the line)."""
        return netns.link_counters(self.namespace(side), DEVICE)

    def describe(self) -> dict:
        return {"pid": self.forwarder_pid, "rate_mbit": self.rate_mbit, "rtt_ms": self.rtt_ms,
                "jitter_ms": self.jitter_ms, "queue_bytes": self.queue_bytes(), "mtu": self.mtu, "realtime": self.realtime,
                "namespaces": self.namespaces, "addresses": self.addresses,
                "exec_prefix": {s: self.exec_prefix(s) for s in SIDES}}


def _parse_exit_stats(stderr_text: str, kind: str = "stopped") -> dict | None:
    for text in reversed(stderr_text.splitlines()):
        if text.startswith('{"' + kind + '"'):
            return json.loads(text)["stats"]
    return None


def check_prerequisites() -> None:
    """Raise with a plain reason when this machine cannot host a line."""
    if os.geteuid() != 0:
        raise PermissionError("the WAN emulator needs root (network namespaces, TUN devices)")
    if not os.path.exists("/dev/net/tun"):
        raise FileNotFoundError("/dev/net/tun is missing (no TUN support in this kernel/container)")
    if subprocess.run(["ip", "-V"], capture_output=True).returncode != 0:
        raise FileNotFoundError("iproute2 'ip' not found: apt-get install -y iproute2")


def stop_process(proc: Optional[subprocess.Popen], grace_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after ``grace_s``; reaped either way."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def stop_all() -> None:
    for line in list(_live_lines):
        with contextlib.suppress(Exception):
            line.stop()


def _on_fatal_signal(signum, frame):
    stop_all()
    # Re-deliver with the default action so the exit status still says "killed by signal".
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _install_exit_handlers() -> None:
    global _handlers_installed
    if _handlers_installed:
        return
    _handlers_installed = True
    atexit.register(stop_all)
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set from the main thread; the lifeline still holds
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) in (signal.SIG_DFL, None):
            signal.signal(sig, _on_fatal_signal)
