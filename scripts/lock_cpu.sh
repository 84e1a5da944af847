#!/usr/bin/env bash
# Re-resolve requirements/cpu.lock from requirements/cpu.in in a scratch venv.
# torch comes first under an exact constraint, then sglang without its dependencies (its CUDA
# kernels cannot import on CPU), then the CPU-side dependencies that cpu.in names.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
python3.11 -m venv "$scratch/venv"
pip=("$scratch/venv/bin/python" -m pip install --quiet --disable-pip-version-check)
printf 'torch==2.14.1\ntorchvision==0.29.1\n' > "$scratch/constraints.txt"
"${pip[@]}" torch==2.14.1 torchvision==0.29.1
"${pip[@]}" --no-deps --require-hashes -r "$repo/requirements/sglang.txt"
"${pip[@]}" -c "$scratch/constraints.txt" -r "$repo/requirements/cpu.in"
{
  echo "# Exact CPU-profile environment (pip freeze of a working venv, sglang excluded: see sglang.txt)."
  echo "# Regenerate: make lock (after editing requirements/cpu.in)."
  # --all keeps pip itself (cpu.in pins it); setuptools stays the venv's own.
  "$scratch/venv/bin/python" -m pip freeze --all --exclude sglang --exclude setuptools
} > "$repo/requirements/cpu.lock"
echo "wrote requirements/cpu.lock"
