"""Real SGLang servers for tests and demos: start on free ports, wait, read state, always stop.

Each server is a ``python -m sglang.launch_server`` process in its own process group, logging to a
file. ``Cluster`` starts several at once (startup dominates on 2 cores) and stops every one of
them on every exit path: normal exit, an exception, a failed start, or interpreter exit.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

from pdd_sglang.dev.testing.fork_launch import SPAWNED_INSTEAD

# The CPU profile's serving settings: SGLang's CPU engine with the torch-native attention backend
# and float32, so greedy tokens are reproducible across processes and batch shapes.
CPU_SERVER_ARGS = (
    "--device", "cpu",
    "--attention-backend", "torch_native",
    "--dtype", "float32",
    "--skip-server-warmup",
    "--disable-cuda-graph",
    # Idle schedulers otherwise busy-poll; several servers share 2 cores here.
    "--sleep-on-idle",
)
# SGLang keeps its overlap loop on a CPU server (PDD's relay and main run the non-overlap one by
# role). A CPU forward is synchronous, so that loop runs the next batch's whole forward before it
# finishes the previous batch (a prefill: hands its KV to the sender), where a GPU would only
# launch it: one more forward in a request's TTFT whenever a batch follows. The demo's prefill and
# the profiled servers run the non-overlap loop, as a GPU prefill effectively does.
NON_OVERLAP_LOOP_ARGS = ("--disable-overlap-schedule",)
# A decode server without a radix cache backs retracted requests up in a host pool by default,
# which pins memory through CUDA; on the CPU engine per-request CPU tensors do the same job.
RELAY_CPU_ARGS = ("--disaggregation-decode-retraction-backup", "cpu_tensor")
CPU_SERVER_ENV = {
    "SGLANG_USE_CPU_ENGINE": "1",
    # One torch thread per server: a machine of 2 cores runs several servers at once, and two
    # OpenMP threads each spin-wait after every parallel region of the tiny model's small ops
    # (measured: 16 requests x 100 tokens, 4.5 CPU-s of the server at 2 threads, 2.0 at 1, the
    # same wall time). Every server runs alike, so greedy tokens still agree across them.
    "OMP_NUM_THREADS": "1",
    # SGLang's own idle-time leak check: a leaked KV slot raises instead of warning.
    "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1",
    # SGLang's fast start-up path: the tiny Llama's class is found without importing the other
    # ~250 model modules (any other model still loads them; see the package's docstring).
    "SGLANG_EXTERNAL_MODEL_PACKAGE": "pdd_sglang.dev.testing.sglang_models",
}
# The test clusters and the demo run with keys on, as a deployment should: every server takes
# SGLang's --api-key TEST_API_KEY (its /health, /ready and /metrics stay open), a router in front
# of them sends it upstream and takes TEST_ROUTER_KEY from its clients (wan_cluster.RouterProcess).
TEST_API_KEY = "pdd-test-server-key"
TEST_ROUTER_KEY = "pdd-test-router-key"


def bearer(key: Optional[str]) -> dict:
    """The request headers that carry ``key`` (none without one)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


# Set to 1 in a run's environment (the suite's demo runs), its servers fork their children
# (``fork_launch``): the default for SGLangServer.fork_children.
FORK_CHILDREN_ENV = "PDD_TEST_FORK_SERVER_CHILDREN"
_LIVE: set["SGLangServer"] = set()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerStartError(RuntimeError):
    pass


class PortTaken(ServerStartError):
    """Another process took the free port between our probe and the server's bind."""


