#!/usr/bin/env bash
# Set up volconv on a fresh Debian/Ubuntu machine (as root, or with sudo):
#   an OpenCL driver (PoCL when no platform is usable), a virtual environment in .venv,
#   and volconv installed into it with the extras named in $1 (e.g. "test" or "demo").
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
apt_install() {
  [ -n "${apt_updated:-}" ] || { as_root apt-get update -qq; apt_updated=1; }
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

python="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  if ! "$python" -m venv .venv 2>/dev/null; then
    rm -rf .venv
    echo "setup: installing python3-venv"
    apt_install python3-venv python3-pip
    "$python" -m venv .venv
  fi
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
spec="."
[ -z "$extras" ] || spec=".[$extras]"
echo "setup: installing volconv${extras:+ with $extras} into .venv"
.venv/bin/python -m pip install -q -e "$spec"

# An OpenCL platform: register an installed but unregistered NVIDIA driver, else PoCL.
platforms() { .venv/bin/python -c "from volconv.device import list_devices; print(len(list_devices()))"; }
if [ "$(platforms)" = 0 ]; then
  vendors="${OCL_ICD_VENDORS:-/etc/OpenCL/vendors}"
  if ldconfig -p 2>/dev/null | grep -q libnvidia-opencl.so.1 && [ ! -e "$vendors/nvidia.icd" ]; then
    echo "setup: registering the NVIDIA OpenCL driver in $vendors/nvidia.icd"
    as_root mkdir -p "$vendors"
    echo libnvidia-opencl.so.1 | as_root tee "$vendors/nvidia.icd" >/dev/null
  fi
fi
if [ "$(platforms)" = 0 ]; then
  echo "setup: no OpenCL device; installing PoCL (pocl-opencl-icd)"
  apt_install pocl-opencl-icd
fi

# The SLURM test (tests/test_slurm.py) starts a real slurmctld, slurmd and munged on
# 127.0.0.1: installed with the test extras where missing, never required (it skips without).
if [[ ",$extras," == *",test,"* ]] && ! command -v slurmctld >/dev/null; then
  echo "setup: installing SLURM and munge for tests/test_slurm.py"
  apt_install slurmctld slurmd slurm-client munge || echo "setup: SLURM not installed; its test skips"
fi
.venv/bin/volconv devices
