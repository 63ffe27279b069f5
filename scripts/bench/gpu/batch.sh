#!/usr/bin/env bash
# The batch figures on a two-GPU node (benchmarks/README.md, "On a GPU node"): 48, 8 and 2
# inputs of 256^3 uint8 through pipelines/demo.toml, --devices all against one device, float32
# and float16, each a whole command timed from outside, onto the node's local disk, beside raw
# h5py writers of the same bytes (one, one per GPU, two per GPU); 48 inputs also with one
# process per device; each device's worker's start to ready, alone; every command 3 times in
# turns (the ratios from the medians), all counts in this one call. Results into $OUT.
set -u
source scripts/gpu_env.sh
nvidia-smi -L
nproc
python3 -m volconv devices --probe 2>&1 | grep -E "^[0-9]|FMA"
timeout 560 python3 scripts/bench/run.py batch --out /tmp/vb --devices all --inputs 48,8,2 \
  --one-process 48 --ready-repeats 3 --repeats 3 --json "$OUT/batch.json" 2>&1 | grep -v Warning \
  | tee "$OUT/batch.log"
df -h /tmp | tail -1
exit 0
