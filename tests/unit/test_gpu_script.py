import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu" / "recompute_vs_decode.py"


def test_skips_cleanly_without_cuda():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the script measures instead of skipping")
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA device: skipping" in proc.stdout
