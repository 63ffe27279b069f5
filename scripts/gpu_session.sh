#!/usr/bin/env bash
# One call on a lent GPU node (DEVELOPERS.md, "The GPU"), under 10 minutes: the tensor engine
# as shipped beside the FP32 kernel, torch conv3d (TF32 on and off) and cupyx at several
# extents and a mixed-extent bank, then the engines' tests on the NVIDIA device (wgmma on cc
# 9.0, digit slabs, the tuned choice, the FP32 kernel's plan), then the separable path's and
# the non-finite override's. Needs .whl/ and data/mni152_t1_256.nii carried. Results into $OUT.
set -u
source scripts/gpu_env.sh
step() { echo "== $1 ($(date +%T))"; }
python3 -m compileall -q volconv > /dev/null  # as an installed package has them
python3 -m volconv devices --probe > /dev/null 2>&1  # the probe cached, as a user's node has it
step tensor; timeout 200 python3 scripts/bench_tensor.py --device nvidia --no-sweep \
  --extents "7:8,16,32;3:8,16;5:8,16;11:8" --mixed "3:8,5:8,7:8" --json "$OUT/tensor.json" 2>&1 \
  | grep -v -i warn | grep -v "^{\|lambda" | tee "$OUT/tensor.log"
run_tests() {  # LIMIT NAME...: tests/test_NAME.py on the NVIDIA device, log gpu-tests-NAME1.log
  local limit=$1 log="$OUT/gpu-tests-$2.log" files=() name
  shift
  for name in "$@"; do files+=("tests/test_$name.py"); done
  step "tests: $*"
  VOLCONV_TEST_DEVICE=nvidia timeout "$limit" python3 -m pytest -q -p no:cacheprovider \
    "${files[@]}" > "$log" 2>&1
  echo "tests exit $?"; tail -2 "$log"
}
# a fresh node compiles every test's kernels: the first part took over 190 s cold, 60 s warm
run_tests 300 tensor tune plan engine
run_tests 120 separable nonfinite host_memory convert
exit 0
