#!/usr/bin/env bash
# Build (once) and activate for this checkout the Python environment of one install profile.
#
#   scripts/setup_env.sh [cpu|gpu]        build if needed, apply the patch series, link .venv
#   scripts/setup_env.sh --venv-path cpu  print where that profile's venv lives, change nothing
#
# The heavy venv lives outside the checkout, in $PDD_CACHE_DIR (default ~/.cache/pdd-sglang),
# keyed by a hash of the lock files, so a fresh clone on the same machine reuses it. What is
# per checkout is cheap and redone on every run: the .pth files that point the venv at this
# checkout, the patch series (idempotent), and the .venv link.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cache=${PDD_CACHE_DIR:-$HOME/.cache/pdd-sglang}

print_only=0
if [ "${1:-}" = "--venv-path" ]; then print_only=1; shift; fi
profile=${1:-cpu}
case "$profile" in
  cpu) lock_files=("$repo/requirements/cpu.lock" "$repo/requirements/sglang.txt") ;;
  gpu) lock_files=("$repo/requirements/gpu.lock") ;;
  *) echo "setup_env: unknown profile '$profile' (choose cpu or gpu)" >&2; exit 2 ;;
esac
key=$(cat "${lock_files[@]}" | sha256sum | cut -c1-12)
venv="$cache/venv-$profile-$key"
if [ "$print_only" = 1 ]; then echo "$venv"; exit 0; fi

# Debian packages: libibverbs1 (Mooncake's transfer engine links it even for TCP), patch (applies
# the series), iproute2 (network namespaces of the WAN emulator).
missing=()
ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1' || missing+=(libibverbs1)
command -v patch >/dev/null || missing+=(patch)
command -v ip >/dev/null || missing+=(iproute2)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "setup_env: missing Debian packages: ${missing[*]}. Install them as root:" >&2
    echo "  apt-get install -y ${missing[*]}" >&2
    exit 1
  fi
  echo "setup_env: installing Debian packages: ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

python=$(command -v python3.11 || true)
if [ -z "$python" ]; then
  python=$(command -v python3)
  "$python" -c 'import sys; assert sys.version_info[:2] == (3, 11)' 2>/dev/null || {
    echo "setup_env: sglang 0.5.23's wheel is built for CPython 3.11; no python3.11 found" >&2
    exit 1
  }
fi

if [ ! -f "$venv/.pdd-ready" ]; then
  echo "setup_env: building the $profile environment in $venv (first use only; a few minutes)"
  rm -rf "$venv"
  "$python" -m venv "$venv"
  pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
  if [ "$profile" = cpu ]; then
    # --no-deps everywhere: the lock is a complete, exact environment, and sglang's own
    # requirements include CUDA-only kernels that cannot import on a CPU machine.
    "${pip[@]}" --no-deps -r "$repo/requirements/cpu.lock"
    "${pip[@]}" --no-deps --require-hashes -r "$repo/requirements/sglang.txt"
  else
    # Exactly the lock (make lock PROFILE=gpu): every package pinned and checked by its hash.
    "${pip[@]}" --no-deps --require-hashes -r "$repo/requirements/gpu.lock"
  fi
  touch "$venv/.pdd-ready"
fi

site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# The .pth files make `.venv/bin/python -m sglang.launch_server` find pdd_sglang by hand. The
# Makefile also puts this checkout on PYTHONPATH, so CI (another clone sharing this venv) leaves
# them pointing at the developer's checkout.
if [ -z "${CI:-}" ] || [ ! -f "$site/pdd_sglang_checkout.pth" ]; then
  echo "$repo" > "$site/pdd_sglang_checkout.pth"
  if [ "$profile" = cpu ]; then
    echo "$repo/pdd_sglang/dev/cpu_standin" > "$site/pdd_sglang_cpu_standin.pth"
  else
    rm -f "$site/pdd_sglang_cpu_standin.pth"
  fi
fi
# The production series only on the gpu profile (what a serving host runs); the cpu profile,
# which runs the test suite, adds its debug aids (patches/debug/). PDD_DEBUG_PATCHES=1 adds them
# to a gpu venv for tests, PDD_DEBUG_PATCHES=0 leaves them out of a cpu one.
debug=${PDD_DEBUG_PATCHES:-$([ "$profile" = cpu ] && echo 1 || echo 0)}
case "$debug" in
  1) "$venv/bin/python" "$repo/scripts/apply_patches.py" --with-debug ;;
  0) "$venv/bin/python" "$repo/scripts/apply_patches.py" ;;
  *) echo "setup_env: PDD_DEBUG_PATCHES must be 0 or 1, got '$debug'" >&2; exit 2 ;;
esac
ln -sfn "$venv" "$repo/.venv"
