"""Session-wide: the integration marker, and runs that start in the background.

Some checks spend most of their time waiting, not computing, or run servers that fit beside
others: the quick demo waits on its servers' CPU quotas, its crash run on its two servers, the GPU
lock's resolution on the package index, the fault suite (and the chaos soak after it, on the same
servers) on its faults' hold times and restarts.
Each runs as a subprocess beside the tests in the foreground; its test takes the result later.
The quick demo starts as soon as the session has collected its test, beside the pure-logic tests
(``tests/integration/conftest.py`` orders them first); the others start on demand (the
``start_background`` fixture), where the machine has CPU and memory to spare
(``tests/integration/conftest.py`` says where), or when their test asks for the result. A
session that ends early stops what is still running (Ctrl-C to the demo and the fault suite,
which stop their servers, line and cgroups themselves).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from pdd_sglang.dev.testing.cluster import FORK_CHILDREN_ENV

REPO = Path(__file__).resolve().parents[1]
_RUNS = pytest.StashKey[dict]()


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/integration" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.integration)


class BackgroundRun:
    """A command started now, its output in files (no pipe to fill), its result later."""

    def __init__(self, argv: list[str], out: Path, env: dict | None = None):
        self.out = out
        self._stdout, self._stderr = open(out / "stdout.txt", "w+"), open(out / "stderr.txt", "w+")
        self.process = subprocess.Popen(argv, stdout=self._stdout, stderr=self._stderr, cwd=REPO,
                                        env=env, start_new_session=True)

    def result(self, timeout_s: float) -> subprocess.CompletedProcess:
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            raise
        return subprocess.CompletedProcess(self.process.args, self.process.returncode,
                                           self._read(self._stdout), self._read(self._stderr))

    @staticmethod
    def _read(file) -> str:
        file.flush()
        file.seek(0)
        return file.read()

    def stop(self) -> None:
        """Ctrl-C first, as a user would; then the whole group."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def _wan_capable() -> bool:
    from pdd_sglang.dev.wan_emulator import check_prerequisites

    try:
        check_prerequisites()
    except (PermissionError, FileNotFoundError):
        return False  # the test skips, saying why
    return True


def _script(out: Path, script: str, *args: str, env: dict | None = None) -> BackgroundRun | None:
    if not _wan_capable():
        return None
    return BackgroundRun([sys.executable, str(REPO / "scripts" / script), *args], out,
                         env=None if env is None else {**os.environ, **env})


# The demo's and the fault suite's servers fork their children here
# (pdd_sglang/dev/testing/fork_launch.py: 20 CPU-s and 0.9 GB less per server, and the fault suite
# restarts its relay and main); `make demo` and `scripts/fault_suite.py` run alone keep SGLang's
# spawn, and so do the no-role pair and the two-datacenter test's servers.
FORKED_SERVERS = {FORK_CHILDREN_ENV: "1"}


def _quick_demo(out: Path) -> BackgroundRun | None:
    return _script(out, "demo.py", "--quick", "--out", str(out), env=FORKED_SERVERS)


def _crash_demo(out: Path) -> BackgroundRun | None:
    """The quick demo with main killed after its first request: the cleanup on a crash."""
    return _script(out, "demo.py", "--quick", "--inject-crash", "1", "--out", str(out),
                   env=FORKED_SERVERS)


# The chaos soak's minutes of load, run on the quick fault suite's servers right after it.
SOAK_MINUTES = "1"


def _fault_suite(out: Path) -> BackgroundRun | None:
    return _script(out, "fault_suite.py", "--quick", "--soak", SOAK_MINUTES, "--out", str(out),
                   "--logs", str(out / "logs"), env=FORKED_SERVERS)


def _gpu_lock_resolution(out: Path) -> BackgroundRun:
    # A pip dry run in hash mode against the index's wheels (not a local CPU wheel folder).
    return BackgroundRun([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed",
                          "--quiet", "--disable-pip-version-check", "--require-hashes", "-r",
                          str(REPO / "requirements" / "gpu.lock")], out,
                         env={**os.environ, "PIP_FIND_LINKS": ""})


# test name -> how to start its run; these start once the session has collected the test
BACKGROUND = {"test_quick_demo_runs_both_points_and_pdd_hands_off": _quick_demo}
# name -> how to start it; these start when start_background() is first called for them, or, for
# a test's own run (its name), when the test itself asks for it (the ``background`` fixture)
ON_DEMAND = {
    "fault_suite": _fault_suite,
    "test_server_crash_mid_run_still_cleans_up": _crash_demo,
    "test_the_lock_resolves_against_the_index_with_hashes_required": _gpu_lock_resolution,
}


def _start(config, name: str, starter) -> BackgroundRun | None:
    runs = config.stash.setdefault(_RUNS, {})
    if name not in runs:
        runs[name] = starter(Path(tempfile.mkdtemp(prefix=f"pdd-{name.removeprefix('test_')[:25]}-")))
    return runs[name]


@pytest.fixture(scope="session")
def start_background(request):
    """``start_background(name)``: start the on-demand run ``name`` now unless it already runs;
    returns it, or None where it cannot run here."""
    return lambda name: _start(request.config, name, ON_DEMAND[name])


def pytest_collection_finish(session):
    if session.config.option.collectonly:
        return
    starters = dict(BACKGROUND)
    if not any(item.get_closest_marker("integration") for item in session.items):
        starters.update(ON_DEMAND)  # no servers for them to wait for: a test's own run starts now
    for name in sorted({item.originalname for item in session.items} & set(starters)):
        _start(session.config, name, starters[name])


def pytest_sessionfinish(session):
    for run in session.config.stash.get(_RUNS, {}).values():
        if run is not None:
            run.stop()


@pytest.fixture(scope="session")
def still_running(request):
    """``still_running(name)``: whether the background run ``name`` started and has not ended."""
    def check(name: str) -> bool:
        run = request.config.stash.get(_RUNS, {}).get(name)
        return run is not None and run.process.poll() is None
    return check


@pytest.fixture
def background(request):
    """This test's background run (started at collection or on demand, else now; ``result()``
    waits for it). Its output folder is removed when the test passes and kept when it fails."""
    name = request.node.originalname
    run = request.config.stash.get(_RUNS, {}).get(name)
    if run is None and name in ON_DEMAND:
        run = _start(request.config, name, ON_DEMAND[name])
    if run is None:
        pytest.skip("its background run could not start here (see the module's prerequisites)")
    failed_before = request.session.testsfailed
    yield run
    if request.session.testsfailed == failed_before:
        shutil.rmtree(run.out, ignore_errors=True)
    else:
        print(f"background run's output kept in {run.out}")
