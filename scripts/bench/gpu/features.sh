#!/usr/bin/env bash
# Issue 23's figures on one GPU (benchmarks/README.md, "On a GPU node"), in one call: the
# feature tests on the NVIDIA device; `features` on the demo scan (256^3 uint8) beside cuCIM
# and pyclesperanto (carry their wheels: cucim-cu13, pyclesperanto, pyclesperanto-opencl),
# medians of 5; end to end, the ilastik preset against the ilastik raw-response bank (bytes
# written, in-run wall), twice in turns. Results into $OUT.
set -u
source scripts/gpu_env.sh
nvidia-smi -L
step() { echo "== $1 ($(date +%T))"; }
step "feature tests on the GPU"
VOLCONV_TEST_DEVICE=nvidia timeout 240 python3 -m pytest -q -x -p no:cacheprovider \
  tests/test_features.py tests/test_presets.py tests/test_structure.py tests/test_boundary.py \
  > "$OUT/features-tests.log" 2>&1
echo "tests exit $?"; tail -2 "$OUT/features-tests.log"
step "features beside cuCIM and pyclesperanto"
timeout 240 python3 scripts/bench/run.py features --mode gpu --size 256 --repeat 5 \
  --json "$OUT/features.json" --save-volume /tmp/scan256.npy 2>&1 | grep -v Warn
step "end to end: the ilastik preset against its raw-response bank"
for r in 1 2; do
  for k in preset:ilastik_preset raw:ilastik_features; do
    rm -rf /tmp/e2e
    timeout 60 python3 -m volconv run "pipelines/${k#*:}.toml" --overwrite \
      --set 'input.paths=["/tmp/scan256.npy"]' --set "output.path=/tmp/e2e/${k%%:*}/{stem}.h5" \
      --report "$OUT/e2e-ilastik-${k%%:*}-$r.json" > /dev/null 2>&1
    echo "$k round $r: exit $?, $(du -sb /tmp/e2e | cut -f1) bytes written"
  done
done
exit 0
