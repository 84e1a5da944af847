#!/usr/bin/env python3
"""Apply pdd-sglang's patch series to the installed sglang, check it, or revert it.

    python scripts/apply_patches.py            # apply (idempotent)
    python scripts/apply_patches.py --check    # verify only; exit 1 unless fully applied
    python scripts/apply_patches.py --revert   # restore the installed files
    python scripts/apply_patches.py --with-debug   # also patches/debug/ (the test suite's aids)

The production series is ``patches/series``; ``patches/debug/series`` lists optional debug
patches that come after it (``make setup`` applies them for the tests; a production server
needs none). Switching between the two is an ordinary upgrade of the series (below).

Each file that the series touches is in one of three states, decided from the hashes that pip
recorded when it installed the wheel (the dist-info RECORD):

* pristine: its hash equals RECORD's;
* patched, wholly or by the first k of its hunks (an older, shorter series): reverse-applying
  those hunks gives RECORD's hash back;
* ours, from an earlier version of the series (a patch since changed): the file is exactly what
  this tool last installed (its hash is in the manifest ``<site-packages>/.pdd-patches/manifest.json``)
  and the wheel's own copy was kept beside it (``.pdd-patches/pristine/``): the series is applied
  afresh to that copy, so pulling a changed series needs no reinstall;
* foreign: none of these (edited by hand, another version): we refuse and change nothing.

All work happens on copies in a temporary directory; the installed files are replaced (one atomic
rename each) only after every hunk of the series has applied cleanly, so no run leaves the tree
half-patched. GNU patch does the patching, with fuzz 0.
"""

from __future__ import annotations

import argparse
import base64
import compileall
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PATCH_DIR = REPO / "patches"


class PatchError(RuntimeError):
    pass


@dataclass(frozen=True)
class FileHunks:
    patch_name: str
    path: str  # relative to site-packages, e.g. sglang/srt/server_args.py
    text: str  # one file's section of a unified diff


def read_upstream(patch_dir: Path = PATCH_DIR) -> dict:
    fields = {}
    for line in (patch_dir / "UPSTREAM").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            fields[key.strip()] = value.strip()
    return fields


DEBUG_DIR = "debug"  # optional debug patches, after the production series (--with-debug)


def read_series(patch_dir: Path = PATCH_DIR, with_debug: bool = False) -> list[str]:
    """The production series (patches/series), then with_debug the debug one (patches/debug/series),
    its names prefixed ``debug/``: one chain of hunks either way."""
    names = _series_file(patch_dir, "")
    if with_debug:
        names += _series_file(patch_dir, DEBUG_DIR)
    return names


