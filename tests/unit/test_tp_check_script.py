"""scripts/gpu/tp_check.py: its launch plan (what the README's TP 2 lines come from) and its skip."""

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu" / "tp_check.py"


def dry_run(*flags: str) -> str:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--model-path", "m", "--dry-run", *flags],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_tp_2_puts_each_role_on_its_own_gpus_and_the_router_over_them():
    out = dry_run("--tp", "2")
    lines = dict(zip(out.splitlines()[0::2], out.splitlines()[1::2]))
    assert "--tp-size 2 --base-gpu-id 0" in lines["# plain"] and "--pdd-role" not in lines["# plain"]
    assert "--tp-size 2 --base-gpu-id 0 --pdd-role prefill" in lines["# prefill"]
    assert "--tp-size 2 --base-gpu-id 2 --pdd-role relay" in lines["# relay"]
    assert "--tp-size 2 --base-gpu-id 4 --pdd-role main" in lines["# main"]
    assert "-m pdd_sglang.router" in lines["# router"]
    assert "# GPUs needed: 6" in out


def test_heterogeneous_sizes_are_per_role():
    out = dry_run("--tp", "2", "--prefill-tp", "1", "--relay-tp", "1")
    assert "--tp-size 1 --base-gpu-id 0 --pdd-role prefill" in out
    assert "--tp-size 1 --base-gpu-id 1 --pdd-role relay" in out
    assert "--tp-size 2 --base-gpu-id 2 --pdd-role main" in out
    assert "# GPUs needed: 4" in out


def test_skips_cleanly_without_cuda():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the script would start servers")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--model-path", "m"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA device: skipping" in proc.stdout
