"""scripts/apply_patches.py on a copy of the installed sglang: round trips, idempotence, refusals.

The copy holds the files the series touches and sglang's dist-info (whose RECORD gives the wheel's
hashes), so these tests never change the environment the other tests run in.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "apply_patches.py"
sys.path.insert(0, str(REPO / "scripts"))
import apply_patches  # noqa: E402


def touched_paths() -> list[str]:
    names = apply_patches.read_series(with_debug=True)
    return sorted({h.path for n in names for h in apply_patches.split_patch(n, (REPO / "patches" / n).read_text())})


@pytest.fixture()
def site_copy(tmp_path) -> Path:
    """A site-packages copy in the fully patched state (as the test environment is)."""
    dist = importlib.metadata.distribution("sglang")
    installed = Path(dist.locate_file(""))
    for rel in touched_paths():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(installed / rel, tmp_path / rel)
    info = next(p for p in installed.glob("sglang-*.dist-info"))
    shutil.copytree(info, tmp_path / info.name)
    return tmp_path


def run(site: Path, *args: str, debug: bool = True) -> subprocess.CompletedProcess:
    """apply_patches.py on ``site``; with the debug patches, as the test environment has them."""
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--site-packages", str(site), *args,
         *(["--with-debug"] if debug else [])],
        capture_output=True, text=True,
    )


def digest(site: Path) -> dict[str, str]:
    return {rel: hashlib.sha256((site / rel).read_bytes()).hexdigest() for rel in touched_paths()}


def recorded(site: Path) -> dict[str, str]:
    dist = next(importlib.metadata.distributions(name="sglang", path=[str(site)]))
    table = apply_patches.record_hashes(dist)
    return {rel: table[rel] for rel in touched_paths()}


def test_check_passes_on_the_environment_under_test():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--check", "--with-debug"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_revert_then_apply_round_trips(site_copy):
    patched = digest(site_copy)
    assert run(site_copy, "--check").returncode == 0
    assert run(site_copy, "--revert").returncode == 0
    assert digest(site_copy) == recorded(site_copy)  # byte-identical to the wheel
    assert run(site_copy, "--check").returncode == 1
    assert run(site_copy, "--revert").returncode == 0  # reverting twice is harmless
    assert run(site_copy).returncode == 0
    assert digest(site_copy) == patched
    again = run(site_copy)
    assert again.returncode == 0 and "0 file(s) changed" in again.stdout
    assert digest(site_copy) == patched


def test_wrong_version_is_refused_and_nothing_changes(site_copy):
    run(site_copy, "--revert")
    before = digest(site_copy)
    metadata = next(site_copy.glob("sglang-*.dist-info")) / "METADATA"
    metadata.write_text(metadata.read_text().replace("Version: 0.5.23", "Version: 0.5.24", 1))
    proc = run(site_copy)
    assert proc.returncode == 2
    assert "patches/ is for sglang 0.5.23, but sglang 0.5.24 is installed" in proc.stderr
    assert digest(site_copy) == before


def test_foreign_edit_is_refused_and_nothing_changes(site_copy):
    run(site_copy, "--revert")
    victim = site_copy / touched_paths()[-1]
    victim.write_text(victim.read_text() + "\n# edited by hand\n")
    before = digest(site_copy)
    proc = run(site_copy)
    assert proc.returncode == 2
    assert "modified by something else" in proc.stderr and touched_paths()[-1] in proc.stderr
    assert digest(site_copy) == before


def test_production_series_leaves_the_debug_patches_out_and_switching_is_an_upgrade(site_copy):
    debug_files = {h.path for n in apply_patches.read_series(with_debug=True) if n.startswith("debug/")
                   for h in apply_patches.split_patch(n, (REPO / "patches" / n).read_text())}
    with_debug = digest(site_copy)
    assert run(site_copy, "--revert").returncode == 0 and run(site_copy).returncode == 0
    assert run(site_copy, debug=False).returncode == 0  # the production series alone
    assert run(site_copy, "--check", debug=False).returncode == 0
    assert run(site_copy, "--check").returncode == 1
    production = digest(site_copy)
    assert {p for p in production if production[p] != with_debug[p]} == debug_files
    assert run(site_copy).returncode == 0 and digest(site_copy) == with_debug
    assert run(site_copy, "--revert").returncode == 0
    assert digest(site_copy) == recorded(site_copy)


def test_every_patch_has_a_dep3_header_and_stays_small():
    for name in apply_patches.read_series(with_debug=True):
        text = (REPO / "patches" / name).read_text()
        header = apply_patches.dep3_header(text)
        for key in ("Description", "Why", "Upstream-Status"):
            assert header.get(key), f"{name} lacks {key}"
        changed = sum(1 for line in text.splitlines() if line[:1] in "+-" and line[:3] not in ("+++", "---"))
        assert changed <= 100, f"{name} changes {changed} lines: a patch is a hook"


def test_series_lists_exactly_the_patch_files():
    assert set(apply_patches.read_series()) == {p.name for p in (REPO / "patches").glob("*.patch")}
    debug = set(apply_patches.read_series(with_debug=True)) - set(apply_patches.read_series())
    assert debug == {f"debug/{p.name}" for p in (REPO / "patches" / "debug").glob("*.patch")}


def test_a_changed_series_replaces_an_earlier_one_without_a_reinstall(site_copy, tmp_path):
    assert run(site_copy, "--revert").returncode == 0
    # An earlier version of the series: one added line of one patch worded differently.
    earlier = tmp_path / "earlier-patches"
    shutil.copytree(REPO / "patches", earlier)
    name = next(n for n in apply_patches.read_series() if "wan-path" in n)
    text = (earlier / name).read_text()
    wording = "# PDD: a main across the WAN is reached by the WAN path's own engine."
    assert wording in text
    (earlier / name).write_text(text.replace(wording[2:], "PDD: an earlier wording of this comment.", 1))
    assert run(site_copy, "--patch-dir", str(earlier)).returncode == 0
    older = digest(site_copy)
    # The current series finds its file patched by the earlier one: not applied, not foreign.
    assert run(site_copy, "--check").returncode == 1
    proc = run(site_copy)
    assert proc.returncode == 0, proc.stderr
    assert run(site_copy, "--check").returncode == 0
    assert digest(site_copy) != older
    assert run(site_copy, "--revert").returncode == 0
    assert digest(site_copy) == recorded(site_copy)
    # A hand edit is still refused, whatever the manifest says.
    assert run(site_copy).returncode == 0
    victim = site_copy / touched_paths()[-1]
    victim.write_text(victim.read_text() + "\n# edited by hand\n")
    refused = run(site_copy)
    assert refused.returncode == 2 and "modified by something else" in refused.stderr