def _series_file(patch_dir: Path, subdir: str) -> list[str]:
    folder = patch_dir / subdir if subdir else patch_dir
    names = [
        f"{subdir}/{line.strip()}" if subdir else line.strip()
        for line in (folder / "series").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for name in names:
        if not (patch_dir / name).is_file():
            raise PatchError(f"patches/{subdir + '/' if subdir else ''}series names {name}, "
                             "which is not in patches/")
    return names


def split_patch(name: str, text: str) -> list[FileHunks]:
    """One patch file into per-file sections (the DEP-3 header before the first diff is skipped)."""
    sections = re.split(r"(?m)^(?=--- a/)", text)
    hunks = []
    for section in sections[1:]:
        match = re.search(r"(?m)^\+\+\+ b/(\S+)", section)
        if not match:
            raise PatchError(f"{name}: a '--- a/' line without its '+++ b/' line")
        hunks.append(FileHunks(name, match.group(1), section))
    if not hunks:
        raise PatchError(f"{name} contains no unified diff")
    return hunks


def dep3_header(text: str) -> dict:
    header = text.split("\n---\n", 1)[0]
    return dict(
        (key.strip(), value.strip())
        for key, _, value in (line.partition(":") for line in header.splitlines())
        if value
    )


def record_hashes(dist: importlib.metadata.Distribution) -> dict[str, str]:
    """sha256 (hex) of each installed file, as pip recorded it from the wheel."""
    hashes = {}
    for entry in dist.files or []:
        if entry.hash is not None and entry.hash.mode == "sha256":
            raw = base64.urlsafe_b64decode(entry.hash.value + "=" * (-len(entry.hash.value) % 4))
            hashes[str(entry).replace(os.sep, "/")] = raw.hex()
    return hashes


def sha256_hex(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run_patch(workdir: Path, hunks: FileHunks, reverse: bool) -> None:
    cmd = ["patch", "-p1", "--batch", "--fuzz=0", "--no-backup-if-mismatch", "--quiet"]
    if reverse:
        cmd.append("--reverse")
    try:
        proc = subprocess.run(cmd, cwd=workdir, input=hunks.text, text=True, capture_output=True)
    except FileNotFoundError:
        raise PatchError("GNU patch is not installed (Debian package 'patch'); run make setup")
    if proc.returncode != 0:
        action = "reverse" if reverse else "apply"
        raise PatchError(
            f"{hunks.patch_name}: could not {action} its hunks for {hunks.path}:\n"
            f"{(proc.stdout + proc.stderr).strip()}"
        )


class Installation:
    def __init__(self, patch_dir: Path = PATCH_DIR, site_packages: Path | None = None,
                 with_debug: bool = False):
        self.upstream = read_upstream(patch_dir)
        self.package = self.upstream["package"]
        if site_packages is None:
            spec = importlib.util.find_spec(self.package)
            if spec is None or not spec.submodule_search_locations:
                raise PatchError(f"{self.package} is not installed in {sys.executable}")
            site_packages = Path(list(spec.submodule_search_locations)[0]).parent
        self.site_packages = Path(site_packages)
        dists = list(importlib.metadata.distributions(name=self.package, path=[str(site_packages)]))
        if not dists:
            raise PatchError(f"no {self.package} distribution metadata in {site_packages}")
        installed = dists[0].version
        if installed != self.upstream["version"]:
            raise PatchError(
                f"patches/ is for {self.package} {self.upstream['version']}, but "
                f"{self.package} {installed} is installed at {self.site_packages}. Nothing was "
                "changed. To port the series to another release, see CONTRIBUTING.md."
            )
        self.series = read_series(patch_dir, with_debug)
        self.hunks = [h for name in self.series for h in split_patch(name, (patch_dir / name).read_text())]
        self.recorded = record_hashes(dists[0])
        self.paths = list(dict.fromkeys(h.path for h in self.hunks))
        for path in self.paths:
            if path not in self.recorded:
                raise PatchError(f"{path} is not a file of {self.package} {installed}")

    # ---- what this tool installed before (upgrades of the series) -----------------------
    @property
    def keep_dir(self) -> Path:
        return self.site_packages / ".pdd-patches"

    def manifest(self) -> dict:
        try:
            return json.loads((self.keep_dir / "manifest.json").read_text())
        except (FileNotFoundError, ValueError):
            return {}

    def pristine_copy(self, path: str) -> Path:
        return self.keep_dir / "pristine" / path

    def ours_from_earlier_series(self, path: str) -> bool:
        kept = self.pristine_copy(path)
        return (self.manifest().get(path) == sha256_hex(self.site_packages / path)
                and kept.exists() and sha256_hex(kept) == self.recorded[path])

    def source(self, path: str, states: dict) -> Path:
        """The file a transform starts from: the wheel's kept copy for an earlier series."""
        return self.pristine_copy(path) if states[path] == "earlier" else self.site_packages / path

    def hunks_for(self, path: str) -> list[FileHunks]:
        return [h for h in self.hunks if h.path == path]

    def states(self, workdir: Path) -> dict[str, int | str]:
        """For every touched file: how many of its hunks (in series order) are applied, or
        ``"foreign"``. A file with only the first k of its hunks applied comes from an older,
        shorter series; applying finishes the chain."""
        states: dict[str, int | str] = {}
        for path in self.paths:
            chain = self.hunks_for(path)
            states[path] = "foreign"
            for applied in range(len(chain), -1, -1):
                probe = workdir / f"probe{applied}"
                copy = probe / path
                copy.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(self.site_packages / path, copy)
                try:
                    for hunks in reversed(chain[:applied]):
                        run_patch(probe, hunks, reverse=True)
                except PatchError:
                    continue
                if sha256_hex(copy) == self.recorded[path]:
                    states[path] = applied
                    break
            if states[path] == "foreign" and self.ours_from_earlier_series(path):
                states[path] = "earlier"
        return states

    def transform(self, workdir: Path, states: dict, reverse: bool) -> dict[str, Path]:
        """Fully patched (or reverted) copies of the files that need it, built wholly before
        anything is installed."""
        out = {}
        for path, applied in states.items():
            chain = self.hunks_for(path)
            if applied == "earlier":  # start again from the wheel's own copy
                todo = [] if reverse else chain
            else:
                todo = list(reversed(chain[:applied])) if reverse else chain[applied:]
            if not todo and applied != "earlier":
                continue
            copy = workdir / "build" / path
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(self.source(path, states), copy)
            for hunks in todo:
                run_patch(workdir / "build", hunks, reverse=reverse)
            if reverse and sha256_hex(copy) != self.recorded[path]:
                raise PatchError(f"reverting {path} did not restore the wheel's file")
            out[path] = copy
        return out

    def refresh_bytecode(self, paths) -> None:
        """Compile the given files' ``.pyc`` where it no longer matches the source, as pip did at
        install time: otherwise, under ``PYTHONDONTWRITEBYTECODE`` (set on CI machines), every
        SGLang process compiles the patched modules again (about 0.2 CPU-s each)."""
        for path in paths:
            compileall.compile_file(str(self.site_packages / path), quiet=2)

    def install(self, built: dict[str, Path]) -> None:
        manifest = self.manifest()
        for path, copy in built.items():
            target = self.site_packages / path
            kept = self.pristine_copy(path)
            if not kept.exists() and sha256_hex(target) == self.recorded[path]:
                kept.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(target, kept)  # the wheel's file, for a later series
            staged = target.with_name(target.name + ".pdd-new")
            shutil.copyfile(copy, staged)
            shutil.copymode(target, staged)
            os.replace(staged, target)
            manifest[path] = sha256_hex(target)
        if built:
            self.keep_dir.mkdir(parents=True, exist_ok=True)
            (self.keep_dir / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))


def refuse_foreign(states: dict[str, str]) -> None:
    foreign = [p for p, s in states.items() if s == "foreign"]
    if foreign:
        raise PatchError(
            "these installed files match neither the wheel nor the patched result, so they were "
            "modified by something else; nothing was changed: " + ", ".join(foreign)
            + ". Reinstall sglang (make setup) and apply again."
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="verify only; exit 1 unless applied")
    mode.add_argument("--revert", action="store_true", help="restore the installed files")
    parser.add_argument("--patch-dir", type=Path, default=PATCH_DIR, help=argparse.SUPPRESS)
    parser.add_argument(
        "--site-packages", type=Path, default=None,
        help="patch the sglang under this directory instead of the importable one",
    )
    parser.add_argument(
        "--with-debug", action="store_true",
        help="also the optional debug patches (patches/debug/), which the test suite needs; "
             "production servers leave them out. Use the same choice for --check and --revert",
    )
    args = parser.parse_args(argv)
    try:
        inst = Installation(args.patch_dir, args.site_packages, args.with_debug)
        with tempfile.TemporaryDirectory(prefix="pdd-patches-") as tmp:
            workdir = Path(tmp)
            states = inst.states(workdir)
            refuse_foreign(states)
            if args.check:
                return report_check(inst, states)
            if args.revert:
                built = inst.transform(workdir, states, reverse=True)
                inst.install(built)
                inst.refresh_bytecode(states)
                print(f"reverted {len(built)} file(s); {inst.package} is as the wheel installed it")
                return 0
            built = inst.transform(workdir, states, reverse=False)
            inst.install(built)
            inst.refresh_bytecode(states)
            print(
                f"applied {len(inst.series)} patch(es) to {inst.package} "
                f"{inst.upstream['version']} at {inst.site_packages} "
                f"({len(built)} file(s) changed, {len(states) - len(built)} already patched)"
            )
            return 0
    except PatchError as err:
        print(f"apply_patches: {err}", file=sys.stderr)
        return 2


def fully_applied(inst: Installation, states: dict, path: str) -> bool:
    return states[path] == len(inst.hunks_for(path))  # "earlier" is not


def report_check(inst: Installation, states: dict) -> int:
    for name in inst.series:
        applied = all(
            not isinstance(states[h.path], str)
            and inst.hunks_for(h.path).index(h) < states[h.path]
            for h in inst.hunks if h.patch_name == name
        )
        print(f"{name}: {'applied' if applied else 'NOT applied'}")
    if all(fully_applied(inst, states, p) for p in states):
        print(f"all {len(inst.series)} patches applied to {inst.package} {inst.upstream['version']}")
        return 0
    print("the series is not applied; run scripts/apply_patches.py", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
