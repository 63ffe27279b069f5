#!/usr/bin/env bash
# One call on a lent GPU node (DEVELOPERS.md, "The GPU"), about 7 minutes: every GPU path's
# tests on the NVIDIA device (tensor cores, the fused and tree separable paths, the device's
# stored types, the direct kernel, non-finite voxels), then the end-to-end figures that
# changed last (1024^3 -> float16 with its max RSS, the demo), the start-up phase by phase and
# lzf on every core. Needs .whl/ and data/mni152_t1_256.nii carried. Results into $OUT.
set -u
source scripts/gpu_env.sh
step() { echo "== $1 ($(date +%T))"; }
local=/tmp/e2e; mkdir -p $local
python3 -m volconv devices --probe > /dev/null 2>&1  # the probe cached, as a user's node has it
step tests
VOLCONV_TEST_DEVICE=nvidia timeout 240 python3 -m pytest -q -x -p no:cacheprovider \
  tests/test_tensor.py tests/test_separable.py tests/test_convert.py tests/test_engine.py \
  tests/test_nonfinite.py > "$OUT/gpu-tests.log" 2>&1
echo "tests exit $?"; tail -2 "$OUT/gpu-tests.log"
step "1024^3"; timeout 150 python3 scripts/bench_e2e.py --device nvidia --size 1024 \
  --repeats 1 --dtypes float16 --out $local --json "$OUT/e2e-1024.json" 2>&1 | grep -v Warn
step demo; timeout 60 python3 scripts/bench_e2e.py --device nvidia --repeats 3 \
  --dtypes float32,float16,uint8 --out $local --json "$OUT/e2e-demo.json" 2>&1 | grep -v Warn
step "start-up"; timeout 30 python3 scripts/profile_start.py pipelines/demo.toml \
  --device nvidia --json "$OUT/start.json" 2>&1 | grep -v Warn
step lzf; timeout 80 python3 scripts/bench_codecs.py --size 192 --codecs lzf --repeats 1 \
  --out $local/codecs --json "$OUT/codecs.json" 2>&1 | grep -v Warn
exit 0
