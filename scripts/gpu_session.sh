#!/usr/bin/env bash
# One call on a lent GPU node (DEVELOPERS.md, "The GPU"), about 5 minutes: the tensor engine's
# tests on the NVIDIA device with its defaults (wgmma on cc 9.0, digit slabs, the tuned
# choice), which route built wgmma, the engine beside the FP32 kernel, torch and cupyx at
# several extents, and the FP32 kernel with its coefficients compiled in (filt 2) beside
# today's block (filt 1). Needs .whl/ and data/mni152_t1_256.nii carried. Results into $OUT.
set -u
source scripts/gpu_env.sh
step() { echo "== $1 ($(date +%T))"; }
python3 -m compileall -q volconv > /dev/null  # as an installed package has them
python3 -m volconv devices --probe > /dev/null 2>&1  # the probe cached, as a user's node has it
step "wgmma route"
timeout 20 python3 - <<'PY' 2>&1 | grep -v -i warn
import numpy as np
import pyopencl as cl
from volconv.device import select_device
from volconv.programs import context_for, kernel_source
from volconv.tensor import DEFAULT_SHAPES, tensor_defines
dev = select_device("nvidia")
ctx, _ = context_for(dev)
flags = [f"-D{k}={v}" for k, v in tensor_defines((7, 7, 7), np.dtype(np.uint8), DEFAULT_SHAPES[1]).items()]
try:
    cl.Program(ctx, kernel_source("tensor_int8.cl")).build(options=[*flags, "-cl-nv-arch", "sm_90a"])
    print("wgmma builds with -cl-nv-arch sm_90a")
except cl.Error as e:
    print("-cl-nv-arch sm_90a refused: the PTX is retargeted", str(e).splitlines()[0])
PY
step tests
VOLCONV_TEST_DEVICE=nvidia timeout 150 python3 -m pytest -q -x -p no:cacheprovider \
  tests/test_tensor.py tests/test_tune.py > "$OUT/gpu-tests.log" 2>&1
echo "tests exit $?"; tail -2 "$OUT/gpu-tests.log"
step tensor; timeout 90 python3 scripts/bench_tensor.py --device nvidia --no-sweep \
  --extents "7:8,16,32;3:8;5:8;11:8" --json "$OUT/tensor.json" 2>&1 | grep -v -i warn \
  | grep -v "^{" | tee "$OUT/tensor.log"
step "fp32 compiled coefficients"; timeout 60 python3 scripts/sweep_fp32_gpu.py --device nvidia \
  --repeats 15 --ns 8 --sass \
  --points '{"8":[[8,1,-1,2],[8,1,2,2],[16,1,-1,2],[16,1,2,2],[8,1,2,1]]}' \
  --json "$OUT/fp32-compiled.json" 2>&1 | grep -v -i warn | tail -12 | tee "$OUT/fp32-compiled.log"
exit 0
