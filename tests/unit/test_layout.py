"""The tree shows the architecture: serving code never reaches into the development tools, arrows
run one way (a role imports no sibling role, the layers below the roles import none), every folder
is a regular package that the packaging ships, and no module grows past what a reader can hold."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "pdd_sglang"
SERVING = [p for p in PACKAGE.rglob("*.py") if "dev" not in p.relative_to(PACKAGE).parts
           and "sim" not in p.relative_to(PACKAGE).parts]
# Cohesion over a line count (issue 38): a class with its own state stays in one module; these
# only catch a module or function that has grown past reading.
MAX_MODULE_LINES = 800
MAX_FUNCTION_LINES = 80
ROLES = ("prefill", "decode", "router")
# What the roles stand on: each imports no role. (hooks.py and server_args.py, above the roles,
# wire them into SGLang.)
BELOW_THE_ROLES = ("diagnostics", "protocol", "policy", "kv_codec", "lifecycle.py",
                   "stall.py")
# A sys.path entry of the CPU venv (its .pth file), holding a top-level ``sgl_kernel``: not a
# package of pdd_sglang.
PATH_ROOTS = {PACKAGE / "dev" / "cpu_standin"}


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


def test_no_module_over_about_800_lines():
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, long


def test_no_serving_function_over_about_80_lines():
    """Serving code only (dev tools and the simulator are scripts' kin): a function past this
    is several steps that want names."""
    long = {}
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE)
        if relative.parts[0] in ("dev", "sim"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long[f"{relative}:{node.name}"] = lines
    assert not long, long


def _modules_of(place: str) -> list[Path]:
    path = PACKAGE / place
    return [path] if path.suffix == ".py" else sorted(path.rglob("*.py"))


def _imports_of_roles(paths: list[Path], roles) -> dict[str, list[str]]:
    found = {}
    for path in paths:
        hits = sorted(m for m in imported_modules(path)
                      if any(m == f"pdd_sglang.{r}" or m.startswith(f"pdd_sglang.{r}.")
                             for r in roles))
        if hits:
            found[str(path.relative_to(PACKAGE))] = hits
    return found


@pytest.mark.parametrize("role", ROLES)
def test_no_role_imports_a_sibling_role(role):
    """A helper two roles share goes below them (protocol/, diagnostics/, policy/), never into
    one role for the other to import."""
    assert _modules_of(role)
    siblings = [r for r in ROLES if r != role]
    assert not _imports_of_roles(_modules_of(role), siblings)


@pytest.mark.parametrize("place", BELOW_THE_ROLES)
def test_what_the_roles_stand_on_imports_no_role(place):
    """Roles hand their diagnostics to ``diagnostics`` (``server_info.register_state``); nothing
    below the roles reaches back up into one, not even inside a function."""
    assert _modules_of(place)
    assert not _imports_of_roles(_modules_of(place), ROLES)


def _source_folders() -> list[Path]:
    return sorted({p.parent for p in PACKAGE.rglob("*.py")
                   if not any(root == p.parent or root in p.parents for root in PATH_ROOTS)})


def test_every_folder_is_a_regular_package():
    """One convention: a folder of modules has its ``__init__.py`` (setuptools' package finder,
    which pyproject.toml uses, skips a folder without one, and everything below it)."""
    missing = [str(d.relative_to(PACKAGE.parent)) for d in _source_folders()
               if not (d / "__init__.py").is_file()]
    assert not missing


def test_the_packaging_ships_every_package_and_nothing_else():
    """pyproject.toml's discovery, as setuptools runs it: regular packages only (a folder that
    lost its ``__init__.py`` would silently leave the wheel, with every folder below it)."""
    from setuptools import find_namespace_packages, find_packages

    find = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"]["find"]
    finder = find_namespace_packages if find.get("namespaces", True) else find_packages
    shipped = set(finder(where=str(PACKAGE.parent), include=find["include"]))
    expected = {".".join(d.relative_to(PACKAGE.parent).parts) for d in _source_folders()}
    assert shipped == expected
    assert "pdd_sglang.prefill" in shipped and "pdd_sglang.dev.testing" in shipped


def _functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def test_the_routers_request_path_reads_in_one_screen():
    """#38: one attempt of a request is a short sequence of named steps (``Dispatcher.run``),
    and each way a server fails it is a function that says what the client sees, in the
    attempt's module or the relay-loss module, where the attempt's docstring names it."""
    router = PACKAGE / "router"
    (run,) = [f for f in _functions(router / "dispatch.py") if f.name == "run"]
    assert run.end_lineno - run.lineno + 1 <= 50
    long = {f"{p.name}:{f.name}": f.end_lineno - f.lineno + 1
            for p in sorted(router.glob("*.py")) for f in _functions(p)
            if f.end_lineno - f.lineno + 1 > 80}
    assert not long
    fault_paths = {f"{p.name}:{f.name}" for p in sorted(router.glob("*.py"))
                   for f in _functions(p) if "client sees" in (ast.get_docstring(f) or "")}
    assert fault_paths and {where.split(":")[0] for where in fault_paths} <= {
        "attempt.py", "relay_loss.py", "landing.py"}
    listed = ast.get_docstring(ast.parse((router / "attempt.py").read_text()))
    assert all(where.split(":")[1] in listed for where in fault_paths
               if where.split(":")[0] != "landing.py"), (fault_paths, listed)
