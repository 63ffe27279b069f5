#!/usr/bin/env bash
# The throughput figures of benchmarks/README.md on an NVIDIA GPU node (an H100): devices,
# the FMA probe, the full `volconv bench` sweep with peers; JSON, PNGs and logs into $OUT.
#
# Run from the repository root with volconv importable (PYTHONPATH) and $OUT a folder:
#   OUT=/tmp/out bash scripts/bench/gpu/throughput.sh
# Takes about 3-5 minutes on an H100; the bench is cut at BENCH_TIMEOUT seconds (default 300),
# keeping every point measured until then (the JSON is rewritten after each point).
# DEVICE (default nvidia), NAME (file prefix, default h100) and BENCH_ARGS (extra bench
# options) adapt it to another machine.
set -euo pipefail
: "${OUT:?set OUT to the folder for the results}"
mkdir -p "$OUT"
py="${PYTHON:-python3}"
device="${DEVICE:-nvidia}"
name="${NAME:-h100}"

# Containers often ship the NVIDIA OpenCL driver without registering it (scripts/gpu_env.sh does the same).
if command -v nvidia-smi > /dev/null && [ ! -e /etc/OpenCL/vendors/nvidia.icd ]; then
  mkdir -p /etc/OpenCL/vendors
  echo libnvidia-opencl.so.1 > /etc/OpenCL/vendors/nvidia.icd
fi
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv \
  > "$OUT/nvidia-smi.txt" 2>&1 || true

echo "== volconv devices"
"$py" -m volconv devices | tee "$OUT/devices.txt"

echo "== FMA probe"
"$py" -m volconv bench --device "$device" --peak-only --refresh-peak --json "$OUT/peak.json"

echo "== volconv bench (sweeps and peers)"
rc=0
# shellcheck disable=SC2086  # BENCH_ARGS: extra options, split on purpose (e.g. --size 64)
timeout "${BENCH_TIMEOUT:-300}" "$py" -m volconv bench --device "$device" --peers \
  --json "$OUT/$name-bench.json" --plot "$OUT/$name" ${BENCH_ARGS:-} 2>&1 \
  | tee "$OUT/bench.log" || rc=$?
[ "$rc" = 0 ] || echo "bench ended with status $rc; the JSON holds the points measured so far"

# Plots of a bench cut short are drawn from what it saved.
[ -s "$OUT/$name-unroll.png" ] || "$py" scripts/bench/summary.py --plot "$OUT/$name" \
  "$OUT/$name-bench.json" > /dev/null || true

echo "== summary"
"$py" scripts/bench/summary.py "$OUT/$name-bench.json" || true
ls -l "$OUT"
exit "$rc"
