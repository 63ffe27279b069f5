#!/bin/bash
# The FP32 kernel's plan with a block per pass, ROLL past the code budget and the row-loop
# unroll by extent, against the old choices forced by knobs, on the H100 in one device call;
# then the GPU tests. Usage: scripts/gpu_fp32_pass.sh OUTDIR TAG
set -u
out=$1; tag=$2
sweep() { PYOPENCL_NO_CACHE=1 python3 scripts/sweep_fp32_gpu.py --device nvidia --sass "$@"; }
L='{"8":[[32,4]]}'
P7='{"1":[[]], "2":[[]], "4":[[]],
     "8":[[], [8,1,3,1,0,8], [8,1,4,1,0,8]],
     "3":[[], {"width":4}], "5":[[], {"unroll":4,"rows":2}], "6":[[], {"unroll":4,"rows":2}],
     "7":[[], {"width":8}], "13":[[], {"unroll":8,"rows":1}],
     "16":[[], {"width":16}, {"width":16,"unroll":4,"rows":1}]}'
sweep --ns 8,1,2,4,3,5,6,7,13,16 --extent 7 --points "$P7" --locals "$L" --json $out/$tag-k7.json
P9='{"1":[[], {"unroll":8,"rows":2}], "2":[[], {"unroll":4,"rows":2}],
     "4":[[], {"unroll":16,"rows":1}],
     "8":[[], {"unroll":8,"rows":1,"row_unroll":2}, {"unroll":8,"rows":1,"row_unroll":1,"roll":1}],
     "13":[[], {"unroll":8,"rows":1,"row_unroll":2}]}'
sweep --ns 8,1,2,4,13 --extent 9 --points "$P9" --json $out/$tag-k9.json
P11='{"1":[[], {"unroll":16,"rows":1}], "2":[[], {"unroll":16,"rows":1}],
      "4":[[], {"unroll":16,"rows":1}],
      "8":[[], {"unroll":8,"rows":1,"row_unroll":2}, {"unroll":8,"rows":1,"row_unroll":-1,"filt":1}]}'
sweep --ns 8,1,2,4 --extent 11 --points "$P11" --json $out/$tag-k11.json
P3='{"1":[[], {"unroll":8,"rows":4,"roll":1,"row_unroll":4}],
     "8":[[], [8,1,1,1,1,8], [8,1,2,1,1,8], [8,1,-1,1,1,8],
          {"width":4,"unroll":4,"rows":4,"roll":1,"row_unroll":1}],
     "4":[[], {"unroll":4,"rows":4,"roll":1,"row_unroll":1}]}'
sweep --ns 8,1,4 --extent 3 --points "$P3" --locals "$L" --json $out/$tag-k3.json
P5='{"1":[[]], "8":[[], [8,1,1,1,1,8]], "13":[[], {"unroll":8,"rows":1}]}'
sweep --ns 8,1,13 --extent 5 --points "$P5" --locals "$L" --json $out/$tag-k5.json
VOLCONV_TEST_DEVICE=nvidia timeout 170 python3 -m pytest -q -x -p no:cacheprovider \
  tests/test_engine.py tests/test_plan.py 2>&1 | tail -6
