"""requirements/gpu.lock, checked on a machine without a GPU: complete, hashed, the upstream
release of patches/UPSTREAM, the CUDA Mooncake wheel, and (against the index) it resolves."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LOCK = REPO / "requirements" / "gpu.lock"
ENTRY = re.compile(r"^(?P<name>[a-z0-9-]+)(?:\[(?P<extras>[a-z0-9,_-]+)\])?==(?P<version>\S+) \\\n"
                   r"    --hash=sha256:(?P<sha256>[0-9a-f]{64})\n"
                   r"    # (?P<wheel>\S+\.whl)$", re.M)


def entries() -> dict:
    text = LOCK.read_text()
    matched = list(ENTRY.finditer(text))
    requirement_lines = [line for line in text.splitlines()
                         if line and not line.startswith((" ", "#"))]
    assert len(matched) == len(requirement_lines), "a lock line is not name==version + hash + wheel"
    found = {m["name"]: m for m in matched if not m["extras"]}
    for m in matched:  # a name with extras is pinned bare too, to the same wheel
        assert found[m["name"]]["sha256"] == m["sha256"], m["name"]
    return found


def upstream() -> dict:
    text = (REPO / "patches" / "UPSTREAM").read_text()
    pairs = (line.partition("=") for line in text.splitlines()
             if line and not line.startswith("#"))
    return {key.strip(): value.strip() for key, _, value in pairs}


def test_every_package_is_pinned_with_the_hash_of_a_linux_cpython311_wheel():
    found = entries()
    assert len(found) > 150  # the whole environment, not the top-level pins
    for name, entry in found.items():
        wheel = entry["wheel"]
        assert wheel.lower().replace("_", "-").startswith(f"{name}-{entry['version']}-".lower()
                                                          .replace("_", "-")), (name, wheel)
        assert wheel.endswith(("-none-any.whl", "x86_64.whl")), wheel
        assert "-cp3" not in wheel or "-cp311-" in wheel or "-abi3-" in wheel, wheel


def test_the_lock_is_the_upstream_release_the_patches_apply_to():
    sglang, pinned = entries()["sglang"], upstream()
    assert sglang["version"] == pinned["version"]
    assert sglang["sha256"] == pinned["sha256"]
    assert sglang["wheel"] == pinned["wheel"]


def test_the_lock_names_the_cuda_builds():
    found = entries()
    mooncake = found["mooncake-transfer-engine"]  # the CUDA wheel; the CPU profile's is -non-cuda
    assert "mooncake-transfer-engine-non-cuda" not in found
    assert re.fullmatch(r"mooncake_transfer_engine-[^-]+-cp311-cp311-manylinux_\S+_x86_64\.whl",
                        mooncake["wheel"]), mooncake["wheel"]
    assert "sglang-kernel" in found and "flashinfer-python" in found
    assert any(name.startswith("nvidia-cuda-runtime") for name in found)
    # The same torch as the CPU profile, so both profiles run the same SGLang code paths.
    cpu_torch = re.search(r"^torch==(\S+)$", (REPO / "requirements" / "cpu.lock").read_text(), re.M)
    assert found["torch"]["version"] == cpu_torch.group(1)


def test_every_top_level_requirement_is_in_the_lock():
    found = entries()
    for line in (REPO / "requirements" / "gpu.in").read_text().splitlines():
        line = line.split("#")[0].strip()
        if not line:
            continue
        name, _, version = line.partition("==")
        entry = found[re.sub(r"[-_.]+", "-", name).lower()]
        assert not version or entry["version"] == version, (line, entry["version"])


def test_the_lock_resolves_against_the_index_with_hashes_required(background):
    """pip resolves exactly the lock, hash mode (every dependency pinned, every hash given);
    a dry run, so nothing is installed. Needs the package index (skipped without it). The run
    waits on the index for a minute or two, so it starts with the session (tests/conftest.py)."""
    done = background.result(timeout_s=600)
    errors = "\n".join(line for line in done.stderr.splitlines()
                       if not line.startswith("WARNING: Location"))
    if done.returncode and re.search(r"NewConnectionError|Could not fetch"
                                     r"|Network is unreachable", errors):
        pytest.skip(f"no package index here: {errors[-300:]}")
    assert done.returncode == 0, errors[-3000:]