@dataclass(eq=False)
class SGLangServer:
    name: str
    model_path: Path
    log_dir: Path
    extra_args: tuple = ()
    host: str = "127.0.0.1"
    max_total_tokens: int = 20000
    env: dict = field(default_factory=dict)
    # Command prefix to run the server elsewhere, e.g. inside a network namespace.
    exec_prefix: tuple = ()
    port: int = field(default_factory=free_port)
    # Scheduler and detokenizer forked from the launcher, not spawned: test servers only, about
    # 20 CPU-seconds and 0.9 GB less per server here (see fork_launch for what that gives up).
    fork_children: bool = field(default_factory=lambda: os.environ.get(FORK_CHILDREN_ENV) == "1")
    process: Optional[subprocess.Popen] = None
    api_key: Optional[str] = TEST_API_KEY  # SGLang's --api-key; None: an open server
    # With SGLang's --ssl-certfile/--ssl-keyfile in extra_args: served on https, verified here
    # against this CA bundle.
    ca_file: Optional[str] = None

    @property
    def headers(self) -> dict:
        """What a request to this server carries besides its body: its key."""
        return bearer(self.api_key)

    @property
    def url(self) -> str:
        return f"{'https' if self.ca_file else 'http'}://{self.host}:{self.port}"

    def urlopen(self, request, timeout_s: float):
        """urllib's urlopen, trusting the server's CA where it serves TLS."""
        context = ssl.create_default_context(cafile=self.ca_file) if self.ca_file else None
        return urllib.request.urlopen(request, timeout=timeout_s, context=context)

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.name}.log"

    def command(self) -> list[str]:
        return [
            *self.exec_prefix,
            sys.executable, "-m",
            "pdd_sglang.dev.testing.fork_launch" if self.fork_children else "sglang.launch_server",
            "--model-path", str(self.model_path),
            "--host", self.host,
            "--port", str(self.port),
            "--max-total-tokens", str(self.max_total_tokens),
            *CPU_SERVER_ARGS,
            *(("--api-key", self.api_key) if self.api_key else ()),
            *self.extra_args,
        ]

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        # Mooncake and the bootstrap server advertise this address; without it SGLang picks the
        # NIC's address, and test traffic must stay on loopback or the emulated line.
        env = {**os.environ, **CPU_SERVER_ENV, "SGLANG_HOST_IP": self.host, **self.env}
        log = open(self.log_path, "ab")
        try:
            log.write(f"$ {' '.join(self.command())}\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, env=env,
                start_new_session=True, preexec_fn=_die_with_parent,
            )
        finally:
            log.close()
        _LIVE.add(self)

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._port_taken():
                raise PortTaken(f"{self.name}: port {self.port} was taken before the server bound it")
            if self.process is not None and self.process.poll() is not None:
                raise ServerStartError(
                    f"{self.name} exited with code {self.process.returncode} during start-up; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            try:
                with self.urlopen(self.url + "/health", 5) as resp:
                    if resp.status == 200:
                        self._warn_if_spawned_instead()
                        return
            except urllib.error.HTTPError as err:  # 503 while it starts; the error holds the body
                err.close()
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(1.0)
        raise ServerStartError(
            f"{self.name} not ready after {timeout_s:.0f} s; log {self.log_path}:\n{self.log_tail()}"
        )

    def _warn_if_spawned_instead(self) -> None:
        """A server meant to fork its children that spawned one still works, at spawn's cost:
        say so in the test report, where a slow suite would otherwise go unexplained."""
        if not self.fork_children:
            return
        with open(self.log_path, errors="replace") as log:
            lines = [line.strip() for line in log if line.startswith(SPAWNED_INSTEAD)]
        if lines:
            warnings.warn(f"{self.name}: " + "; ".join(lines), RuntimeWarning, stacklevel=3)

    def _port_taken(self) -> bool:
        try:
            with open(self.log_path, errors="replace") as log:
                return f"('{self.host}', {self.port}): address already in use" in log.read()
        except FileNotFoundError:
            return False

    def restart_on_new_port(self) -> None:
        self.stop(grace_s=5.0)
        self.port = free_port()
        self.start()

    def wait_ready_moving_port(self, timeout_s: float = 300.0, tries: int = 3) -> None:
        """``wait_ready``; a port another process took between ``free_port`` and the bind (an
        ephemeral port another connection was given) moves the server to a fresh one, at most
        ``tries`` ports in all."""
        for attempt in range(tries):
            try:
                self.wait_ready(timeout_s)
                return
            except PortTaken:
                if attempt == tries - 1:
                    raise
                self.restart_on_new_port()

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, grace_s: float = 20.0) -> None:
        self.begin_stop()
        self.finish_stop(grace_s)

    def begin_stop(self) -> None:
        """SIGTERM to the server process alone: SGLang's own handler stops its scheduler and
        detokenizer, and PDD closes what it owns on the scheduler's way out (a signal to the
        whole group would kill the scheduler before it could)."""
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(self.process.pid, signal.SIGTERM)

    def finish_stop(self, grace_s: float = 20.0) -> None:
        """Wait for the graceful stop, then make sure nothing of the group is left."""
        proc, self.process = self.process, None
        _LIVE.discard(self)
        if proc is None:
            return
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            _signal_group(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        # SGLang forks a scheduler and a detokenizer: none may outlive the server process.
        _signal_group(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return "(no log)"
        # SGLang prints the whole server_args dict on one line: useless in a failure tail.
        text = [line for line in text if "server_args=" not in line]
        return "\n".join(text[-lines:])

    # ---- HTTP helpers -------------------------------------------------------------------
    def get_json(self, path: str, timeout_s: float = 30.0):
        request = urllib.request.Request(self.url + path, headers=self.headers)
        with self.urlopen(request, timeout_s) as resp:
            return json.loads(resp.read())

    def post_json(self, path: str, body: dict, timeout_s: float = 300.0):
        request = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", **self.headers},
        )
        with self.urlopen(request, timeout_s) as resp:
            return json.loads(resp.read())

    def pdd_state(self) -> dict:
        """PDD's part of /server_info (patch 0004): pool occupancy and transfer ledger."""
        states = self.get_json("/server_info")["internal_states"]
        return states[0]["pdd"]

    def wait_idle(self, timeout_s: float = 60.0) -> dict:
        """Wait until no request holds KV or tree locks; return the pool state seen last."""
        deadline = time.monotonic() + timeout_s
        pool = self.pdd_state()["pool"]
        while time.monotonic() < deadline:
            if pool["in_use_tokens"] == 0 and pool["locked_tokens"] == 0:
                return pool
            time.sleep(0.5)
            pool = self.pdd_state()["pool"]
        return pool


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it when the process that started it dies.

    A test runner killed outright (SIGKILL, or SIGTERM, which skips atexit) would otherwise leave
    its servers running; SGLang stops its own children on SIGTERM.
    """
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class Cluster:
    """Start servers together and stop them all, whatever happens."""

    def __init__(self, servers: Iterable[SGLangServer], ready_timeout_s: float = 420.0):
        self.servers = {server.name: server for server in servers}
        self.ready_timeout_s = ready_timeout_s

    def __getitem__(self, name: str) -> SGLangServer:
        return self.servers[name]

    def __enter__(self) -> "Cluster":
        self.start()
        return self.wait_ready()

    def start(self) -> None:
        """Start every server and return at once (``wait_ready`` waits)."""
        try:
            for server in self.servers.values():
                server.start()
        except BaseException:
            self.stop()
            raise

    def wait_ready(self) -> "Cluster":
        """Until every started server answers; on any failure all of them are stopped."""
        try:
            for server in self.servers.values():
                server.wait_ready_moving_port(self.ready_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        # All at once: each server's graceful stop takes seconds.
        for server in self.servers.values():
            server.begin_stop()
        for server in self.servers.values():
            server.finish_stop()

    def dead_servers(self) -> list[str]:
        return [name for name, server in self.servers.items() if not server.alive()]


@atexit.register
def _stop_leftovers() -> None:
    for server in list(_LIVE):
        server.stop(grace_s=5.0)
