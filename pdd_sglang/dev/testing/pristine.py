"""The pristine sglang wheel beside the patched venv, for A/B checks of what the series changes.

A scratch copy: ``sglang/`` hard-linked into a temporary directory (no disk cost) and reverted
there by ``scripts/apply_patches.py --revert --site-packages`` (a revert replaces files by rename,
so the shared venv's files are never touched), then put first on a server's ``PYTHONPATH``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

CPU_FIX = "0002-mooncake-host-paths-on-cpu.patch"  # PD on SGLang's CPU engine needs it


@contextmanager
def pristine_sglang(with_cpu_fix: bool = False):
    """A directory holding the pristine sglang wheel's package, to put first on PYTHONPATH.

    ``with_cpu_fix``: plus patch 0002 alone, the standalone upstream bug fix without which plain
    PD does not run on SGLang's CPU engine at all (it has no pdd_sglang call)."""
    import importlib.metadata

    dist = importlib.metadata.distribution("sglang")
    site = Path(dist.locate_file(""))
    scratch = Path(tempfile.mkdtemp(prefix="pdd-pristine-sglang-"))
    try:
        subprocess.run(["cp", "-al", str(site / "sglang"), str(scratch / "sglang")], check=True)
        for info in site.glob("sglang-*.dist-info"):
            shutil.copytree(info, scratch / info.name)
        proc = subprocess.run([sys.executable, str(REPO / "scripts" / "apply_patches.py"),
                               "--revert", "--with-debug", "--site-packages", str(scratch)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"reverting the scratch copy failed: {proc.stderr}{proc.stdout}")
        if with_cpu_fix:
            only_fix = scratch / "cpu-fix-series"
            only_fix.mkdir()
            shutil.copyfile(REPO / "patches" / "UPSTREAM", only_fix / "UPSTREAM")
            shutil.copyfile(REPO / "patches" / CPU_FIX, only_fix / CPU_FIX)
            (only_fix / "series").write_text(CPU_FIX + "\n")
            proc = subprocess.run([sys.executable, str(REPO / "scripts" / "apply_patches.py"),
                                   "--patch-dir", str(only_fix), "--site-packages", str(scratch)],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"applying {CPU_FIX} to the scratch copy failed: {proc.stderr}")
        yield scratch
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def pristine_env(scratch: Path) -> dict:
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(scratch), os.environ.get("PYTHONPATH")]))}
