"""SGLang servers and the PDD router inside the WAN emulator's namespaces.

A server started with ``exec_prefix=line.exec_prefix(side)`` lives in that side's network
namespace; from the host it is unreachable (by design: nothing bypasses the line). So every HTTP
call the test harness makes to it (readiness, ``/server_info``, ``wait_idle``) runs in a thread
that has entered the same namespace (``netns.entered``: a namespace switch is per thread). Those
calls go to the server's own namespace, never across the line, so they do not show up in the
line's counters.
"""

from __future__ import annotations

import contextlib
import os
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from pdd_sglang.dev.testing.cluster import (TEST_API_KEY, TEST_ROUTER_KEY, SGLangServer,
                                             bearer, free_port)
from pdd_sglang.dev.wan_emulator import netns


def in_namespace(name: Optional[str]):
    """Context manager: the calling thread inside network namespace ``name`` (None: stay)."""
    return netns.entered(name) if name else contextlib.nullcontext()


@dataclass(eq=False)
class NetnsServer(SGLangServer):
    """An :class:`SGLangServer` whose harness-side HTTP calls run inside namespace ``netns``."""

    netns: Optional[str] = None

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        with in_namespace(self.netns):
            super().wait_ready(timeout_s)

    def get_json(self, path: str, timeout_s: float = 30.0):
        with in_namespace(self.netns):
            return super().get_json(path, timeout_s)

    def post_json(self, path: str, body: dict, timeout_s: float = 300.0):
        with in_namespace(self.netns):
            return super().post_json(path, body, timeout_s)

    def post_raw(self, path: str, timeout_s: float = 60.0) -> int:
        """POST with an empty body; the HTTP status (e.g. ``/flush_cache``)."""
        with in_namespace(self.netns):
            request = urllib.request.Request(self.url + path, data=b"", method="POST",
                                             headers=self.headers)
            try:
                with urllib.request.urlopen(request, timeout=timeout_s) as resp:
                    return resp.status
            except urllib.error.HTTPError as err:
                with err:
                    return err.code


class RouterProcess:
    """``python -m pdd_sglang.router`` in a namespace, in its own process group, always stopped.

    With keys on, as the test clusters run: it takes ``api_key`` from its clients (``headers``)
    and sends the servers ``server_api_key``, both from the environment (out of the process
    list). ``expose``: every answer carries the router's summary (the tests and the demo's
    stage split read it)."""

    def __init__(self, log_path: Path, args: Sequence[str], *, host: str = "127.0.0.1",
                 exec_prefix: Sequence[str] = (), netns_name: Optional[str] = None,
                 api_key: Optional[str] = TEST_ROUTER_KEY,
                 server_api_key: Optional[str] = TEST_API_KEY, expose: bool = True,
                 ca_file: Optional[str] = None):
        self.host = host
        self.log_path = Path(log_path)
        self.netns = netns_name
        self.headers = bearer(api_key)
        # The router serves TLS (its --ssl-certfile in ``args``): verified against this bundle.
        self.context = ssl.create_default_context(cafile=ca_file) if ca_file else None
        self._exec_prefix = tuple(exec_prefix)
        self._args = (*args, *(("--expose-internal-details",) if expose else ()))
        repo_root = Path(__file__).resolve().parents[3]
        keys = {"PDD_ROUTER_API_KEY": api_key or "", "PDD_SERVER_API_KEY": server_api_key or ""}
        self.env = {**os.environ, **keys,
                    "PYTHONPATH": os.pathsep.join(filter(None, [str(repo_root),
                                                                os.environ.get("PYTHONPATH")]))}
        self._new_port()
        self.process: Optional[subprocess.Popen] = None

    def _new_port(self) -> None:
        # Free on the host; inside a namespace a server may hold it already (then: retry).
        self.port = free_port()
        self.url = f"{'https' if self.context else 'http'}://{self.host}:{self.port}"
        self.command = [*self._exec_prefix, sys.executable, "-m", "pdd_sglang.router",
                        "--host", self.host, "--port", str(self.port), *self._args]

    def start(self, timeout_s: float = 300.0, attempts: int = 3) -> None:
        for attempt in range(attempts):
            try:
                return self._start_once(timeout_s)
            except RuntimeError as err:
                if "address already in use" not in str(err) or attempt == attempts - 1:
                    raise
                self._new_port()

    def _start_once(self, timeout_s: float) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"$ {' '.join(self.command)}\n".encode())
            log.flush()
            started_at = log.tell()
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                            env=self.env, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"router exited with {self.process.returncode}:\n"
                                   f"{self.log_tail()}")
            try:
                with in_namespace(self.netns):
                    with urllib.request.urlopen(self.url + "/ready", timeout=5,
                                                context=self.context) as resp:
                        # The port is picked free outside the router's namespace, so another
                        # server there may hold it and answer: ready once this router listens.
                        if resp.status == 200 and self._listening_since(started_at):
                            return
            except urllib.error.HTTPError as err:  # the error holds the response: close it
                err.close()
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"router not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def get_text(self, path: str, timeout_s: float = 30.0) -> str:
        request = urllib.request.Request(self.url + path, headers=self.headers)
        with in_namespace(self.netns):
            with urllib.request.urlopen(request, timeout=timeout_s,
                                        context=self.context) as resp:
                return resp.read().decode()

    def _listening_since(self, offset: int) -> bool:
        with open(self.log_path, "rb") as log:
            log.seek(offset)
            return b"PDD router listening on" in log.read()

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return "(no log)"

    def stop(self) -> None:
        proc, self.process = self.process, None
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
