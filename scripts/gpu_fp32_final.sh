#!/bin/bash
# The FP32 kernel's final defaults (a block per pass, ROLL for width 1 past the code budget
# and for width 8 at kz <= 3, the row-loop unroll by kz) at 3^3-11^3 on the H100; the GPU
# tests; `volconv bench --tune` (rows searched) for N = 8 of 11^3. One device call.
# Usage: scripts/gpu_fp32_final.sh OUTDIR TAG
set -u
out=$1; tag=$2
sweep() { PYOPENCL_NO_CACHE=1 timeout 100 python3 scripts/sweep_fp32_gpu.py --device nvidia "$@"; }
sweep --ns 8,1,2,4,13 --extent 7 --points '{"8":[[]],"1":[[]],"2":[[]],"4":[[]],"13":[[]]}' \
  --json $out/$tag-k7.json
sweep --ns 8,1,13 --extent 3 --points '{"8":[[]],"1":[[]],"13":[[]]}' --json $out/$tag-k3.json
sweep --ns 8,1 --extent 5 --points '{"8":[[]],"1":[[]]}' --json $out/$tag-k5.json
sweep --ns 8,1,2,4 --extent 9 --points '{"8":[[]],"1":[[]],"2":[[]],"4":[[]]}' \
  --json $out/$tag-k9.json
sweep --ns 8,1 --extent 11 --points '{"8":[[], {"width":4}],"1":[[]]}' --json $out/$tag-k11.json
VOLCONV_TEST_DEVICE=nvidia timeout 200 python3 -m pytest -q -x -p no:cacheprovider \
  tests/test_engine.py tests/test_plan.py tests/test_tune.py 2>&1 | tail -4
timeout 120 python3 -m volconv bench --tune --device nvidia --size 256 --n 8 --extent 11 \
  --repeats 5 --json $out/$tag-tune11.json 2>&1 | grep -v Warning | tail -30
