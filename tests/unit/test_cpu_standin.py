"""The sgl_kernel stand-in: imports anything, fails loudly on any call, only on the CPU engine."""

import os
import subprocess
import sys
from pathlib import Path


STANDIN = Path(__file__).resolve().parents[2] / "pdd_sglang" / "dev" / "cpu_standin"


def run(code: str, cpu_engine: bool) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(STANDIN)}
    env["SGLANG_USE_CPU_ENGINE"] = "1" if cpu_engine else "0"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)


def test_imports_resolve_and_calls_fail_naming_the_kernel():
    code = (
        "import sgl_kernel\n"
        "from sgl_kernel.flash_attn import flash_attn_varlen_func\n"
        "from sgl_kernel import rmsnorm\n"
        "assert sgl_kernel.PDD_CPU_STANDIN\n"
        "try:\n"
        "    flash_attn_varlen_func(1, 2)\n"
        "except NotImplementedError as e:\n"
        "    print('ERR', e)\n"
    )
    proc = run(code, cpu_engine=True)
    assert proc.returncode == 0, proc.stderr
    assert "ERR sgl_kernel.flash_attn.flash_attn_varlen_func was called" in proc.stdout


def test_refuses_to_stand_in_outside_the_cpu_engine():
    proc = run("import sgl_kernel", cpu_engine=False)
    assert proc.returncode != 0
    assert "only for SGLANG_USE_CPU_ENGINE=1" in proc.stderr


def test_dunder_lookups_stay_missing():
    proc = run("import sgl_kernel; print(hasattr(sgl_kernel.ops, '__wrapped__'))", cpu_engine=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"
