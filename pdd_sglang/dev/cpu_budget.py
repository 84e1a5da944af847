"""Equal compute per role: each SGLang server in its own cgroup v1 CPU group with the same quota.

In the systems being emulated every role has its own accelerator. On a small CPU machine the
servers of one setup would otherwise compete for the same cores, and PDD (three servers) would be
measured against same-DC PD (two servers) on unequal compute. So every server of every setup gets
one group under the ``cpu`` controller with the same CFS quota (``cpu.cfs_quota_us`` per
``cpu.cfs_period_us``), and the rest of the machine is left as headroom for the router, the line's
forwarder and the clients.

Life cycle of a group:

1. :func:`check_cpu_controller` refuses early, with one clear reason, when the controller is not
   mounted or not writable (not root, a read-only /sys/fs/cgroup).
2. :class:`CpuGroup` ``.create()`` makes ``/sys/fs/cgroup/cpu/<name>`` (and the same name under
   ``cpuacct`` when that controller is mounted apart) and writes the period, no quota yet (start-up
   runs unthrottled); ``.limit()`` sets the quota once the servers are ready.
3. ``.exec_prefix()`` is a command prefix that moves the shell into the group(s) and then execs the
   server, so the server and every process and thread it starts are in it from their first
   instruction.
4. ``.snapshot()`` reads what the group used: CPU time (``cpuacct.usage``), time its tasks waited
   runnable on a run queue (field 2 of ``/proc/<tid>/schedstat``, per thread; a share counts the
   threads alive at both snapshots), time each thread ran (field 1, summed per thread name: which
   thread used the quota), and time the quota throttled it (``cpu.stat``). Two snapshots give a
   setup's share.
5. ``.remove()`` SIGKILLs anything still in the group (only processes this module put there) and
   removes the directories; the caller stops its servers first.

The pinned layout (:func:`pinned_layout`, the demo's ``--cpu-layout pinned``): a quota bounds a
server's CPU, not whom it waits behind. With every process free to run on every core, a setup that
keeps more processes busy at once (PDD's relay, the line's real-time forwarder) may make a server
wait longer on the run queue than same-DC PD does, on the same quota. Pinned, a group also gets a
``cpuset`` group: cluster A's servers share the first half of the cores, cluster B's main and the
rest (the router, the clients, the line's forwarder: they inherit the starter's affinity,
:func:`pin_self`) the second.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import psutil

CPU_ROOT = Path("/sys/fs/cgroup/cpu")
CPUACCT_ROOT = Path("/sys/fs/cgroup/cpuacct")
CPUSET_ROOT = Path("/sys/fs/cgroup/cpuset")
PERIOD_US = 20_000  # short periods: a throttled server waits at most this long for its next slice
ENTER_AND_EXEC = 'for g in "$@"; do [ "$g" = -- ] && break; echo $$ > "$g/cgroup.procs"; shift; ' \
                 'done; shift; exec "$@"'


def check_cpu_controller(root: Path = CPU_ROOT) -> None:
    """Raise with a plain reason when no writable cgroup v1 CPU controller is mounted at root."""
    if not (root / "cpu.cfs_quota_us").exists():
        raise FileNotFoundError(
            f"no cgroup v1 CPU controller at {root} (needs `mount -t cgroup -o cpu cgroup {root}`)")
    probe = root / f"pdd-probe-{os.getpid()}"
    try:
        probe.mkdir(exist_ok=True)
        (probe / "cpu.cfs_quota_us").write_text("-1")
    except OSError as err:
        raise PermissionError(f"the cgroup CPU controller at {root} is not writable ({err}); "
                              "run as root with /sys/fs/cgroup mounted read-write") from None
    finally:
        with contextlib.suppress(OSError):
            probe.rmdir()


def server_cpu_quota(servers_at_once: int, headroom_cores: float = 0.5,
                     cap_cores: float = 1.0) -> float:
    """Cores per server: the machine less the headroom, shared by the servers one setup runs."""
    cores = len(os.sched_getaffinity(0))
    return round(min(cap_cores, max(0.1, (cores - headroom_cores) / servers_at_once)), 3)


def pinned_layout(cpus: Optional[list] = None) -> dict:
    """``{"a": cores, "b": cores}``: cluster A's servers on the first half of the cores, cluster
    B's server and everything else on the second."""
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else sorted(cpus)
    if len(cpus) < 2:
        raise ValueError(f"a pinned layout needs 2 cores or more, this process may use {cpus}")
    half = len(cpus) // 2
    return {"a": tuple(cpus[:half]), "b": tuple(cpus[half:])}


