"""Session-wide: the integration marker, and runs that start in the background.

Two checks spend most of their time waiting, not computing: the quick demo waits on its servers'
CPU quotas (one conversation at a time at its latency point), and the GPU lock's resolution waits
on the package index. Each starts as soon as the session has collected its test, so the
pure-logic tests run beside them (``tests/integration/conftest.py`` orders them first); the test
then takes the run's result through the ``background`` fixture. A session that ends early stops
what is still running (Ctrl-C to the demo, which stops its servers, line and cgroups itself).
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


def _quick_demo(out: Path) -> BackgroundRun | None:
    from pdd_sglang.dev.wan_emulator import check_prerequisites

    try:
        check_prerequisites()
    except (PermissionError, FileNotFoundError):
        return None  # test_demo.py skips, saying why
    return BackgroundRun([sys.executable, str(REPO / "scripts" / "demo.py"), "--quick",
                          "--out", str(out)], out)


def _gpu_lock_resolution(out: Path) -> BackgroundRun:
    # A pip dry run in hash mode against the index's wheels (not a local CPU wheel folder).
    return BackgroundRun([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed",
                          "--quiet", "--disable-pip-version-check", "--require-hashes", "-r",
                          str(REPO / "requirements" / "gpu.lock")], out,
                         env={**os.environ, "PIP_FIND_LINKS": ""})


# test name -> how to start its run
BACKGROUND = {
    "test_quick_demo_runs_both_points_and_pdd_hands_off": _quick_demo,
    "test_the_lock_resolves_against_the_index_with_hashes_required": _gpu_lock_resolution,
}


def pytest_collection_finish(session):
    runs = session.config.stash.setdefault(_RUNS, {})
    if session.config.option.collectonly:
        return
    for name in sorted({item.originalname for item in session.items} & set(BACKGROUND)):
        run = BACKGROUND[name](Path(tempfile.mkdtemp(prefix=f"pdd-{name[5:30]}-")))
        if run is not None:
            runs[name] = run


def pytest_sessionfinish(session):
    for run in session.config.stash.get(_RUNS, {}).values():
        run.stop()


@pytest.fixture
def background(request):
    """This test's background run (started at collection; ``result()`` waits for it). Its
    output folder is removed when the test passes and kept when it fails."""
    run = request.config.stash.get(_RUNS, {}).get(request.node.originalname)
    if run is None:
        pytest.skip("its background run could not start here (see the module's prerequisites)")
    failed_before = request.session.testsfailed
    yield run
    if request.session.testsfailed == failed_before:
        shutil.rmtree(run.out, ignore_errors=True)
    else:
        print(f"background run's output kept in {run.out}")
