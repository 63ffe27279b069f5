#!/usr/bin/env bash
# The end-to-end figures on a lent GPU node (DEVELOPERS.md, "The GPU"): bench_e2e on the demo
# scan (float32, float16) and on a synthetic 1024^3 uint8 scan to float16 (16 GiB out), onto
# the node's local disk; the separable bench with the GPU cost model. Results into $OUT.
set -u
source scripts/gpu_env.sh
local=/tmp/e2e; mkdir -p $local; df -h /tmp | tail -1
python3 -m volconv devices --probe > /dev/null 2>&1  # the probe cached, as a user's node has it
echo "== demo"; python3 scripts/bench_e2e.py --device nvidia --dtypes float32,float16 \
  --out $local --json "$OUT/e2e-demo.json" 2>&1 | grep -v Warning
echo "== 1024^3"; timeout 420 python3 scripts/bench_e2e.py --device nvidia --size 1024 \
  --dtypes float16 --out $local --json "$OUT/e2e-1024.json" 2>&1 | grep -v Warning
echo "== separable"; timeout 300 python3 scripts/bench_separable.py --device nvidia --repeats 3 \
  --json "$OUT/separable.json" 2>&1 | grep -v "Warning\|^ "
exit 0
