#!/usr/bin/env bash
# Re-resolve requirements/gpu.lock from requirements/gpu.in: every package of the GPU profile
# pinned with the sha256 of the wheel pip chose for CPython 3.11 on x86_64 Linux (the GPU
# servers' platform). Resolves on any machine of that platform, a GPU-less one included: pip
# only reads the index (a dry run installs nothing). `make setup PROFILE=gpu` installs exactly
# this file with --require-hashes.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
python=$(command -v python3.11)
# The index only: a local find-links folder of CPU wheels must not stand in for the CUDA ones.
PIP_FIND_LINKS= "$python" -m pip install --quiet --disable-pip-version-check --dry-run \
  --ignore-installed --report "$scratch/report.json" -r "$repo/requirements/gpu.in"
"$python" - "$scratch/report.json" "$repo/requirements/gpu.lock" <<'PY'
import json
import re
import sys

from pip._vendor.packaging.requirements import Requirement

report = json.load(open(sys.argv[1]))
env = report["environment"]


def canonical(name):
    return re.sub(r"[-_.]+", "-", name).lower()


items = {canonical(i["metadata"]["name"]): i for i in report["install"]}
# Extras a dependant asks for (nvidia-cutlass-dsl[cu13]) must be named in the lock too: hash
# mode refuses a requirement that is not pinned exactly as asked. To a fixed point, since an
# extra can pull in further extras.
extras = {name: set(i.get("requested_extras") or ()) for name, i in items.items()}
changed = True
while changed:
    changed = False
    for name, item in items.items():
        for text in item["metadata"].get("requires_dist") or ():
            req = Requirement(text)
            target = canonical(req.name)
            if target not in items or not req.extras:
                continue
            if req.marker is not None and not any(
                    req.marker.evaluate({**env, "extra": extra})
                    for extra in {""} | extras[name]):
                continue
            if not req.extras <= extras[target]:
                extras[target] |= req.extras
                changed = True
lines = [
    "# Exact GPU-profile environment: every package, pinned, with the sha256 of its wheel.",
    f"# Resolved by pip {report['pip_version']} for CPython {env['python_full_version']} on "
    f"{env['sys_platform']} {env['platform_machine']} from requirements/gpu.in.",
    "# Regenerate: make lock PROFILE=gpu. Install: make setup PROFILE=gpu (--require-hashes).",
]
for name in sorted(items):
    item = items[name]
    info = item["download_info"]
    sha256 = info["archive_info"]["hashes"]["sha256"]
    # With extras, the bare name too: pip's hash mode treats the two as separate requirements.
    named = [name] + ([f"{name}[{','.join(sorted(extras[name]))}]"] if extras[name] else [])
    for each in named:
        lines.append(f"{each}=={item['metadata']['version']} \\\n"
                     f"    --hash=sha256:{sha256}\n"
                     f"    # {info['url'].rsplit('/', 1)[1]}")
open(sys.argv[2], "w").write("\n".join(lines) + "\n")
print(f"wrote requirements/gpu.lock ({len(items)} packages)")
PY
