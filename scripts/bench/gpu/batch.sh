#!/usr/bin/env bash
# The batch figures on a two-GPU node (benchmarks/README.md, "On a GPU node"): 16 inputs of 256^3 uint8
# through pipelines/demo.toml with --devices all against one device, float32 and float16, onto
# the node's local disk, beside two raw h5py writers. Results into $OUT.
set -u
source scripts/gpu_env.sh
nvidia-smi -L
python3 -m volconv devices --probe 2>&1 | grep -E "^[0-9]|FMA"
timeout 540 python3 scripts/bench_batch.py --out /tmp/vb --devices all --inputs 16 \
  --json "$OUT/batch.json" 2>&1 | grep -v Warning
exit 0
