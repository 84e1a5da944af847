"""scripts/gpu/scatter_gpu.py times main's landing of packed WAN records on a GPU with its own copy
of the scatter (the GPU image has torch, not this package's dependencies): it must be
``PoolPages.scatter``'s, and it must run (on CPU, at tiny size)."""

import json
import runpy
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from pdd_sglang.kv_codec.pool import PoolPages

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu" / "scatter_gpu.py"


def _script():
    return SimpleNamespace(**runpy.run_path(str(SCRIPT)))


def test_the_scatter_is_the_pools():
    buffers = [torch.zeros(6, 32, dtype=torch.uint8) for _ in range(4)]
    theirs = [b.clone() for b in buffers]
    pool = PoolPages([b.data_ptr() for b in buffers], [b.numel() for b in buffers], [32] * 4,
                     torch.uint8, 1)
    record = torch.randint(0, 256, (4, 3, 32), dtype=torch.uint8)
    pages = np.array([4, 0, 2])
    pool.scatter(pages, record)
    _script().scatter_like_pool(theirs, torch.as_tensor(pages), record)
    assert all(torch.equal(a, b) for a, b in zip(buffers, theirs))
    assert torch.equal(buffers[1][[4, 0, 2]], record[1])


def test_runs_on_cpu_when_allowed(tmp_path):
    out = tmp_path / "scatter_gpu.json"
    assert _script().main(["--allow-cpu", "--repeats", "2", "--out", str(out)]) == 0
    row = json.loads(out.read_text())["sizes"][0]
    assert row["scatter_gb_s_pageable"] > 0 and row["pages"] >= 1
    assert row["step_ms_alone"] > 0 and row["step_ms_beside_scatter"] > 0
