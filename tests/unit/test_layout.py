"""The tree shows the architecture: serving code never reaches into the development tools, and no
module grows past what a reader can hold."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "pdd_sglang"
SERVING = [p for p in PACKAGE.rglob("*.py") if "dev" not in p.relative_to(PACKAGE).parts
           and "sim" not in p.relative_to(PACKAGE).parts]
MAX_MODULE_LINES = 420


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_serving_code_never_imports_dev_tools():
    assert len(SERVING) > 20, SERVING  # the scan sees the package
    offenders = {str(p.relative_to(PACKAGE)): sorted(m for m in imported_modules(p)
                                                     if m.startswith("pdd_sglang.dev"))
                 for p in SERVING}
    assert not {k: v for k, v in offenders.items() if v}


def test_importing_the_serving_package_loads_no_dev_module():
    code = ("import sys, pdd_sglang.hooks, pdd_sglang.policy, pdd_sglang.protocol.route, "
            "pdd_sglang.protocol.control_channel, pdd_sglang.router.app; "
            "print(sorted(m for m in sys.modules if m.startswith('pdd_sglang.dev')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_no_module_over_about_400_lines():
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, long