LAYOUTS = ("shared", "pinned", "prefill-apart")


def server_cores(layout: str, cluster_of: dict, cpus: Optional[list] = None) -> Optional[dict]:
    """Each server's cores under ``layout`` (``cluster_of``: server name -> "a" or "b"); None
    for ``shared`` (every core). ``pinned``: cluster A's servers on the first half of the cores,
    cluster B's on the second. ``prefill-apart``: the prefill alone on the first half, every
    decode server on the second, so no decode server's work (a relay's eager decode beside a
    main's) takes the prefill's cycles, as on a deployment where each has its own accelerator.
    The router, the clients and the line go on the second half in both (:func:`pinned_layout`)."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown CPU layout {layout!r}; one of {', '.join(LAYOUTS)}")
    if layout == "shared":
        return None
    halves = pinned_layout(cpus)
    if layout == "pinned":
        return {name: halves[side] for name, side in cluster_of.items()}
    return {name: halves["a" if name == "prefill" else "b"] for name in cluster_of}


def check_cpuset_controller(root: Path = CPUSET_ROOT) -> None:
    """Raise with a plain reason when no writable cgroup v1 cpuset controller is mounted at root."""
    if not (root / "cpuset.cpus").exists():
        raise FileNotFoundError(f"no cgroup v1 cpuset controller at {root} (needs `mount -t cgroup "
                                f"-o cpuset cgroup {root}`; or run the demo with --cpu-layout shared)")
    if not os.access(root, os.W_OK):
        raise PermissionError(f"the cgroup cpuset controller at {root} is not writable; run as root "
                              "(or run the demo with --cpu-layout shared)")


def pin_self(cpus: tuple) -> None:
    """This process, and what it starts from now on, on ``cpus`` only."""
    os.sched_setaffinity(0, set(cpus))


def process_cpu_s(pid: int) -> Optional[float]:
    """CPU seconds a process (every thread of it) has used so far; None once it is gone."""
    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return None
    return times.user + times.system


@dataclass
class CpuSnapshot:
    at: float
    cpu_s: float
    wait_ns_by_tid: dict
    throttled_s: float
    throttled_periods: int
    periods: int
    run_ns_by_tid: dict = field(default_factory=dict)
    name_by_tid: dict = field(default_factory=dict)


class CpuGroup:
    def __init__(self, name: str, cores: float, period_us: int = PERIOD_US,
                 cpus: Optional[tuple] = None):
        if not cores > 0:
            raise ValueError(f"cores must be > 0, got {cores}")
        self.name, self.cores, self.period_us, self.cpus = name, cores, period_us, cpus
        self.cpu_dir = CPU_ROOT / name
        self.acct_dir = CPUACCT_ROOT / name if _separate_cpuacct() else self.cpu_dir
        self.cpuset_dir = CPUSET_ROOT / name if cpus else None
        self.created = False

    @property
    def dirs(self) -> list[Path]:
        return list(dict.fromkeys([self.cpu_dir, self.acct_dir,
                                   *([self.cpuset_dir] if self.cpuset_dir else [])]))

    def create(self) -> "CpuGroup":
        """The group, without a quota until :meth:`limit`: servers start up faster unthrottled,
        and no measurement runs before the quota is set."""
        for path in self.dirs:
            path.mkdir(exist_ok=True)
        self.created = True
        if self.cpuset_dir is not None:  # a new cpuset is empty: tasks join it only once set;
            for knob in ("cpuset.mems", "cpuset.cpus"):  # every core until limit(), as the quota
                (self.cpuset_dir / knob).write_text(
                    (self.cpuset_dir.parent / knob).read_text().strip())
        (self.cpu_dir / "cpu.cfs_period_us").write_text(str(self.period_us))
        (self.cpu_dir / "cpu.cfs_quota_us").write_text("-1")
        return self

    def limit(self) -> None:
        """The quota, ``cores`` per CFS period, and the group's cores when pinned (the kernel
        moves every task of the group onto them)."""
        (self.cpu_dir / "cpu.cfs_quota_us").write_text(str(int(self.cores * self.period_us)))
        if self.cpuset_dir is not None:
            (self.cpuset_dir / "cpuset.cpus").write_text(",".join(map(str, self.cpus)))

    def exec_prefix(self) -> tuple:
        return ("sh", "-c", ENTER_AND_EXEC, f"cpu-{self.name}", *map(str, self.dirs), "--")

    def tids(self) -> list[int]:
        with contextlib.suppress(OSError):
            return [int(t) for t in (self.cpu_dir / "tasks").read_text().split()]
        return []

    def snapshot(self) -> CpuSnapshot:
        stat = dict(line.split() for line in (self.cpu_dir / "cpu.stat").read_text().splitlines()
                    if len(line.split()) == 2)
        wait_ns, run_ns, names = {}, {}, {}
        for tid in self.tids():
            with contextlib.suppress(OSError, ValueError, IndexError):
                fields = Path(f"/proc/{tid}/schedstat").read_text().split()
                run_ns[tid], wait_ns[tid] = int(fields[0]), int(fields[1])
                names[tid] = Path(f"/proc/{tid}/comm").read_text().strip()
        usage_ns = int((self.acct_dir / "cpuacct.usage").read_text()) \
            if (self.acct_dir / "cpuacct.usage").exists() else int(stat.get("usage_usec", 0)) * 1000
        return CpuSnapshot(time.monotonic(), usage_ns / 1e9, wait_ns,
                           int(stat.get("throttled_time", 0)) / 1e9,
                           int(stat.get("nr_throttled", 0)), int(stat.get("nr_periods", 0)),
                           run_ns, names)

    def usage_between(self, before: CpuSnapshot, after: CpuSnapshot) -> dict:
        """What the group used between two snapshots (run-queue wait: threads alive at both)."""
        wall = max(after.at - before.at, 1e-9)
        cpu = after.cpu_s - before.cpu_s
        wait_ns = sum(ns - before.wait_ns_by_tid[tid] for tid, ns in after.wait_ns_by_tid.items()
                      if tid in before.wait_ns_by_tid)
        return {"quota_cores": self.cores, "cpus": list(self.cpus) if self.cpus else None,
                "wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
                "cores_used": round(cpu / wall, 3),
                "run_queue_wait_s": round(wait_ns / 1e9, 2),
                "throttled_s": round(after.throttled_s - before.throttled_s, 2),
                "throttled_periods": after.throttled_periods - before.throttled_periods,
                "periods": after.periods - before.periods,
                "cpu_s_by_thread": _by_thread_name(before, after),
                "busiest_threads": _busiest_threads(before, after)}

    def remove(self, timeout_s: float = 10.0) -> None:
        if not self.created:
            return
        deadline = time.monotonic() + timeout_s
        for path in self.dirs:
            while path.exists():
                for pid in _pids(path):
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, signal.SIGKILL)
                try:
                    path.rmdir()
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
        self.created = False

    def exists(self) -> bool:
        return any(path.exists() for path in self.dirs)


def _thread_cpu_ns(before: CpuSnapshot, after: CpuSnapshot) -> list:
    """``(ns on the CPU, tid)`` between the snapshots, for the threads alive at both."""
    return [(ns - before.run_ns_by_tid[tid], tid) for tid, ns in after.run_ns_by_tid.items()
            if tid in before.run_ns_by_tid]


def _by_thread_name(before: CpuSnapshot, after: CpuSnapshot, top: int = 8) -> dict:
    """CPU seconds summed per thread name (``comm``), the ``top`` largest: which of a server's
    threads used its quota."""
    by_name: dict = {}
    for ns, tid in _thread_cpu_ns(before, after):
        name = after.name_by_tid.get(tid, "?")
        by_name[name] = by_name.get(name, 0) + ns
    ranked = sorted(by_name.items(), key=lambda kv: (-kv[1], kv[0]))[:top]
    return {name: round(ns / 1e9, 2) for name, ns in ranked}


def _busiest_threads(before: CpuSnapshot, after: CpuSnapshot, top: int = 6) -> list:
    """``[name, tid, CPU seconds]`` of the ``top`` busiest threads: a thread a library starts
    inherits its creator's name, so a name's sum can hide which thread it was."""
    ranked = sorted(_thread_cpu_ns(before, after), key=lambda u: (-u[0], u[1]))[:top]
    return [[after.name_by_tid.get(tid, "?"), tid, round(ns / 1e9, 2)] for ns, tid in ranked]


def _pids(path: Path) -> list[int]:
    with contextlib.suppress(OSError):
        return [int(p) for p in (path / "cgroup.procs").read_text().split()]
    return []


def _separate_cpuacct() -> bool:
    return CPUACCT_ROOT.exists() and CPUACCT_ROOT.resolve() != CPU_ROOT.resolve() \
        and (CPUACCT_ROOT / "cpuacct.usage").exists()
