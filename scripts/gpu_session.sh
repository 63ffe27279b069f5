#!/usr/bin/env bash
# One call on a lent GPU node (see DEVELOPERS.md, "The GPU"): correctness of every path on the
# NVIDIA device, the separable bench with cupyx beside it, the kernel bench and the demo run
# end to end (float32 and float16). Results into $OUT. Needs .whl/ (pyopencl and friends for
# the node's Python) and data/mni152_t1_256.nii carried along.
set -u
source scripts/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv > "$OUT/nvidia-smi.txt" 2>&1
step() { echo "== $1 ($(date +%T))"; }
step devices; python3 -m volconv devices --probe 2>&1 | tee "$OUT/devices.txt"
step tests
VOLCONV_TEST_DEVICE=nvidia timeout 300 python3 -m pytest -q -x -p no:cacheprovider \
  tests/test_engine.py tests/test_nonfinite.py tests/test_separable.py > "$OUT/gpu-tests.log" 2>&1
echo "tests exit $?"; tail -3 "$OUT/gpu-tests.log"
step separable
timeout 420 python3 scripts/bench_separable.py --device nvidia --repeats 5 \
  --json "$OUT/separable.json" 2>&1 | tee "$OUT/separable.log" | grep -v "^ "
step demo
for dtype in float32 float16; do
  /usr/bin/time -v python3 -m volconv run pipelines/demo.toml --device nvidia --overwrite \
    --set "output.dtype=$dtype" --report "$OUT/demo-$dtype.json" > "$OUT/demo-$dtype.log" 2>&1
  grep -E "done|Elapsed|Maximum resident" "$OUT/demo-$dtype.log"
done
exit 0
