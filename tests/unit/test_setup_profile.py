"""make setup PROFILE=gpu installs the production series only; the cpu profile adds the debug
patches for the test suite (issue 26, item 5). Runs scripts/setup_env.sh on a copy of the tree
with a prepared fake venv whose python records how apply_patches.py was called."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _run_setup(tmp_path: Path, profile: str,
               env_extra: dict | None = None) -> tuple[int, str, list]:
    tree = tmp_path / "tree"
    (tree / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "setup_env.sh", tree / "scripts")
    shutil.copytree(REPO / "requirements", tree / "requirements")
    cache = tmp_path / "cache"
    env = {**os.environ, "PDD_CACHE_DIR": str(cache), **(env_extra or {})}
    env.pop("CI", None)
    venv = Path(subprocess.run([str(tree / "scripts" / "setup_env.sh"), "--venv-path", profile],
                               env=env, capture_output=True, text=True, check=True).stdout.strip())
    site = tmp_path / "site"
    site.mkdir()
    calls = tmp_path / "calls"
    (venv / "bin").mkdir(parents=True)
    (venv / ".pdd-ready").touch()
    fake = venv / "bin" / "python"
    fake.write_text(f"#!/bin/sh\nif [ \"$1\" = -c ]; then echo {site}; exit 0; fi\n"
                    f"echo \"$*\" >> {calls}\n")
    fake.chmod(0o755)
    proc = subprocess.run([str(tree / "scripts" / "setup_env.sh"), profile], env=env,
                          capture_output=True, text=True)
    lines = calls.read_text().splitlines() if calls.exists() else []
    return proc.returncode, proc.stderr, lines


def _needs_host_tools():
    if any(shutil.which(tool) is None for tool in ("python3.11", "patch", "ip")):
        pytest.skip("setup_env.sh needs python3.11, patch and ip on this host")


def test_gpu_profile_applies_no_debug_patch(tmp_path):
    _needs_host_tools()
    rc, err, calls = _run_setup(tmp_path, "gpu")
    assert rc == 0, err
    assert len(calls) == 1 and calls[0].endswith("apply_patches.py"), calls


def test_cpu_profile_applies_the_debug_series_for_the_tests(tmp_path):
    _needs_host_tools()
    rc, err, calls = _run_setup(tmp_path, "cpu")
    assert rc == 0, err
    assert len(calls) == 1 and calls[0].endswith("apply_patches.py --with-debug"), calls


def test_debug_patches_are_opt_in_on_gpu_and_checked(tmp_path):
    _needs_host_tools()
    rc, err, calls = _run_setup(tmp_path, "gpu", {"PDD_DEBUG_PATCHES": "1"})
    assert rc == 0 and calls[0].endswith("--with-debug"), (err, calls)
    rc, err, _ = _run_setup(tmp_path / "again", "gpu", {"PDD_DEBUG_PATCHES": "yes"})
    assert rc == 2 and "PDD_DEBUG_PATCHES must be 0 or 1" in err
