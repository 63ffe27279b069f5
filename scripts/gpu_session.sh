#!/usr/bin/env bash
# One call on a lent GPU node (DEVELOPERS.md, "The GPU"), about 9 minutes: every GPU path's
# tests on the NVIDIA device (tensor cores and their digit slabs, the fused and tree separable
# paths, the device's stored types, the direct kernel, non-finite voxels), then the figures
# that changed last: the tensor engine beside the FP32 kernel, torch and cupyx; 16-bit and
# float volumes as digits; the demo end to end; the start-up phase by phase. Needs .whl/ and
# data/mni152_t1_256.nii carried. Results into $OUT.
set -u
source scripts/gpu_env.sh
step() { echo "== $1 ($(date +%T))"; }
local=/tmp/e2e; mkdir -p $local
python3 -m compileall -q volconv > /dev/null  # as an installed package has them
python3 -m volconv devices --probe > /dev/null 2>&1  # the probe cached, as a user's node has it
step tests
VOLCONV_TEST_DEVICE=nvidia timeout 270 python3 -m pytest -q -x -p no:cacheprovider \
  tests/test_tensor.py tests/test_separable.py tests/test_convert.py tests/test_engine.py \
  tests/test_nonfinite.py > "$OUT/gpu-tests.log" 2>&1
echo "tests exit $?"; tail -2 "$OUT/gpu-tests.log"
step tensor; timeout 150 python3 scripts/bench_tensor.py --device nvidia --no-sweep \
  --extents "7:8,16,32;3:8;5:8;11:8" --json "$OUT/tensor.json" 2>&1 | grep -v -i warn \
  | tee "$OUT/tensor.log"
step digits; timeout 70 python3 scripts/bench_tensor_types.py --device nvidia \
  --json "$OUT/tensor-types.json" 2>&1 | grep -v -i warn | tee "$OUT/tensor-types.log"
step demo; timeout 50 python3 scripts/bench_e2e.py --device nvidia --repeats 3 \
  --dtypes float32 --out $local --json "$OUT/e2e-demo.json" 2>&1 | grep -v Warn
step "start-up"; timeout 30 python3 scripts/profile_start.py pipelines/demo.toml \
  --device nvidia --json "$OUT/start.json" 2>&1 | grep -v Warn
exit 0
