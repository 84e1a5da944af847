"""Network-namespace and TUN plumbing for the WAN emulator (stdlib + ctypes only).

Python 3.11 has no ``os.setns``, so :func:`entered` calls libc's ``setns(2)`` through ctypes.
A network-namespace switch is per thread, which lets one process own sockets and TUN devices in
several namespaces: a socket or TUN file stays bound to the namespace it was created in.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import re
import signal
import struct
import subprocess
import time
from typing import Iterator

CLONE_NEWNET = 0x40000000
TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
NETNS_DIR = "/run/netns"
# Names are "pddA-<forwarder pid>" / "pddB-<forwarder pid>": the forwarder process owns both.
NAME_PATTERN = re.compile(r"^pdd[AB]-(\d+)$")

_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


@contextlib.contextmanager
def entered(name: str) -> Iterator[None]:
    """Run the body with the calling thread inside network namespace ``name``."""
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(os.path.join(NETNS_DIR, name), os.O_RDONLY)
    try:
        _setns(target)
        try:
            yield
        finally:
            _setns(home)
    finally:
        os.close(target)
        os.close(home)


def run_ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc


def exists(name: str) -> bool:
    return os.path.exists(os.path.join(NETNS_DIR, name))


def list_ours() -> list[str]:
    try:
        names = os.listdir(NETNS_DIR)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if NAME_PATTERN.match(n))


def create(name: str) -> None:
    run_ip("netns", "add", name)
    # A fresh namespace has lo down; local services (e.g. P<->RLD on 127.0.0.1) need it.
    run_ip("-n", name, "link", "set", "lo", "up")


def open_tun(name: str, device: str) -> int:
    """Create TUN ``device`` inside namespace ``name``; the device lives as long as the fd.

    The kernel binds a TUN device to the namespace the opening thread is in at open() time,
    so both the open and the TUNSETIFF happen inside the namespace.
    """
    with entered(name):
        fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", device.encode(), IFF_TUN | IFF_NO_PI))
            # No IPv6 on the line: router solicitations and DAD would add stray WAN traffic.
            with open(f"/proc/sys/net/ipv6/conf/{device}/disable_ipv6", "w") as knob:
                knob.write("1")
        except BaseException:
            os.close(fd)
            raise
    return fd


def pids_inside(name: str) -> list[int]:
    proc = run_ip("netns", "pids", name, check=False)
    return [int(p) for p in proc.stdout.split() if p.strip().isdigit()]


def destroy(name: str, grace_s: float = 3.0) -> None:
    """Stop every process left inside ``name`` (only our own line's processes run there), then
    delete it. Idempotent: a missing namespace is not an error."""
    if not exists(name):
        return
    pids = [p for p in pids_inside(name) if p != os.getpid()]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace_s
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if _alive(p)]
            if pids:
                time.sleep(0.05)
        if not pids:
            break
    run_ip("netns", "del", name, check=False)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def owner_alive(name: str) -> bool:
    """True when the forwarder whose pid is in the namespace name still runs (pid reuse is
    guarded by checking that the process really is our forwarder)."""
    match = NAME_PATTERN.match(name)
    if not match:
        return False
    pid = int(match.group(1))
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return b"pdd_sglang.dev.wan_emulator" in cmdline.read() and _alive(pid)
    except (FileNotFoundError, ProcessLookupError):
        return False


def cleanup_stale() -> list[str]:
    """Delete namespaces left by killed runs (their forwarder is gone). Returns what it removed."""
    removed = []
    for name in list_ours():
        if not owner_alive(name):
            destroy(name)
            removed.append(name)
    return removed


def link_counters(name: str, device: str) -> dict[str, int]:
    """Kernel byte/packet counters of ``device`` in namespace ``name``.

    Read from /proc/thread-self/net/dev: /sys/class/net shows the namespace sysfs was mounted
    in, not the one this thread has entered."""
    with entered(name):
        with open("/proc/thread-self/net/dev") as f:
            lines = f.read().splitlines()[2:]
    for line in lines:
        dev, _, fields = line.partition(":")
        if dev.strip() == device:
            v = [int(x) for x in fields.split()]
            return {"rx_bytes": v[0], "rx_packets": v[1], "tx_bytes": v[8], "tx_packets": v[9]}
    raise KeyError(f"{device} not found in namespace {name}")
